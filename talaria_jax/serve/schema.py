"""The OpenAPI description of the instance server (`serve.app`, talaria-serve) and of the gateway
(`serve.gateway`, talaria-route): pydantic models of every request body and response, the FastAPI
route arguments that attach them, and `publish`, which serves each app's `/openapi.json`.

The models describe; they validate nothing a server receives. The hand parser
(`protocol.parse_completion`, `protocol.parse_chat`) stays the validator, so every error keeps
OpenAI's error body. A constraint written here is one the server enforces (the parser's, or the
engine's for `temperature` and `top_p`), never a stricter one: a request the server accepts is valid
under its schema. Fields that OpenAI defines and the server checks by hand or does not read
(`tool_choice`, `response_format`, a message's `name`, ...) carry their OpenAI shape as an example
and no type. An
instance's limits (`protocol.Limits`) are written into its own document; the gateway's leaves them
to its instances.
"""
import copy
import importlib.metadata
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from talaria_jax.engine.sampling import MAX_TOP_LOGPROBS
from talaria_jax.scheduler.api import WeightState
from talaria_jax.scheduler.session import MAX_PRIORITY
from talaria_jax.serve.protocol import ROLES, SEED_LIMIT, Limits

__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "HEALTH", "MESSAGES", "METRICS", "MODELS", "PROBE", "RESPONSES_CREATE",
           "RESPONSES_DELETE", "RESPONSES_GET", "VERSION", "components", "publish"]


def _version() -> str:
    try:
        return importlib.metadata.version("talaria_jax")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


VERSION = _version()
REF = "#/components/schemas/"


# ---- requests ------------------------------------------------------------------------------------
class _Open(BaseModel):
    """A request object: fields beyond those listed are allowed (OpenAI's clients send others)."""
    model_config = ConfigDict(extra="allow")


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class StreamOptions(_Open):
    """Options of a streamed answer (only with `stream: true`)."""
    include_usage: bool = Field(False, description="A last chunk with `usage` and no choices, before `[DONE]`.")


class AgentHints(BaseModel):
    """What the agent knows of the call's session (all optional); the scheduler of a multi-model
    instance and the gateway use them, and estimate what is left out."""
    model_config = ConfigDict(extra="forbid")
    calls_left: int | None = Field(None, ge=0, description="Calls the session makes after this one; 0: this "
                                   "call ends it (its KV is freed when the call finishes).")
    tool_s: float | None = Field(None, ge=0, description="Seconds the agent's tool runs after this call before "
                                 "the next one (KV reservations and slot holds follow it).")
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                                 description="Higher first: the session counts 2**priority times in the slot order.")


class _Request(_Open):
    """The fields completions and chat completions share."""
    model: str = Field(description="A served model's name (`GET /v1/models`).")
    temperature: float | None = Field(None, ge=0, le=100, description="0 samples greedily. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling. Default 1.")
    top_k: int | None = Field(None, ge=-1, description="Sample among the k most likely tokens (0 or -1: all).")
    n: int | None = Field(None, ge=1, description="Choices to generate (default 1); choice i samples with `seed + i`.")
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT - 1, description="Makes sampling reproducible.")
    stop: NonEmptyText | list[NonEmptyText] | None = Field(
        None, description="Strings that end a choice; its text is cut before the earliest match.")
    stream: bool | None = Field(None, description="Server-sent events instead of one JSON object. Default false.")
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=0, le=0, description="Only 0: penalties are not supported.")
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="Only 0: penalties are not supported.")
    session_id: str | None = Field(None, min_length=1, max_length=256, description=(
        "The agent session the call belongs to (the `x-session-id` header takes precedence); the "
        "scheduler keeps a session's KV cache where its next call will go."))
    agent_hints: AgentHints | None = Field(None, description=(
        "What the agent knows of the session (the `x-agent-hints` header replaces it)."))
    user: Any = Field(None, description="Accepted and not used.", examples=["user-1234"])


