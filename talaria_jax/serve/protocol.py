"""OpenAI's completions and chat completions, as vLLM and SGLang serve them: request parsing with
errors that name the field and the limit, and the response and stream-chunk bodies.

Parsing is plain Python over the decoded JSON (not a schema library), so every error is a one-line
OpenAI error body: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.
Supported beyond OpenAI's fields: a prompt of token ids (a list of ints), `session_id` (also the
`x-session-id` header), which names the agent session a call belongs to, and `agent_hints` (also the
`x-agent-hints` header), what the agent knows of that session (`agent_hints`). OpenAI's
`prompt_cache_key` names the session of a call that has no `session_id`.
"""
from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import math
import numbers
import re
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from talaria_jax.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from talaria_jax.scheduler.session import NO_HINTS, Hints
from talaria_jax.serve.tools import ToolChoice
from talaria_jax.web import ApiError

__all__ = ["Limits", "Parsed", "agent_hints", "parse_chat", "parse_completion"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for (the server's flags)."""
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # per choice; the context limit applies too
    max_n: int = 8
    max_stop: int = 4  # stop strings
    max_stop_chars: int = 256  # of each (a stream holds back that much text)


@dataclasses.dataclass
class Parsed:
    """A request, validated: the prompt (token ids, or None for chat until the template renders
    `messages`), the sampling parameters of each choice, and the rest of what the response needs."""
    model: str
    prompt: list[int] | str | None
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    logprobs: int | None  # top-n per token (0: only the chosen token's), None: no logprobs
    session: str | None
    max_tokens: int | None  # as asked; None: the rest of the context (chat's default)
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice = ToolChoice("none")
    response_format: dict | None = None  # json_object or json_schema ({"type": ..., "json_schema": ...})
    hints: Hints = NO_HINTS  # the body's agent_hints (the x-agent-hints header replaces them: `agent_hints`)
    cache_key: str | None = None  # prompt_cache_key: the session, when none is named


# ---- parsing -----------------------------------------------------------------------------------
_MISSING = object()
SEED_LIMIT = 2**63  # seeds are in [0, 2**63); choice i of n draws with (seed + i) mod 2**63
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _is_int(x) -> bool:
    """An integer, or a float with no fraction (JSON Schema's integer: 8.0 is 8)."""
    if isinstance(x, float):
        return math.isfinite(x) and x.is_integer()
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    try:
        return _is_num(x) and math.isfinite(float(x))
    except OverflowError:  # an integer too large for a float
        return False


def _field(body: Mapping, name: str, check, what: str, default=_MISSING):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise ApiError(400, f"'{name}' is required", name, "missing_required_parameter")
        return default
    if not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {type(v).__name__} {v!r}"[:300], name, "invalid_type")
    return int(v) if check is _is_int else v


def _stop(body: Mapping, limits: Limits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if not stop:  # an empty list: no stop strings
        return ()
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"'stop' holds {len(stop)} strings; at most {limits.max_stop}", "stop", "too_many")
    if max(map(len, stop)) > limits.max_stop_chars:
        raise ApiError(400, f"a 'stop' string is over {limits.max_stop_chars} characters", "stop", "too_long")
    return tuple(stop)


def _common(body: Any, limits: Limits, max_tokens_fields: Sequence[str], max_tokens: int | None) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_body")
    model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    for f in max_tokens_fields:
        if body.get(f) is not None:
            max_tokens = _field(body, f, _is_int, "an integer")
            if not 1 <= max_tokens <= limits.max_tokens:
                raise ApiError(400, f"'{f}' must be in [1, {limits.max_tokens}], got {max_tokens}", f, "out_of_range")
    temperature = _field(body, "temperature", _is_finite, "a finite number", 1.0)
    top_p = _field(body, "top_p", _is_finite, "a finite number", 1.0)
    top_k = _field(body, "top_k", _is_int, "an integer", 0)
    if top_k < -1:
        raise ApiError(400, f"'top_k' must be -1, 0 (both: off) or positive, got {top_k}", "top_k", "out_of_range")
    n = _field(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= limits.max_n:
        raise ApiError(400, f"'n' must be in [1, {limits.max_n}], got {n}", "n", "out_of_range")
    seed = _field(body, "seed", _is_int, "an integer", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}"[:300], "seed", "out_of_range")
    for f in ("presence_penalty", "frequency_penalty"):
        if _field(body, f, _is_num, "a number", 0.0) != 0.0:
            raise ApiError(400, f"'{f}' is not supported (only 0)", f, "unsupported")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if opts and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options", "invalid_value")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, f"'stream_options.include_usage' must be a boolean, got {include_usage!r}"[:300],
                       "stream_options.include_usage", "invalid_type")
    session = _field(body, "session_id", lambda v: isinstance(v, str) and 0 < len(v) <= 256,
                     "a string of 1 to 256 characters", None)
    cache_key = _field(body, "prompt_cache_key", lambda v: isinstance(v, str) and 0 < len(v) <= 256,
                       "a string of 1 to 256 characters", None)
    bias = _logit_bias(body)
    hints = agent_hints(_field(body, "agent_hints", lambda v: isinstance(v, dict), "an object", {}), "agent_hints")
    # max_tokens None (chat without one): the rest of the context, set once the prompt is known
    base = SamplingParams(max_tokens=max_tokens or 1, temperature=float(temperature), top_p=float(top_p),
                          top_k=max(top_k, 0), seed=seed, logit_bias=bias)
    params = [dataclasses.replace(base, seed=None if seed is None else (seed + i) % SEED_LIMIT) for i in range(n)]
    return {"model": model, "params": params, "stream": stream, "include_usage": include_usage,
            "stop": _stop(body, limits), "session": session, "max_tokens": max_tokens, "hints": hints,
            "cache_key": cache_key}


IDENTIFIED = ("named", "prompt_cache_key", "chain", "conversation", "inferred")  # how a session was identified


def header_value(text: str) -> str:
    """A session's name as an HTTP header's value (`x-session-id`, `x-talaria-session`): itself if it
    is printable ASCII, else percent-encoded, and past 256 characters a digest of it; the same name
    always gives the same value."""
    if not (text.isascii() and text.isprintable()):
        text = urllib.parse.quote(text, safe="")
    return text if len(text) <= 256 else "sha256-" + hashlib.sha256(text.encode()).hexdigest()


def agent_hints(given: Mapping[str, Any], where: str) -> Hints:
    """`Hints` from the request body's `agent_hints` object, or from the `x-agent-hints` header's
    pairs (`hints_header`); ApiError 400 naming `where.field` and its limit. Fields: calls_left (calls
    the session makes after this one; 0 ends it), tool_s (seconds before the next call), priority
    (higher first)."""
    try:
        return Hints.from_json(given)
    except ValueError as e:  # "<field> ...": the field, then its limit
        field, _, rest = str(e).partition(" ")
        raise ApiError(400, f"'{where}.{field}' {rest}"[:300], f"{where}.{field}"[:300], "invalid_value") from None


def hints_header(value: str) -> dict[str, Any]:
    """The `x-agent-hints` header's `name=value` pairs (comma-separated, JSON numbers) as a dict for
    `agent_hints`; ApiError 400 naming the header when a pair does not read."""
    out: dict[str, Any] = {}
    for pair in value.split(","):
        name, eq, raw = (x.strip() for x in pair.partition("="))
        if not pair.strip():
            continue
        try:
            v = float(raw) if eq and raw else None
        except ValueError:
            v = None
        if v is None or not name:
            raise ApiError(400, f"the x-agent-hints header must be name=number pairs separated by commas "
                           f"(calls_left=2, tool_s=1.5), got {pair.strip()!r}"[:300], "x-agent-hints", "invalid_value")
        out[name] = v
    return out


def _logit_bias(body: Mapping) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries."""
    bias = _field(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token ids to biases", {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias", "too_many")
    out = []
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) < 12 and str(int(k)) == k):  # "01" would repeat "1"
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {k!r}"[:300], "logit_bias", "invalid_value")
        if not (_is_finite(v) and -100 <= v <= 100):
            raise ApiError(400, f"'logit_bias' of token {k} must be a number in [-100, 100], got {v!r}"[:300],
                           "logit_bias", "out_of_range")
        out.append((int(k), float(v)))
    return tuple(out)


def token_ids(value: Any, field: str) -> list[int]:
    """A non-empty list of integer token ids (8.0 is 8), as ints; ApiError 400 naming `field`."""
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value  # JSON's integers: nothing to convert
    if not (isinstance(value, list) and value and all(_is_int(t) for t in value)):
        raise ApiError(400, f"'{field}' must be a non-empty list of token ids", field, "invalid_type")
    return [int(t) for t in value]


def parse_completion(body: Any, limits: Limits) -> Parsed:
    """POST /v1/completions. `prompt` is a string or a list of token ids (one prompt per request)."""
    c = _common(body, limits, ("max_tokens",), 16)  # OpenAI's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt", "invalid_value")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = token_ids(prompt, "prompt")
    elif prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids (one prompt per request)",
                       "prompt", "invalid_type")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", "echo", "unsupported")
    logprobs = _field(body, "logprobs", _is_int, "an integer", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs", "out_of_range")
    return Parsed(prompt=prompt, logprobs=logprobs, **_with_logprobs(c, logprobs))


def parse_chat(body: Any, limits: Limits, rendered: bool = False) -> Parsed:
    """POST /v1/chat/completions: `messages` (and `tools`) for the model's chat template. `rendered`:
    the prompt's token ids come with the request (another instance rendered the messages), so
    `messages` and `tools` may be left out."""
    c = _common(body, limits, ("max_tokens", "max_completion_tokens"), None)
    if rendered and "messages" not in body:
        body = {**body, "messages": [{"role": "user", "content": ""}]}  # checked as such; never rendered
    messages = _field(body, "messages", lambda v: isinstance(v, list) and v, "a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]", "invalid_type")
        if m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}"[:300],
                           f"messages[{i}].role", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                               "unsupported")
            messages[i] = m = {**m, "content": "".join(p["text"] for p in content)}
        elif content is None:
            if not (m["role"] == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
                raise ApiError(400, f"messages[{i}].content is required (only an assistant message with "
                               "'tool_calls' may leave it null)", f"messages[{i}].content",
                               "missing_required_parameter")
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           f"messages[{i}].content", "invalid_type")
    _tool_history(messages)
    tools = _field(body, "tools", lambda v: isinstance(v, list), "a list of tool objects", None)
    names: list[str] = []
    for i, t in enumerate(tools or ()):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"...}}}}", f"tools[{i}]", "invalid_type")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                           f"tools[{i}].function.parameters", "invalid_type")
        if fn["name"] in names:
            raise ApiError(400, f"tools[{i}].function.name {fn['name']!r} is declared twice"[:300],
                           f"tools[{i}].function.name", "invalid_value")
        names.append(fn["name"])
    choice = _tool_choice(body, names)
    response_format = _response_format(body)
    logprobs = None
    if _field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False):
        logprobs = _field(body, "top_logprobs", _is_int, "an integer", 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "top_logprobs",
                           "out_of_range")
    return Parsed(prompt=None, logprobs=logprobs, messages=messages, tools=tools or None, tool_choice=choice,
                  response_format=response_format, **_with_logprobs(c, logprobs))


def _tool_history(messages: list[dict]) -> None:
    """Tool calls and their results, as OpenAI checks them: each assistant tool call is well formed
    and answered by a `tool` message (its `tool_call_id`) before the next other message; each tool
    message answers a call made before it."""
    open_calls: dict[str, int] = {}  # call id -> the assistant message that made it
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ApiError(400, f"messages[{i}].tool_call_id is required: a tool message answers a tool call",
                               f"messages[{i}].tool_call_id", "missing_required_parameter")
            if open_calls.pop(cid, None) is None:
                raise ApiError(400, f"messages[{i}].tool_call_id {cid!r} answers no tool call of the assistant "
                               "message before it"[:300], f"messages[{i}].tool_call_id", "invalid_value")
            continue
        if open_calls:
            j = min(open_calls.values())
            raise ApiError(400, f"messages[{j}].tool_calls: {', '.join(map(repr, open_calls))} have no tool message "
                           f"answering them before messages[{i}]"[:300], f"messages[{j}].tool_calls", "invalid_value")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list, on an assistant message",
                           f"messages[{i}].tool_calls", "invalid_type")
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]
                    and c.get("type", "function") == "function" and isinstance(fn, dict)
                    and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments", ""), str)):
                raise ApiError(400, f"messages[{i}].tool_calls[{k}] must be {{'id': ..., 'type': 'function', "
                               "'function': {'name': ..., 'arguments': <a JSON string>}}",
                               f"messages[{i}].tool_calls[{k}]", "invalid_type")
            open_calls[c["id"]] = i
    if open_calls:
        j = min(open_calls.values())
        raise ApiError(400, f"messages[{j}].tool_calls: {', '.join(map(repr, open_calls))} have no tool message "
                       "answering them"[:300], f"messages[{j}].tool_calls", "invalid_value")


def _tool_choice(body: Mapping, names: list[str]) -> ToolChoice:
    tc = body.get("tool_choice")
    parallel = _field(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean", None)
    if not names:
        for f, v in (("tool_choice", tc), ("parallel_tool_calls", parallel)):
            if v is not None:
                raise ApiError(400, f"'{f}' is only allowed when 'tools' are given", f, "invalid_value")
        return ToolChoice("none")
    parallel = True if parallel is None else parallel
    if tc is None:
        return ToolChoice("auto", None, parallel)
    if tc in ("none", "auto", "required"):
        return ToolChoice(tc, None, parallel)
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not (isinstance(tc, dict) and tc.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice", "invalid_value")
    if fn["name"] not in names:
        raise ApiError(400, f"'tool_choice' names the function {fn['name']!r}, which is not in 'tools' "
                       f"({', '.join(names)})"[:300], "tool_choice.function.name", "invalid_value")
    return ToolChoice("required", fn["name"], parallel)


def _response_format(body: Mapping) -> dict | None:
    rf = _field(body, "response_format", lambda v: isinstance(v, dict), "an object", None)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, f"'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                       f"got {kind!r}"[:300], "response_format.type", "invalid_value")
    if kind == "text":
        return None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                           "response_format.json_schema", "invalid_type")
        if not isinstance(js.get("schema", {}), dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                           "response_format.json_schema.schema", "invalid_type")
    return rf


def _with_logprobs(c: dict, logprobs: int | None) -> dict:
    if logprobs:
        c["params"] = [dataclasses.replace(p, logprobs=logprobs) for p in c["params"]]
    return c


# ---- responses ---------------------------------------------------------------------------------
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")  # (UUIDs, base64 and the ids proxies send)


def request_id(headers: Mapping[str, str]) -> str:
    """A call's one id, from the front door to the engine and back (the engine's request id, the
    `x-request-id` header of the answer, the exemplar of its latency metrics): the `x-request-id`
    header the caller sent (a client, or the router for the call it forwards), else a new one.

    Raises:
        ApiError: 400, a given id that is not 1 to 128 letters, digits or `._:+/=-`."""
    given = headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise ApiError(400, f"x-request-id must be 1 to 128 letters, digits or '._:+/=-', got {given[:80]!r}",
                       "x-request-id", "invalid_value")
    return given


def new_id(chat: bool, request_id: str) -> str:
    """The id of the answer's body to the request `request_id`, as OpenAI prefixes it."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_body(chat: bool, tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]]) -> dict:
    """Per-token logprobs in the endpoint's shape (chat: `content` entries; completions: parallel lists,
    each top a {token: logprob} object, where two tokens that spell the same text share one key)."""
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())} for k, v in top]}
                            for t, lp, top in zip(tokens, logprobs, tops)]}
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [dict(top) for top in tops] or None}


