"""The instance server: OpenAI's completions and chat completions over one engine (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both plain and SSE streams: text
deltas, usage in a last chunk with `stream_options: {"include_usage": true}`, then `data: [DONE]`),
OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`: `serve.responses`)
and Anthropic's Messages API (`POST /v1/messages`: `serve.messages`), both translated to chat calls,
`GET /v1/models`, `GET /health` (503 once
draining or dead) and `GET /metrics` (Prometheus). Every route but /health wants
`Authorization: Bearer <key>` with one of the server's keys; `/openapi.json` (Swagger UI at `/docs`,
no key) describes every route (`serve.schema`). The prefix cache's tenant salt is derived
here from the caller's key (`tenant_salt`, an HMAC under the server's secret), never taken from the
client, so callers with different keys never share KV. Chat without `max_tokens` may use the rest
of the context, as OpenAI's does; completions default to 16 tokens. Bad input gets OpenAI's error body naming the problem (400, 404 for an unknown
model, 413 for a body over the limit, 401 for a missing or wrong key), and the server keeps serving.
A client that disconnects has its requests aborted and their pages freed. `stop` strings are matched
on the text: the request is aborted there and the text cut before the match.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from talaria_jax.engine.engine import CheckedRequest, Engine, RequestOutput
from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.grammar import GrammarError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.scheduler.inferred import OUTPUT_KEPT, Identified, SessionInference
from talaria_jax.serve import messages, protocol, responses, schema, tools
from talaria_jax.serve.async_engine import AsyncEngine, EngineDead, Unavailable
from talaria_jax.serve.instance_engine import InstanceEngine
from talaria_jax.serve.metrics import ServerMetrics
from talaria_jax.serve.protocol import Limits, Parsed
from talaria_jax.tokenizer import IncrementalDetokenizer, chat_text, joined
from talaria_jax.web import ApiError, json_errors, key_checker, read_json

__all__ = ["ServedModel", "build_app", "openai_errors", "serve_in_thread", "serving", "session_header", "tenant_salt"]


@dataclasses.dataclass
class ServedModel:
    """The model a server answers for: its name in requests, its engine and tokenizer, how its tool
    calls are written (`tool_call_parser`: a format of serve.tools, or auto: its chat template's), and
    the Jinja chat template of its chats (`chat_template`; None: its tokenizer's, if it has one)."""
    name: str
    engine: Engine
    tool_call_parser: str = "auto"
    chat_template: str | None = None

    def __post_init__(self):
        if self.chat_template is None:
            self.chat_template = getattr(self.engine.tokenizer, "chat_template", None)
        self.tool_format = tools.parser_for(self.chat_template, self.tool_call_parser)

    @property
    def tokenizer(self):
        return self.engine.tokenizer


def tenant_salt(api_key: str, secret: bytes) -> str:
    """The prefix-cache salt of a caller: an HMAC of its API key under the server's `secret` (the key
    itself never reaches the cache, and a leaked salt does not reveal it)."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()[:32]


DESCRIPTION = """OpenAI's completions, chat completions and Responses API, and Anthropic's Messages API (plain
and server-sent events), over one instance: its engine, or its models under the scheduler. Every route
but `/health` wants `Authorization: Bearer <key>` (or `x-api-key: <key>`); every error is OpenAI's
error body, its `param` naming the field at fault (Anthropic's on `/v1/messages`)."""


def build_app(models: ServedModel | Sequence[ServedModel], *, api_keys: Sequence[str], limits: Limits = Limits(),
              session_idle_s: float = 60.0, tenant_secret: bytes | None = None,
              backend: InstanceEngine | None = None, inferred_calls: int = 65_536,
              response_store: responses.Store | None = None) -> FastAPI:
    """The app; `app.state.engine` is its `AsyncEngine` (stop it with `.close()`), `app.state.metrics`
    its metrics, `app.state.server` what the routes read. `tenant_secret` keys the tenant salts
    (default: random for this process). `backend`: an `InstanceEngine` serving every one of `models`
    on one instance under the scheduler (it adds the router's route, `POST /talaria/probe`); None: the
    one model's own engine. A call that names no session (`session_id`, `x-session-id`) is put in
    its `prompt_cache_key`'s, else in one inferred from its prompt's token ids
    (`scheduler.inferred`), which keeps up to `inferred_calls` calls (0: no inference; such calls
    are sessions of one call). `response_store`: the Responses API's stored responses (default: 10,000
    for an hour).

    Raises:
        ValueError: several models without a backend, models that are not the backend's, or no API key.
    """
    models = [models] if isinstance(models, ServedModel) else list(models)
    if backend is None and len(models) != 1:
        raise ValueError(f"build_app: {len(models)} models need a backend (an InstanceEngine serving them)")
    if backend is not None and sorted(m.name for m in models) != sorted(backend.models):
        raise ValueError(f"build_app: the models {[m.name for m in models]} are not the backend's {backend.models}")
    if not api_keys or not all(isinstance(k, str) and k for k in api_keys):
        raise ValueError("build_app: give at least one non-empty API key")
    app = FastAPI(title="talaria-serve", version=schema.VERSION, description=DESCRIPTION, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json")
    schema.publish(app, limits)
    ae = AsyncEngine(backend or models[0].engine)
    metrics = ServerMetrics(ae, ",".join(m.name for m in models), session_idle_s)
    ae.on_output = metrics.on_output
    app.state.engine, app.state.metrics, app.state.limits = ae, metrics, limits
    app.state.server = _Server(ae, metrics, limits, {m.name: m for m in models}, backend,
                               tenant_secret or secrets.token_bytes(32), key_checker(api_keys), _Probed(),
                               SessionInference(inferred_calls) if inferred_calls else None,
                               response_store if response_store is not None else responses.Store())
    openai_errors(app)
    app.include_router(routes)
    return app


@dataclasses.dataclass(frozen=True)
class _Server:
    """What an instance server's routes read (`app.state.server`)."""
    ae: AsyncEngine
    metrics: ServerMetrics
    limits: Limits
    by_name: dict[str, ServedModel]
    backend: InstanceEngine | None
    secret: bytes  # keys the tenant salts
    caller: Callable[[Request], str]  # the request's API key, or ApiError 401
    probes: "_Probed"
    inference: SessionInference | None  # sessions of calls that name none
    responses: responses.Store  # the Responses API's stored responses


def _server(request: Request) -> _Server:
    return request.app.state.server


routes = APIRouter()


@routes.get("/health", **schema.HEALTH)
async def health(request: Request):
    ae = _server(request).ae
    if ae.state != "running":
        return JSONResponse({"status": ae.state}, status_code=503)
    return {"status": "ok"}


@routes.get("/v1/models", **schema.MODELS)
async def list_models(request: Request):
    srv = _server(request)
    srv.caller(request)
    return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "talaria",
                                        "max_model_len": m.engine.config.max_model_len} for m in srv.by_name.values()]}


@routes.get("/metrics", **schema.METRICS)
def get_metrics(request: Request):  # a plain def: FastAPI runs it in a thread (it reads the engine)
    srv = _server(request)
    srv.caller(request)
    body, media_type = srv.metrics.render(request.headers.get("accept", ""))
    return Response(body, media_type=media_type)


@routes.post("/v1/completions", **schema.COMPLETIONS)
async def completions(request: Request):
    return await _generate(request, chat=False)


@routes.post("/v1/chat/completions", **schema.CHAT_COMPLETIONS)
async def chat_completions(request: Request):
    return await _generate(request, chat=True)


@routes.post("/v1/messages", **schema.MESSAGES)
async def anthropic_messages(request: Request):
    srv = _server(request)
    srv.caller(request)
    chat = messages.to_chat(await read_json(request, srv.limits.max_body_bytes))
    return messages.answer(await _generate(request, chat=True, body=chat), chat["model"])


@routes.post("/v1/responses", **schema.RESPONSES_CREATE)
async def create_response(request: Request):
    srv = _server(request)
    tenant = tenant_salt(srv.caller(request), srv.secret)
    t = responses.translate(await read_json(request, srv.limits.max_body_bytes), srv.responses, tenant)
    return responses.answer(await _generate(request, chat=True, body=t.chat, session=t.session), t, srv.responses,
                            tenant)


@routes.get("/v1/responses/{response_id}", **schema.RESPONSES_GET)
async def get_response(request: Request, response_id: str):
    srv = _server(request)
    return JSONResponse(srv.responses.get(response_id, tenant_salt(srv.caller(request), srv.secret)).body)


@routes.delete("/v1/responses/{response_id}", **schema.RESPONSES_DELETE)
async def delete_response(request: Request, response_id: str):
    srv = _server(request)
    return srv.responses.delete(response_id, tenant_salt(srv.caller(request), srv.secret))


@routes.post("/talaria/probe", **schema.PROBE)
async def probe(request: Request, kind: Literal["completion", "chat"] = "completion", tokens: bool = False):
    """The router's view of this instance for one request (which it checks as if it were sent):
    the instance's state, the tokens of the request's prompt it holds on device and on host, and
    `probe`, a handle under which the checked request is kept: the request (or a probe of it, with
    the session now named) sent with the header `x-talaria-probe: <handle>` skips its parsing,
    rendering and tokenizing. `tokens=true` adds the prompt's token ids to the answer; a request that brings them
    (`talaria_prompt_token_ids`, what another instance of the same model answered) is not rendered
    or tokenized here."""
    srv = _server(request)
    backend = srv.backend
    if backend is None:
        raise ApiError(404, "this server has no scheduler (one engine): nothing to probe", code="not_found")
    prep = await _prepare(request, kind == "chat", probing=True)

    def read():
        with srv.ae.locked():
            loc = backend.prefix_of(prep.session, prep.served.name, prep.prompt, prep.salt)
            return {**backend.state(prep.session), "prompt_tokens": len(prep.prompt),
                    "device_tokens": loc.device_tokens, "host_tokens": loc.host_tokens}
    answer = await asyncio.to_thread(read)
    answer["probe"] = srv.probes.put(prep)
    if tokens:
        answer["prompt_token_ids"] = prep.prompt
    return JSONResponse(answer)  # plain JSON already: no walk of every token id by FastAPI's encoder


async def _prepare(request: Request, chat: bool, probing: bool = False, body: Any = None,
                   session: tuple[str, str] | None = None) -> Prepared:
    """Checks the caller and the request; the model, the request, its prompt ids, the caller's
    tenant salt and the session (named within the tenant). A request named by an `x-talaria-probe`
    header that this server's probe checked for the same caller is taken as it was then (its body is
    not read again)."""
    srv = _server(request)
    key = srv.caller(request)
    if srv.ae.state != "running":
        raise ApiError(503, f"the server is {srv.ae.state}", code="unavailable")
    salt = tenant_salt(key, srv.secret)
    rid = protocol.request_id(request.headers)
    probed = request.headers.get("x-talaria-probe")
    if probed is not None:  # (a probe too: asked again once the router knows the call's session)
        prep = srv.probes.take(probed, salt)
        if prep is not None:
            named = session_header(request)
            if named is not None:  # a router names the session of the call it probed (it may have inferred it)
                prep = dataclasses.replace(prep, session=f"{salt[:16]}:{named}", how=_identified(request))
            return prep
    limits = srv.limits
    if body is None:  # (a translated request, Anthropic's or the Responses API's, comes read)
        body = await read_json(request, limits.max_body_bytes)
    given = body.pop("talaria_prompt_token_ids", None) if probing and isinstance(body, dict) else None
    p = protocol.parse_chat(body, limits, given is not None) if chat else protocol.parse_completion(body, limits)
    served = srv.by_name.get(p.model)
    if served is None:
        raise ApiError(404, f"the model '{p.model}' does not exist (this server serves "
                       f"{', '.join(repr(n) for n in srv.by_name)})", "model", "model_not_found")
    p.session = session_header(request) or p.session
    header = request.headers.get("x-agent-hints")
    if header is not None:  # replaces the body's agent_hints, as x-session-id replaces session_id
        p.hints = protocol.agent_hints(protocol.hints_header(header), "x-agent-hints")
    if given is not None:  # rendered and tokenized by another instance of this model
        prompt = protocol.token_ids(given, "talaria_prompt_token_ids")
    else:
        prompt = await asyncio.to_thread(_prompt_ids, served, p)  # a template and up to a MiB of text
    if chat:
        await asyncio.to_thread(_constrain, served, p)
    if p.max_tokens is None:  # chat's default: the rest of the context
        room = served.engine.context_limit - len(prompt)
        p.params = [dataclasses.replace(x, max_tokens=max(1, min(limits.max_tokens, room))) for x in p.params]
    how = _identified(request) if p.session is not None else None
    if p.session is None and p.cache_key is not None:
        p.session, how = p.cache_key, "prompt_cache_key"
    if p.session is None and session is not None:  # what a translated request names (a response chain)
        p.session, how = session
    inferred = None
    if p.session is None and not probing and srv.inference is not None:
        with contextlib.suppress(ValueError):  # ids no engine takes: it refuses the request, naming them
            inferred = srv.inference.identify(salt, prompt)
            p.session, how = inferred.session, "inferred"
    if p.session is not None:  # named as a header names it (any characters, at most 256)
        p.session = protocol.header_value(p.session)
    session = None if p.session is None else f"{salt[:16]}:{p.session}"  # tenants' sessions never mix
    checked = await asyncio.to_thread(_check, served, prompt, p.params)
    return Prepared(served, p, checked, salt, session, rid, how, inferred)


def _check(served: ServedModel, prompt: list[int], params: list[SamplingParams]) -> tuple[CheckedRequest, ...]:
    """The request checked by its model's engine, once here (a 400 naming the field): one checked
    request a choice, which the engine takes as it is."""
    try:
        first = served.engine.check_request(prompt, params[0])
        return (first, *(served.engine.check_request(first, x) for x in params[1:]))
    except RequestError as e:
        raise ApiError(400, str(e), _param_of(str(e)), "invalid_request") from None


async def _generate(request: Request, chat: bool, body: Any = None, session: tuple[str, str] | None = None):
    srv = _server(request)
    ae = srv.ae
    prep = await _prepare(request, chat, body=body, session=session)
    served, p, prompt, salt, session = prep.served, prep.p, prep.prompt, prep.salt, prep.session
    if session is not None:
        srv.metrics.session_started(session, prep.how)
    loop = asyncio.get_running_loop()
    # a multi-model instance's scheduler takes the agent hints; a one-model engine has none to give them to
    route = {} if srv.backend is None else {"model": served.name, "hints": p.hints}
    choices: list[_Choice] = []
    rid = prep.request_id
    try:
        for i, checked in enumerate(prep.checked):  # (choice i of n > 1: its own engine request, `<id>-<i>`)
            sent, queue = await asyncio.to_thread(ae.submit, checked, None, loop, rid if len(prep.checked) == 1 else
                                                  f"{rid}-{i}", cache_salt=salt, session=session, **route)
            rid = sent if len(prep.checked) == 1 else rid  # (an id in flight already was given a suffix)
            choices.append(_Choice(i, sent, queue, p, served.tokenizer,
                                   served.tool_format if chat and p.tool_choice.mode != "none" else None))
    except RequestError as e:
        _abort_all(ae, choices)
        raise ApiError(400, str(e), _param_of(str(e)), "invalid_request") from None
    except Unavailable as e:
        _abort_all(ae, choices)
        raise ApiError(503, str(e), code="unavailable") from None
    # the session it was served in, and the call's id
    named = {"x-request-id": rid} | ({"x-talaria-session": p.session} if p.session is not None else {})
    rid = protocol.new_id(chat, rid)
    if p.stream:
        return StreamingResponse(_stream(ae, request, choices, chat, rid, p, len(prompt), prep),
                                 media_type="text/event-stream", headers=named)
    try:
        await _wait_all(request, choices, ae)
    finally:
        _abort_all(ae, choices)
    bodies = [c.body(chat) for c in choices]
    bodies[0] |= _answered(srv, request, prep, choices[0])
    return JSONResponse(protocol.envelope(chat, rid, p.model, bodies, chunk=False, usage_=_usage(choices, len(prompt))),
                        headers=named)


def _answered(srv: _Server, request: Request, prep: Prepared, first: _Choice) -> dict:
    """The call is answered: its session's inference learns the output; what the first choice's
    body adds for a router that asks (`x-talaria-output-ids: 1`): the output's leading token ids,
    with which the router infers sessions as this server does."""
    ids = first.out.token_ids if first.out is not None else []
    if prep.inferred is not None:
        srv.inference.finished(prep.inferred, ids)
    if request.headers.get("x-talaria-output-ids") is None:
        return {}
    return {"talaria_output_token_ids": ids[:OUTPUT_KEPT]}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request checked and tokenized: what serving it needs."""
    served: ServedModel
    p: Parsed
    checked: tuple[CheckedRequest, ...]  # the request checked by its engine, a choice each (`_check`)
    salt: str  # the caller's tenant salt
    session: str | None  # the session, named within the tenant
    request_id: str  # the call's one id (protocol.request_id)
    how: str | None = None  # how the session was identified (protocol.IDENTIFIED)
    inferred: Identified | None = None  # the inference's record of the call, if it was inferred

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.checked[0].prompt


class _Probed:
    """Requests the probe checked, by a random handle (not the request id, which a client may send
    twice), for the router's forward of one of them: each is taken once, by the caller that probed
    it, within `ttl_s`; the oldest go past `capacity` (a forward follows its probe at once: this
    bounds the memory of those never forwarded here)."""

    def __init__(self, capacity: int = 256, ttl_s: float = 60.0):
        self.capacity, self.ttl_s = capacity, ttl_s
        self._items: collections.OrderedDict[str, tuple[float, Prepared]] = collections.OrderedDict()
        self._mu = threading.Lock()

    def put(self, prep: Prepared) -> str:
        """Keeps `prep`; the handle that takes it."""
        pid = secrets.token_hex(16)
        with self._mu:
            self._items[pid] = (time.monotonic(), prep)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return pid

    def take(self, pid: str, salt: str) -> Prepared | None:
        with self._mu:
            t, prep = self._items.pop(pid, (0.0, None))
        if prep is None or prep.salt != salt or time.monotonic() - t > self.ttl_s:
            return None
        return prep


def openai_errors(app: FastAPI) -> None:
    """Every error of `app` answered as OpenAI's error body (``web.json_errors``), and as Anthropic's on
    `/v1/messages`."""
    def body(request: Request, e: ApiError) -> dict:
        return messages.error_body(e.status, e.message) if request.url.path == "/v1/messages" else e.body()
    json_errors(app, body)


def _identified(request: Request) -> str:
    """How a named session was identified: "named", unless a router says how it identified it
    (`x-talaria-identified`), for the metrics' labels."""
    how = request.headers.get("x-talaria-identified")
    return how if how in protocol.IDENTIFIED else "named"


def session_header(request: Request) -> str | None:
    """The `x-session-id` header (1 to 256 printable ASCII characters), or None."""
    header = request.headers.get("x-session-id")
    if header is not None and not (0 < len(header) <= 256 and header.isascii() and header.isprintable()):
        raise ApiError(400, "the x-session-id header must be 1 to 256 printable ASCII characters", "x-session-id",
                       "invalid_value")
    return header


def _constrain(model: ServedModel, p: Parsed) -> None:
    """The grammar a chat request's output must follow (tool_choice required or named, else
    response_format), compiled once here so a schema the library cannot take is a 400 naming it."""
    try:
        if p.tools and p.tool_choice.mode == "required":
            field, g = "tools", tools.call_grammar(p.tools, p.tool_choice, model.tool_format)
        else:
            field, g = "response_format", tools.response_grammar(p.response_format)
        if g is None:
            return
        model.engine.grammars.check(g)
    except GrammarError as e:
        if field == "response_format" and p.response_format["type"] == "json_schema":
            field = "response_format.json_schema.schema"
        raise ApiError(400, f"'{field}' cannot be enforced: {e}"[:500], field, "unsupported_schema") from None
    p.params = [dataclasses.replace(x, grammar=g) for x in p.params]


def _prompt_ids(model: ServedModel, p: Parsed) -> list[int]:
    tok = model.tokenizer
    if p.messages is not None:
        if model.chat_template is None:
            raise ApiError(400, f"the model '{model.name}' has no chat template (serve it with --chat_template); use "
                           "/v1/completions", "messages", "no_chat_template")
        messages, listed = tools.render_messages(p.messages, p.tools, model.chat_template)
        try:
            text = chat_text(tok, model.chat_template, messages, listed)
        except Exception as e:  # noqa: BLE001 - the template refused the conversation (raise_exception)
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages", "invalid_messages") from None
        return tok.encode(text)
    if isinstance(p.prompt, str):
        return tok.encode(p.prompt, add_bos=bool(getattr(tok, "add_bos", False)))
    return p.prompt


def _param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with it)."""
    first = message.split(" ", 1)[0].strip("'")
    return {"prompt": "prompt", "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
            "seed": "seed", "logprobs": "logprobs", "logit_bias": "logit_bias"}.get(first)


class _Choice:
    """One choice of a request: its engine request, the text so far with `stop` strings applied, and
    what a stream has sent. Each update costs time in the new text only (a stop string is looked for
    in the new text and the `holdback` characters before it), so a whole output is linear in its length."""

    def __init__(self, index: int, rid: str, queue: asyncio.Queue, p: Parsed, tokenizer,
                 tool_format: str | None = None):
        self.index, self.rid, self.queue, self.p, self.tok = index, rid, queue, p, tokenizer
        self.tool_format = tool_format  # the output is parsed for tool calls in this format
        self.tool_names = [t["function"]["name"] for t in p.tools or ()]
        self.tool_stream = tools.ToolStream(tool_format, self.tool_names) if tool_format else None
        self.out: RequestOutput | None = None
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stopped = False  # a stop string matched: the engine request is aborted, reported as "stop"
        self.stop_string: str | None = None  # the stop string that matched (vLLM's `stop_reason`)
        self.holdback = max((len(s) for s in p.stop), default=1) - 1  # a stop string may still be completing
        self.detok = IncrementalDetokenizer(tokenizer)  # the output's text, decoded as it grows
        self._fed = 0  # token ids given to detok
        self._text: list[str] = []  # the text, stop strings applied (joined on reading `text`)
        self._unsent: list[str] = []  # its end that delta() has not handed out
        self._tail = ""  # its last `holdback` characters, where a stop string may have begun

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return joined(self._text)

    def update(self, out: RequestOutput | EngineDead) -> None:
        if isinstance(out, EngineDead):
            raise ApiError(503, f"the engine failed: {out}", code="engine_dead")
        self.out = out
        new = self.detok.add(out.text_token_ids[self._fed:])  # text_token_ids leave out a final stop token
        self._fed = len(out.text_token_ids)
        if out.finished:
            new += self.detok.flush()
        window = self._tail + new
        found = [(k, s) for k, s in ((window.find(s), s) for s in self.p.stop) if k >= 0]
        if found:  # the earliest match: drop it and what follows, some of it maybe already in the text
            k, self.stop_string = min(found)
            cut = len(self._tail) - k
            new = "" if cut >= 0 else new[:-cut]
            if cut > 0:
                self._text = [joined(self._text)[:-cut]]
                self._unsent = [joined(self._unsent)[:-cut]]
            self.finish_reason, self.stopped = "stop", True
        if new:
            self._text.append(new)
            self._unsent.append(new)
        if self.holdback:
            self._tail = (self._tail + new)[-self.holdback:]
        if self.finish_reason is None and out.finished:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"

    def delta(self) -> str:
        unsent = joined(self._unsent)
        end = len(unsent) if self.done else max(0, len(unsent) - self.holdback)
        self._unsent = [unsent[end:]] if end < len(unsent) else []
        return unsent[:end]

    def logprobs(self, chat: bool, new_only: bool = False) -> dict | None:
        if self.p.logprobs is None or self.out is None:
            return None
        start = self.sent_tokens if new_only else 0
        ids = self.out.token_ids[start:]
        self.sent_tokens = len(self.out.token_ids)
        tops = self.out.top_logprobs[start:] if self.p.logprobs else [{} for _ in ids]
        dec = self.tok.decode
        return protocol.logprobs_body(chat, [dec([t]) for t in ids], self.out.logprobs[start:],
                                      [[(dec([k]), v) for k, v in top.items()] for top in tops])

    def _calls(self, calls: list[dict]) -> list[dict]:
        return calls if self.p.tool_choice.parallel else calls[:1]

    def _reason(self, calls: list[dict]) -> str | None:
        return "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason

    def body(self, chat: bool) -> dict:
        if self.tool_format is None:
            return protocol.choice(chat, self.index, self.text, self.finish_reason, self.logprobs(chat)) | self.matched()
        content, calls = tools.parse(self.text, self.tool_format, self.tool_names, self.finish_reason == "length")
        calls = self._calls(calls)
        return protocol.choice(chat, self.index, tools.message_content(content, calls), self._reason(calls),
                               self.logprobs(chat), tool_calls=calls) | self.matched()

    def matched(self) -> dict:
        """The stop string that ended the choice, as vLLM reports it (`stop_reason`), if one did."""
        return {"stop_reason": self.stop_string} if self.stop_string is not None else {}

    def stream_delta(self, final: bool) -> tuple[str, list[dict] | None, str | None]:
        """A stream's next content, its tool calls (at the end, with their indexes), and (when
        `final`) the finish reason."""
        d = self.delta()
        if self.tool_stream is None:
            return d, None, self.finish_reason if final else None
        d = self.tool_stream.feed(d)
        if not final:
            return d, None, None
        rest, calls = self.tool_stream.finish(self.finish_reason == "length")
        calls = self._calls(calls)
        return d + rest, tools.delta_calls(calls) or None, self._reason(calls)


def _usage(choices: list[_Choice], prompt_tokens: int) -> dict:
    outs = [c.out for c in choices if c.out is not None]
    return protocol.usage(prompt_tokens, sum(len(o.token_ids) for o in outs), outs[0].cached_tokens if outs else 0)


def _abort_all(ae: AsyncEngine, choices: list[_Choice]) -> None:
    for c in choices:
        ae.abort(c.rid, c.queue)  # a no-op for finished ones


async def _next(request: Request, choices: list[_Choice], ae: AsyncEngine) -> None:
    """Waits for the next output of any unfinished choice and applies it; aborts a choice whose stop
    string matched. Raises ApiError(499) once the client is gone (checked at least every 0.25 s)."""
    pending = {asyncio.ensure_future(c.queue.get()): c for c in choices if not c.done}
    try:
        while True:
            if await request.is_disconnected():
                raise ApiError(499, "the client disconnected", code="client_disconnected")
            done, _ = await asyncio.wait(pending, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            if done:
                break
    finally:
        for fut in pending:
            if not fut.done():
                fut.cancel()
    for fut in done:
        c = pending[fut]
        c.update(fut.result())
        while not c.done and not c.queue.empty():
            c.update(c.queue.get_nowait())
        if c.stopped:
            ae.abort(c.rid, c.queue, "stop")


async def _wait_all(request: Request, choices: list[_Choice], ae: AsyncEngine) -> None:
    while not all(c.done for c in choices):
        await _next(request, choices, ae)


async def _stream(ae: AsyncEngine, request: Request, choices: list[_Choice], chat: bool, rid: str, p: Parsed,
                  prompt_tokens: int, prep: Prepared):
    """SSE events: (chat) each choice's role, then text deltas as they come, each choice's finish reason
    with its last delta, the usage, and `[DONE]`. A client gone aborts every choice (finally)."""
    def event(choice_or_none, usage_=None) -> str:
        chunk = protocol.envelope(chat, rid, p.model, [choice_or_none] if choice_or_none else [], True, usage_)
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

    try:
        if chat:  # the role first, as OpenAI sends it
            for c in choices:
                yield event(protocol.choice(chat, c.index, "", None, None, delta=True, first=True))
        ended: set[int] = set()
        while True:
            for c in choices:
                final = c.done and c.index not in ended
                d, calls, reason = c.stream_delta(final)
                if d or final:
                    body = protocol.choice(chat, c.index, d, reason, c.logprobs(chat, new_only=True), delta=True,
                                           tool_calls=calls)
                    if final:
                        body |= c.matched() | (_answered(_server(request), request, prep, c) if c.index == 0 else {})
                    yield event(body)
                if final:
                    ended.add(c.index)
            if len(ended) == len(choices):
                break
            try:
                await _next(request, choices, ae)
            except ApiError as e:
                if e.status != 499:  # the client is still there: tell it why the stream ends
                    yield f"data: {json.dumps(e.body())}\n\n"
                return
        if p.include_usage:
            yield event(None, _usage(choices, prompt_tokens))
        yield "data: [DONE]\n\n"
    finally:
        _abort_all(ae, choices)


def serve_in_thread(api: FastAPI, host: str = "127.0.0.1", port: int = 0) -> tuple[str, uvicorn.Server]:
    """Runs `api` under uvicorn in a daemon thread; its base URL (port 0: a free one) and the server
    (`server.should_exit = True` stops it)."""
    server = uvicorn.Server(uvicorn.Config(api, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    server.thread = thread
    return f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}", server


@contextlib.contextmanager
def serving(api: FastAPI):
    """`serve_in_thread(api)` for a block: yields the base URL, then stops the server and its engine
    (an app without one, the rollout server's, leaves its service to its owner)."""
    url, server = serve_in_thread(api)
    try:
        yield url
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
        engine = getattr(api.state, "engine", None)
        if engine is not None:
            engine.close()