class CompletionRequest(_Request):
    """`POST /v1/completions`: one prompt, as text or as token ids."""
    prompt: Union[NonEmptyText, TokenIds, Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]] = Field(
        description="Text, or a list of token ids; a batch of exactly one of either is taken as that prompt.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate per choice. Default 16.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Log probabilities of the chosen tokens and of this many most likely ones at each position."))
    echo: Any = Field(None, description="Not supported: absent, null or false.", examples=[False])


class TextPart(_Open):
    """A text part of a message's content (the only kind served)."""
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    """One message of the conversation, as the model's chat template reads it."""
    role: Literal[ROLES]
    content: str | list[TextPart] | None = Field(None, description="Text, or text parts (joined).")
    name: Any = Field(None, description="The author's name, passed to the chat template.", examples=["alice"])
    tool_calls: Any = Field(None, description=(
        "An assistant's tool calls (its content may then be null); each needs a tool message answering it "
        "before the next other message."), examples=[
        [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]])
    tool_call_id: Any = Field(None, description="The call a tool message answers (required on tool messages).",
                              examples=["call_1"])


class FunctionDefinition(_Open):
    """A function the model may call."""
    name: NonEmptyText
    description: Any = Field(None, description="What the function does.", examples=["The weather in a city."])
    parameters: dict[str, Any] = Field(default_factory=dict, description="The arguments, as a JSON Schema object.")


class Tool(_Open):
    """A tool the chat template offers the model."""
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: `messages` (and `tools`) rendered by the model's chat template."""
    model_config = ConfigDict(extra="allow", json_schema_extra={  # top_logprobs is read only with logprobs: true
        "if": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        "then": {"properties": {"top_logprobs": {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, {"type": "null"}]}}}})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description=(
        "Tokens to generate per choice. Default: the rest of the context, up to the server's limit."))
    max_completion_tokens: int | None = Field(None, ge=1, description="`max_tokens`, OpenAI's newer name (wins).")
    tools: list[Tool] | None = Field(None, description=(
        "Functions the model may call: its answer's tool calls come parsed in `message.tool_calls`."))
    tool_choice: Any = Field(None, description=(
        "`none`, `auto` (the default with tools), `required`, or "
        "`{\"type\": \"function\", \"function\": {\"name\": ...}}`; required and named are enforced by a grammar. "
        "Only with `tools`."), examples=["auto"])
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one answer (default true). Only "
                                                                "with `tools`.")
    response_format: Any = Field(None, description=(
        "`{\"type\": \"text\"}`, `{\"type\": \"json_object\"}` or `{\"type\": \"json_schema\", \"json_schema\": "
        "{\"name\": ..., \"schema\": {...}}}`: the JSON kinds are enforced by a grammar (a schema feature it "
        "cannot enforce: 400)."), examples=[{"type": "text"}])
    logit_bias: Any = Field(None, description=(
        "Token id (as a string) to a bias in [-100, 100] added to its logit before sampling."),
        examples=[{"50256": -100}])
    logprobs: bool | None = Field(None, description="Log probabilities of the chosen tokens.")
    top_logprobs: Any = Field(None, description=(
        f"With `logprobs: true`, an integer in [0, {MAX_TOP_LOGPROBS}]: the most likely tokens at each position "
        "(ignored otherwise)."), examples=[2])


# ---- responses -----------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache.")


class Usage(BaseModel):
    """Token counts of one request (all its choices)."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Per-token log probabilities of a completion choice, as parallel lists."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = Field(description=(
        "Per position, the most likely tokens' log probabilities by token text (empty objects with "
        "`logprobs: 0`); null when no token was generated."))


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class _Answer(BaseModel):
    """What every answer and stream chunk of the generation routes carries."""
    id: str
    created: int
    model: str


class Completion(_Answer):
    """The answer of `POST /v1/completions`."""
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str = Field(description="The text added since the choice's previous chunk.")
    logprobs: CompletionLogprobs | None = Field(description="The tokens added since the previous chunk, if asked.")
    finish_reason: FinishReason | None = Field(description="Set in the choice's last chunk.")


class CompletionChunk(_Answer):
    """One event of a streamed completion."""
    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice] = Field(description="Empty in the usage chunk.")
    usage: Usage | None = Field(None, description="Only in the last chunk, with `stream_options.include_usage`.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="The token's UTF-8 bytes.")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Per-token log probabilities of a chat choice."""
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as a JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int = Field(description="The call's place in the answer's list (a stream sends each call whole).")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="The generated text; null when the answer is only tool calls.")
    tool_calls: list[ToolCall] | None = Field(None, description="The calls parsed from the answer (with `tools`).")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Answer):
    """The answer of `POST /v1/chat/completions`."""
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message: the role in its first chunk, then text (empty: none)."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(None, description="In the choice's last chunk: its calls.")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(description="The tokens added since the previous chunk, if asked.")
    finish_reason: FinishReason | None = Field(description="Set in the choice's last chunk.")