def choice(chat: bool, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
           delta: bool = False, first: bool = False, tool_calls: list[dict] | None = None) -> dict:
    """A choice of a response, or of a stream chunk (`delta`; `first`: the chunk with the role). Chat
    tool calls: whole in a message, each with its `index` in a delta."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if delta:
        msg = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return {"index": index, "delta": msg, "logprobs": logprobs, "finish_reason": finish_reason}
    msg = {"role": "assistant", "content": text}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(chat: bool, rid: str, model: str, choices: list[dict], chunk: bool, usage_: dict | None = None) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


async def stream_data(chunks: AsyncIterator[str | bytes]) -> AsyncIterator[dict | None]:
    """The JSON events of a chat or completion stream's server-sent events, in order (an event may span
    chunks), and None for its closing `[DONE]`."""
    rest, utf8 = "", codecs.getincrementaldecoder("utf-8")()
    async for chunk in chunks:
        rest += utf8.decode(chunk) if isinstance(chunk, bytes) else chunk  # (a character may span chunks)
        *lines, rest = rest.split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield None if line[6:].strip() == "[DONE]" else json.loads(line[6:])
    rest += utf8.decode(b"", final=True)
    if rest.startswith("data: "):  # a last line with no newline after it
        yield None if rest[6:].strip() == "[DONE]" else json.loads(rest[6:])