class ChatCompletionChunk(_Answer):
    """One event of a streamed chat completion."""
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice] = Field(description="Empty in the usage chunk.")
    usage: Usage | None = Field(None, description="Only in the last chunk, with `stream_options.include_usage`.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="The context length (instance servers).")


class ModelList(BaseModel):
    """The served models (the gateway's: those of its live instances)."""
    object: Literal["list"]
    data: list[ModelCard]


class InstanceStatus(BaseModel):
    """One of the gateway's instances."""
    name: str
    url: str
    up: bool = Field(description="Whether it takes calls.")
    models: list[str]


class Health(BaseModel):
    """Whether the server takes new calls."""
    status: str = Field(description="`ok`; else why not (an instance: `draining`, `dead`; the gateway: "
                                    "`no instance`).")
    instances_up: int | None = Field(None, description="The gateway's instances that take calls.")
    instances: list[InstanceStatus] | None = Field(None, description="The gateway's instances.")


class ProbeAnswer(BaseModel):
    """The router's view of an instance for one request: the instance's state, and the tokens of the
    request's prompt it holds in its prefix cache, on device and on host, under the caller's tenant."""
    model_config = ConfigDict(extra="allow")
    name: str
    policy: str
    models: list[str]
    active_model: str | None
    weights: dict[str, WeightState]
    switch_s: dict[str, float] = Field(description="The estimated seconds of a switch to each model.")
    page_size: dict[str, int]
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_reserved: int
    running: int
    waiting: int
    switches: int
    switch_seconds: float
    recomputed_tokens: int
    sessions: int
    sessions_forgotten: int
    host_kv_bytes: int
    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    probe: str = Field(description="Sent back as the `x-talaria-probe` header with the request, the request "
                                   "is served as checked here, without being parsed, rendered or tokenized again.")
    prompt_token_ids: list[int] | None = Field(None, description="The prompt's token ids (with `tokens=true`).")


class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `service_unavailable` or "
                                  "`server_error`.")
    param: str | None = Field(description="The request field at fault, e.g. `max_tokens`, `messages[0].role`.")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every error of both servers (also the event that ends a failed stream)."""
    error: ErrorBody


# ---- Anthropic's Messages API --------------------------------------------------------------------
class AnthropicMessage(_Open):
    """One message: a string, or content blocks (text; an assistant's `tool_use`; a user's
    `tool_result`, whose content is a string or text blocks; thinking blocks are dropped)."""
    role: Literal["user", "assistant"]
    content: Any = Field(description="A string or a list of content blocks.", examples=[
        [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 degrees"}, {"type": "text", "text": "Thanks"}]])


class MessagesRequest(_Open):
    """`POST /v1/messages`: Anthropic's Messages API, served through the chat path (`serve.messages`)."""
    model: str = Field(description="A served model's name (`GET /v1/models`).")
    max_tokens: int = Field(ge=1, description="Tokens to generate, up to the server's limit.")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = Field(None, description="A string or text blocks, before the conversation.",
                        examples=["You are a careful agent."])
    stop_sequences: Any = Field(None, description="Strings that end the answer (`stop_reason: stop_sequence`).",
                                examples=[["\n\nHuman:"]])
    stream: bool | None = Field(None, description="Anthropic's server-sent events instead of one JSON object.")
    temperature: float | None = Field(None, ge=0, le=100, description="0 samples greedily. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="Sample among the k most likely tokens (0 or -1: all).")
    tools: Any = Field(None, description="Custom tools: `name`, `description`, `input_schema`.", examples=[
        [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]])
    tool_choice: Any = Field(None, description="`{\"type\": auto | any | tool | none}` (`name` with tool; "
                             "`disable_parallel_tool_use`). Only with `tools`.", examples=[{"type": "auto"}])
    metadata: Any = Field(None, description="`user_id`: a Claude-Code-style id ending in `_session_<id>` names the "
                          "session.", examples=[{"user_id": "user_1_session_0b9f2c1e"}])


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens computed (not read from the cache).")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens read from the prefix cache.")
    cache_creation_input_tokens: int


class AnthropicBlock(BaseModel):
    """A block of an answer: text, or a tool call (`tool_use`, its `input` an object)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "tool_use"]


class MessagesAnswer(BaseModel):
    """The answer of `POST /v1/messages`."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicEvent(BaseModel):
    """One event of a streamed Messages answer (its `type` is also the SSE event name)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "ping", "error"]


class AnthropicErrorBody(BaseModel):
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `not_found_error`, "
                                  "`request_too_large`, `overloaded_error` or `api_error`.")
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body: every error of `/v1/messages` (also the event that ends a failed stream)."""
    type: Literal["error"]
    error: AnthropicErrorBody


# ---- OpenAI's Responses API ----------------------------------------------------------------------
class ResponsesRequest(_Open):
    """`POST /v1/responses`: OpenAI's Responses API, served through the chat path (`serve.responses`)."""
    model: str = Field(description="A served model's name (`GET /v1/models`).")
    input: Any = Field(description="A string, or a list of items: messages (text parts), `function_call` and "
                       "`function_call_output` (reasoning items are dropped).", examples=[
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}]])
    instructions: str | None = Field(None, description="A system message before the input (not carried over by "
                                     "`previous_response_id`).")
    previous_response_id: str | None = Field(None, description="A stored response whose whole conversation comes "
                                             "before `input`; the call continues its session.")
    conversation: Any = Field(None, description="A conversation id (or `{\"id\": ...}`): the call's session.",
                              examples=["conv_1"])
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256, description="The call's session.")
    store: bool | None = Field(None, description="Keep the response for `previous_response_id`, GET and DELETE "
                               "(default true).")
    max_output_tokens: int | None = Field(None, ge=1, description="Tokens to generate, up to the server's limit.")
    temperature: float | None = Field(None, ge=0, le=100, description="0 samples greedily. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = Field(None, description="The Responses API's server-sent events instead of one object.")
    tools: Any = Field(None, description="Function tools: `{\"type\": \"function\", \"name\", \"parameters\"}`.",
                       examples=[[{"type": "function", "name": "get_weather", "parameters": {
                           "type": "object", "properties": {"city": {"type": "string"}}}}]])
    tool_choice: Any = Field(None, description="`none`, `auto`, `required` or `{\"type\": \"function\", "
                             "\"name\": ...}`.", examples=["auto"])
    parallel_tool_calls: bool | None = None
    text: Any = Field(None, description="`format`: text, json_object or json_schema (`name`, `schema`).",
                      examples=[{"format": {"type": "text"}}])
    metadata: Any = Field(None, description="Kept with the response.", examples=[{"run": "7"}])


class ResponseObject(BaseModel):
    """A response: its output items (an assistant `message` of `output_text` parts, `function_call`s)."""
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseEvent(BaseModel):
    """One event of a streamed response (its `type` is also the SSE event name), numbered by
    `sequence_number`."""
    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


REQUESTS = (CompletionRequest, ChatCompletionRequest, MessagesRequest, ResponsesRequest)
RESPONSES = (Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk, ModelList, Health, ProbeAnswer,
             ErrorResponse, MessagesAnswer, AnthropicEvent, AnthropicError, ResponseObject, ResponseEvent,
             ResponseDeleted)


def components(limits: Limits | None) -> dict[str, dict]:
    """The JSON Schemas of every model, by name, their references into `#/components/schemas/`.
    `limits`: an instance's, written into its request schemas (None: the gateway's, which has none)."""
    _, top = models_json_schema([(m, "validation") for m in REQUESTS + RESPONSES], ref_template=REF + "{model}")
    schemas = top["$defs"]
    if limits is not None:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            s = schemas[name]
            props = s["properties"]
            for f in ("max_tokens", "max_completion_tokens"):
                if f in props:
                    _bound(props[f], maximum=limits.max_tokens)
            _bound(props["n"], maximum=limits.max_n)
            for branch in _branches(props["stop"]):
                text = branch["items"] if branch["type"] == "array" else branch
                text["maxLength"] = limits.max_stop_chars
                if branch["type"] == "array":
                    branch["maxItems"] = limits.max_stop
            s["description"] += f" At most {limits.max_body_bytes} bytes."
    return schemas


def _branches(prop: dict) -> list[dict]:
    """The non-null alternatives of a property's schema."""
    return [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]


def _bound(prop: dict, **keywords) -> None:
    for b in _branches(prop):
        b.update(keywords)


# ---- route arguments -----------------------------------------------------------------------------
def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF + model.__name__}


def _json(model: type[BaseModel], description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


_ERRORS = {
    400: "A bad request: not JSON, a field of the wrong type or out of range, a prompt over the context, a "
         "conversation the chat template refuses, a bad x-session-id or x-agent-hints header (`param` names the field)",
    401: "No API key, or not one of the server's (`Authorization: Bearer <key>`)",
    404: "The model does not exist here",
    413: "The body is over the server's limit",
    499: "The client disconnected before the answer (it never reads this)",
    500: "A server bug (logged; the body has no traceback)",
    503: "The server is draining or its engine failed (the gateway: no instance serves the model)",
}


def _errors(*statuses: int, **descriptions: str) -> dict[int, dict]:
    """OpenAI error bodies for `statuses`; `descriptions` (`s404=...`) replaces a status's text."""
    return {s: _json(ErrorResponse, descriptions.get(f"s{s}", _ERRORS[s])) for s in statuses}


def _events(chunk: type[BaseModel]) -> dict:
    """A `text/event-stream` of `chunk`s: each event's `data` is a chunk, an error body (the last
    event of a stream that fails), or `[DONE]` (the last event of one that does not)."""
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                            "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
    return {"itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


def _generated(model: type[BaseModel], chunk: type[BaseModel]) -> dict:
    return {"description": "The answer: one JSON object, or with `stream: true` server-sent events (text "
                           "deltas, then `data: [DONE]`).",
            "content": {"application/json": {"schema": _ref(model)}, "text/event-stream": _events(chunk)}}


def _body(*models: type[BaseModel]) -> dict:
    schema = _ref(models[0]) if len(models) == 1 else {"anyOf": [_ref(m) for m in models]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_SECURED = {"security": [{"bearer": []}]}
_SESSION_HEADER = {"name": "x-session-id", "in": "header", "required": False,
                   "description": "The agent session of the call (instead of the body's `session_id`).",
                   "schema": {"type": "string", "pattern": "^[ -~]{1,256}$"}}
_HINTS_HEADER = {"name": "x-agent-hints", "in": "header", "required": False,
                 "description": "The call's agent hints as name=number pairs (`calls_left=0, tool_s=1.5, priority=1`), "
                                "instead of the body's `agent_hints`.", "schema": {"type": "string"}}
_GENERATION_ERRORS = (400, 401, 404, 413, 499, 500, 503)

# FastAPI route arguments (`@app.get(path, **HEALTH)`)
HEALTH = {"summary": "Whether the server takes new calls (no API key)",
          "responses": {200: _json(Health, "It takes new calls"), 503: _json(Health, "It takes none"),
                        **_errors(500)}}
MODELS = {"summary": "The served models", "openapi_extra": _SECURED,
          "responses": {200: _json(ModelList, "The served models"), **_errors(401, 500)}}
METRICS = {"summary": "Prometheus metrics", "openapi_extra": _SECURED, "response_class": PlainTextResponse,
           "responses": {200: {"description": "Prometheus' text format",
                               "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401, 500)}}
COMPLETIONS = {"summary": "Completes a prompt", "responses": {200: _generated(Completion, CompletionChunk),
                                                              **_errors(*_GENERATION_ERRORS)},
               "openapi_extra": {**_SECURED, "parameters": [_SESSION_HEADER, _HINTS_HEADER], **_body(CompletionRequest)}}
CHAT_COMPLETIONS = {"summary": "Answers a conversation",
                    "responses": {200: _generated(ChatCompletion, ChatCompletionChunk), **_errors(*_GENERATION_ERRORS)},
                    "openapi_extra": {**_SECURED, "parameters": [_SESSION_HEADER, _HINTS_HEADER], **_body(ChatCompletionRequest)}}
_ANTHROPIC_ERRORS = {s: {"description": d, "content": {"application/json": {"schema": _ref(AnthropicError)}}}
                     for s, d in _ERRORS.items() if s in _GENERATION_ERRORS}


def _named_events(answer: type[BaseModel], event: type[BaseModel], description: str) -> dict:
    """An answer as one JSON object or, streamed, as server-sent events that carry their type as the
    event's name (Anthropic's and the Responses API's: no `[DONE]`)."""
    item = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(event)}}}
    return {"description": description, "content": {"application/json": {"schema": _ref(answer)},
                                                    "text/event-stream": {"itemSchema": item}}}


MESSAGES = {"summary": "Answers a conversation (Anthropic's Messages API)",
            "responses": {200: _named_events(MessagesAnswer, AnthropicEvent, (
                "The message: one JSON object, or with `stream: true` Anthropic's server-sent events "
                "(message_start ... message_stop).")), **_ANTHROPIC_ERRORS},
            "openapi_extra": {"security": [{"bearer": []}, {"x-api-key": []}], **_body(MessagesRequest)}}
RESPONSES_CREATE = {
    "summary": "Answers an input (OpenAI's Responses API)",
    "responses": {200: _named_events(ResponseObject, ResponseEvent, (
                      "The response: one JSON object, or with `stream: true` the Responses API's server-sent events "
                      "(response.created ... response.completed).")),
                  **_errors(*_GENERATION_ERRORS, s404="The model does not exist here, or `previous_response_id` "
                                                      "names no stored response of the caller's")},
    "openapi_extra": {**_SECURED, "parameters": [_SESSION_HEADER], **_body(ResponsesRequest)}}
RESPONSES_GET = {"summary": "A stored response", "openapi_extra": _SECURED,
                 "responses": {200: _json(ResponseObject, "The response as it was answered"),
                               **_errors(401, 404, 500, s404="No stored response of the caller's has this id")}}
RESPONSES_DELETE = {"summary": "Deletes a stored response", "openapi_extra": _SECURED,
                    "responses": {200: _json(ResponseDeleted, "Deleted"),
                                  **_errors(401, 404, 500, s404="No stored response of the caller's has this id")}}
PROBE = {"summary": "The router's view of this instance for one request",
         "responses": {200: _json(ProbeAnswer, "The instance's state and the prompt's cached tokens"),
                       **_errors(400, 401, 404, 413, 500, 503, s404=(
                           "The model does not exist here, or the server has no scheduler (one engine)"))},
         "openapi_extra": {**_SECURED, "parameters": [_SESSION_HEADER, _HINTS_HEADER],
                           **_body(CompletionRequest, ChatCompletionRequest)}}


def publish(app: FastAPI, limits: Limits | None) -> None:
    """Makes `app.openapi()` (what `/openapi.json` serves) the routes' document with the components
    above (`components(limits)`), the bearer-key security scheme, and no 422 responses (the servers
    answer 400 with OpenAI's error body instead)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = copy.deepcopy(get_openapi(title=app.title, version=app.version, description=app.description,
                                            routes=app.routes))
            for path in doc["paths"].values():
                for op in path.values():
                    op["responses"].pop("422", None)
            comps = doc.setdefault("components", {})
            comps["schemas"] = {**{k: v for k, v in comps.get("schemas", {}).items()
                                   if k not in ("HTTPValidationError", "ValidationError")}, **components(limits)}
            comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                   "description": "One of the server's API keys"},
                                        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                                      "description": "One of the server's API keys, as Anthropic's "
                                                                     "clients send it"}}
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi
