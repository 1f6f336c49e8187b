"""The router gateway: one OpenAI-compatible endpoint in front of many instance servers.

Each instance is a `talaria-serve` (started by `talaria-route --local_instances=N`, or on other
machines), always reached over HTTP, so the scheduling is the same for both. A call is placed by the scheduler's
router (`talaria_jax.scheduler.router.rank`, the policy's scorer): the gateway asks every instance
that serves the call's model for its view of this very request (`POST /talaria/probe`: its state,
and the tokens of the request's prompt it holds on device and on host under the caller's tenant),
ranks them, and forwards the request to the best one. The instance runs the same policy's
multiplexer and admission over its models. So a session's next call goes where its KV is, unless
switching or queueing there costs more.

The caller's API key is forwarded: instances derive the prefix cache's tenant salt from it (as the
probe's prefix counts do), so the gateway and its instances take the same keys. A session is named by
an `x-session-id` header or a `session_id` field, else by OpenAI's `prompt_cache_key`; the session of
a call with none is inferred from its prompt's token ids (the first probe answers them;
`scheduler.inferred`), with the leading output ids the instance adds to its answer for the gateway,
and the instances are told it by name.

Faults lose nothing. Every request carries its session's whole history (OpenAI's interface is
stateless), so any call can be placed anywhere and its KV recomputed there. The gateway checks each
instance's `/health` every `probe_interval_s`: one that refuses connections or misses `fail_after`
checks in a row is taken out, and the calls running on it are placed again on the survivors. A
stream that had started continues where it stopped: the retry's events are trimmed of the text and
logprobs the client already has. Sampled requests without a seed get one here, so a retry draws the
same tokens (greedy ones are the same anyway). A draining instance (503 on /health) gets no new calls
and finishes its running ones.

Errors: a request is checked with the instances' own parser before any instance is asked (only the
limits that are each instance's flags, `max_tokens` and `n`, are left to them). An instance whose
probe refuses the request (a 4xx) is passed over for one that takes it; if all refuse, the refusal
reaches the client unchanged, and the instances stay in service: the request is at fault. Only a
refused connection, a lost stream or a 5xx moves a call; if every instance answers a 5xx, the client
gets the last one as the instance wrote it.

`/openapi.json` (Swagger UI at `/docs`, no key) describes the gateway's routes (`serve.schema`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import json
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any

import httpx
from absl import logging
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from talaria_jax.scheduler import router
from talaria_jax.scheduler.api import DerivedQueries, PrefixLocation, WeightState
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.inferred import Identified, SessionInference
from talaria_jax.scheduler.session import Call, Session
from talaria_jax.serve import messages, protocol, responses, schema
from talaria_jax.serve.app import openai_errors, session_header
from talaria_jax.serve.protocol import Limits
from talaria_jax.web import ApiError, key_checker, read_json

__all__ = ["Gateway", "Upstream", "build_gateway", "routes"]

_SEED_MAX = 2**62  # a seed the gateway adds leaves room for n choices' seed + i
_MAX_N = 128  # choices per request the gateway forwards at most (each instance has its own --max_n)
_INSTANCE_LIMITS = {"max_tokens", "max_completion_tokens", "n"}  # fields whose bounds are each instance's flags
MAX_SESSIONS = 1_000_000  # sessions whose last instance is kept; past it, the least recently active are forgotten


@dataclasses.dataclass
class Upstream:
    """One instance server as the gateway sees it."""
    name: str
    url: str
    models: tuple[str, ...] = ()
    accepting: bool = False  # its /health answered 200: it takes new calls
    alive: bool = False  # it answers at all (a draining one is alive, not accepting)
    misses: int = 0  # health checks missed in a row
    inflight: int = 0  # calls forwarded to it and not yet answered
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when taken out


class _Relayed(ApiError):
    """An instance's error answer, passed to the client as it is (status and body)."""

    def __init__(self, r: httpx.Response):
        super().__init__(r.status_code, **_error_fields(r))
        try:
            self._body = r.json()
        except ValueError:
            self._body = super().body()

    def body(self) -> dict:
        return self._body


class _Lost(Exception):
    """The instance died or stopped answering while it served the call: place it again."""


class _Snapshot(DerivedQueries):
    """The router's `InstanceAPI` queries over one probe answer (`InstanceEngine.state` plus the
    prompt's cached tokens); `routed`: calls forwarded to it that its counts do not show yet."""

    def __init__(self, up: Upstream, s: dict[str, Any]):
        self.name, self.up, self.s = up.name, up, s

    def models(self) -> tuple[str, ...]:
        return tuple(self.s["models"])

    def active_model(self) -> str | None:
        return self.s["active_model"]

    def weight_state(self, model: str) -> WeightState:
        return WeightState(self.s["weights"][model])

    def estimate_switch_s(self, model: str) -> float:
        return float(self.s["switch_s"][model])

    def pages_for(self, model: str, tokens: int) -> int:
        return math.ceil(tokens / self.s["page_size"][model])

    def kv_pages_total(self) -> int:
        return int(self.s["kv_pages_total"])

    def kv_pages_used(self) -> int:
        return int(self.s["kv_pages_used"])

    def kv_pages_reserved(self, exclude_session: str | None = None) -> int:
        return int(self.s["kv_pages_reserved"])  # the probe left out the session's own

    def cached_prefix(self, session_id: str, model: str) -> PrefixLocation:
        return PrefixLocation(int(self.s["device_tokens"]), int(self.s["host_tokens"]))

    def num_waiting(self) -> int:
        return int(self.s["waiting"])

    def num_running(self) -> int:
        return int(self.s["running"])

    def routed(self) -> int:
        return max(0, self.up.inflight - self.num_running() - self.num_waiting())


class _Relay:
    """What the client has been sent of one streamed call, so that a retry on another instance
    continues it: per choice, the characters and logprob entries sent, whether the role (chat) and
    the finish reason (with an answer's tool calls, which come whole in its last chunk) went out, and
    whether the usage did."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.chars: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.roles: set[int] = set()
        self.ended: set[int] = set()
        self.usage_sent = False
        self.head: dict = {}  # the first attempt's id and created, kept by every event
        self.attempt()

    @property
    def complete(self) -> bool:
        """Every choice seen has ended (the usage, if asked, is lost with the stream)."""
        return bool(self.ended) and self.ended >= set(self.chars)

    def attempt(self) -> None:
        """A new upstream stream starts: it will repeat what the last one produced."""
        self.seen_chars: dict[int, int] = {}
        self.seen_tokens: dict[int, int] = {}

    def feed(self, event: dict) -> dict | None:
        """The part of an upstream event the client lacks (None: nothing)."""
        if "error" in event:
            raise _Lost(event["error"].get("message", "the instance failed"))
        if not self.head:
            self.head = {k: event[k] for k in ("id", "created") if k in event}
        event |= self.head
        choices = []
        for ch in event.get("choices") or []:
            i = ch["index"]
            if i in self.ended:
                continue
            if self.chat:
                delta = ch.get("delta") or {}
                text = delta.get("content") or ""
            else:
                text = ch.get("text") or ""
            seen = self.seen_chars.get(i, 0)
            self.seen_chars[i] = seen + len(text)
            new = text[max(0, self.chars.get(i, 0) - seen):]
            self.chars[i] = self.chars.get(i, 0) + len(new)
            lp = ch.get("logprobs")
            if lp:
                n = len(lp.get("content") or lp.get("tokens") or [])
                seen_t = self.seen_tokens.get(i, 0)
                self.seen_tokens[i] = seen_t + n
                skip = max(0, self.tokens.get(i, 0) - seen_t)
                lp = {k: (v[skip:] if isinstance(v, list) else v) for k, v in lp.items()}
                self.tokens[i] = self.tokens.get(i, 0) + max(0, n - skip)
                ch["logprobs"] = lp if (lp.get("content") or lp.get("tokens")) else None
            role = self.chat and "role" in (ch.get("delta") or {}) and i not in self.roles
            calls = self.chat and (ch.get("delta") or {}).get("tool_calls")  # whole, with the finish: sent once
            if self.chat:
                ch["delta"] = ({"role": "assistant"} if role else {}) | ({"content": new} if new or role else {})
                ch["delta"] |= {"tool_calls": calls} if calls else {}
                self.roles |= {i} if role else set()
            else:
                ch["text"] = new
            if ch.get("finish_reason"):
                self.ended.add(i)
            if new or role or calls or ch.get("finish_reason") or ch.get("logprobs"):
                choices.append(ch)
        usage = event.get("usage") is not None and not self.usage_sent
        self.usage_sent |= usage
        if not choices and not usage:
            return None
        out = {**event, "choices": choices}
        if not usage:
            out.pop("usage", None)
        return out


def _session_id(request: Request, body: dict) -> str | None:
    sid = session_header(request) or body.get("session_id")
    if sid is not None and not (isinstance(sid, str) and 0 < len(sid) <= 256):
        raise ApiError(400, "'session_id' must be a string of 1 to 256 characters", "session_id", "invalid_type")
    return sid


def _sampled(body: dict) -> bool:
    t = body.get("temperature", 1.0)
    return not (isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0)


DESCRIPTION = """OpenAI's completions, chat completions and Responses API, and Anthropic's Messages API (both
translated to chat calls here), over many instance servers: each call is placed on
the instance the scheduler's router ranks best (where its session's KV is, unless switching or queueing
there costs more), and placed again if that instance is lost. Every route but `/health` wants
`Authorization: Bearer <key>`; every error is OpenAI's error body. Request limits are the instances'."""


def build_gateway(instances: Sequence[str], *, api_keys: Sequence[str], policy: PolicyConfig,
                  max_body_bytes: int = 1 << 20, probe_interval_s: float = 1.0, fail_after: int = 2,
                  probe_timeout_s: float = 30.0, instance_key: str | None = None,
                  inferred_calls: int = 65_536, response_store: responses.Store | None = None) -> FastAPI:
    """The gateway app over instance servers at `instances` (base URLs): a `Gateway` (`app.state.gateway`)
    behind the module's routes. `api_keys`: the callers' keys (the instances must take them too);
    `instance_key`: the key of the gateway's own requests (model lists; default the first of
    `api_keys`). Start it under uvicorn: its health checks run while it serves. `app.state.upstreams`
    are the instances, `app.state.registry` its metrics, `app.state.sessions` each session's last
    instance. A call that names no session goes in its `prompt_cache_key`'s, else in one inferred
    from its prompt's token ids, as an instance server infers them (`scheduler.inferred`, keeping up
    to `inferred_calls` calls; 0: none), and the instance is told the session by name.
    `response_store`: the Responses API's stored responses (default: 10,000 for an hour).

    Raises:
        ValueError: no instance URL, or no non-empty API key.
    """
    gw = Gateway(instances, api_keys=api_keys, policy=policy, max_body_bytes=max_body_bytes,
                 probe_interval_s=probe_interval_s, fail_after=fail_after, probe_timeout_s=probe_timeout_s,
                 instance_key=instance_key, inferred_calls=inferred_calls, response_store=response_store)
    app = FastAPI(title="talaria-route", version=schema.VERSION, description=DESCRIPTION, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json", lifespan=gw.lifespan)
    schema.publish(app, None)
    app.state.gateway = gw
    app.state.upstreams, app.state.registry, app.state.sessions = gw.upstreams, gw.registry, gw.sessions
    openai_errors(app)
    app.include_router(routes)
    return app


class Gateway:
    """The router gateway's state and parts: the instances and their health checks (`check`,
    `health_loop`), placement (`place`: probes and the policy's router), forwarding (`call`) and the
    stream relay (`streamed`). The module's routes call it; so can a test, alone."""

    def __init__(self, instances: Sequence[str], *, api_keys: Sequence[str], policy: PolicyConfig,
                 max_body_bytes: int = 1 << 20, probe_interval_s: float = 1.0, fail_after: int = 2,
                 probe_timeout_s: float = 30.0, instance_key: str | None = None, inferred_calls: int = 65_536,
                 response_store: responses.Store | None = None):
        if not instances:
            raise ValueError("build_gateway: give at least one instance URL")
        if not api_keys or not all(isinstance(k, str) and k for k in api_keys):
            raise ValueError("build_gateway: give at least one non-empty API key")
        self.upstreams = [Upstream(f"i{k}", url.rstrip("/")) for k, url in enumerate(instances)]
        self.policy, self.max_body_bytes = policy, max_body_bytes
        self.probe_interval_s, self.fail_after, self.probe_timeout_s = probe_interval_s, fail_after, probe_timeout_s
        self.own_key = instance_key or api_keys[0]
        self.caller = key_checker(api_keys)
        self.secret = secrets.token_bytes(32)  # groups the gateway's sessions by tenant (never sent anywhere)
        self.registry = reg = CollectorRegistry()
        self.m_requests = Counter("talaria:router_requests", "Calls forwarded, by instance", ["instance"],
                                  registry=reg)
        self.m_replaced = Counter("talaria:router_replacements", "Calls placed again after their instance was lost",
                                  registry=reg)
        self.m_refused = Counter("talaria:router_refused",
                                 "Requests refused by the gateway's own checks (never forwarded)", registry=reg)
        self.m_up = Gauge("talaria:router_instance_up", "1 while the instance takes calls", ["instance"], registry=reg)
        self.m_inflight = Gauge("talaria:router_inflight", "Calls forwarded and not yet answered", ["instance"],
                                registry=reg)
        self.m_sessions = Counter("talaria:router_sessions", "Sessions begun, by how they were identified (named: "
                                  "session_id or x-session-id; prompt_cache_key; chain: previous_response_id; "
                                  "conversation; inferred)", ["identified"], registry=reg)
        self.m_e2e = Histogram("talaria:router_request_latency_seconds", "Arrival to the end of the answer",
                               registry=reg,
                               buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0))
        self.open_limits = Limits(max_body_bytes=max_body_bytes, max_tokens=1 << 30, max_n=_MAX_N)
        self.sessions: dict[str, str] = {}  # tenant-scoped session -> the instance of its last call (least recent first)
        self._anonymous = itertools.count()
        self.inference = SessionInference(inferred_calls) if inferred_calls else None
        self.responses = response_store if response_store is not None else responses.Store()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None),
                                      limits=httpx.Limits(max_connections=1000))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await asyncio.gather(*(self.check(up) for up in self.upstreams))
        task = asyncio.create_task(self.health_loop())
        yield
        task.cancel()
        await self.http.aclose()

    # --- instance health ---------------------------------------------------------------------------
    def taken_out(self, up: Upstream, why: str) -> None:
        if up.alive or up.accepting:
            logging.warning("instance %s (%s) taken out: %s", up.name, up.url, why)
        up.alive = up.accepting = False
        up.lost.set()
        self.m_up.labels(up.name).set(0)

    async def check(self, up: Upstream) -> None:
        """One health check of `up`: a refused connection takes it out at once, `fail_after` misses in a
        row too; back in service, its models are listed again."""
        try:
            r = await self.http.get(f"{up.url}/health", timeout=max(0.5, self.probe_interval_s))
        except httpx.ConnectError as e:  # nothing listens: the process is gone
            up.misses = self.fail_after
            return self.taken_out(up, f"connection refused ({e})")
        except httpx.HTTPError as e:
            up.misses += 1
            if up.misses >= self.fail_after:
                self.taken_out(up, f"{up.misses} health checks missed ({type(e).__name__})")
            return
        if not up.alive or not up.models:  # (back) in service: what does it serve?
            try:
                lst = await self.http.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {self.own_key}"},
                                          timeout=self.probe_timeout_s)
                lst.raise_for_status()
                up.models = tuple(m["id"] for m in lst.json()["data"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                logging.warning("instance %s: cannot list its models: %s", up.name, e)
                return
            up.lost = asyncio.Event()
        up.misses, up.alive, up.accepting = 0, True, r.status_code == 200
        self.m_up.labels(up.name).set(int(up.accepting))

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(up) for up in self.upstreams))
            await asyncio.sleep(self.probe_interval_s)

    # --- placing one call --------------------------------------------------------------------------
    def served(self, call: _Call, up: Upstream, output_ids: list[int] | None, tool_ids: list[str] = ()) -> None:
        """The call was answered by `up` (with `output_ids`, its leading output tokens, and the ids of
        its tool calls, for the inference): where its session ran last."""
        if call.inferred is not None:
            self.inference.finished(call.inferred, output_ids or [], tool_ids)
        if call.session_key is not None:
            if self.sessions.pop(call.session_key, None) is None:
                self.m_sessions.labels(call.how).inc()
            self.sessions[call.session_key] = up.name
            if len(self.sessions) > MAX_SESSIONS:
                del self.sessions[next(iter(self.sessions))]

    def failed(self, up: Upstream, call: _Call, why) -> None:
        logging.warning("a call on instance %s failed (%s): placing it again", up.name, why)
        call.tried.add(up.name)
        self.m_replaced.inc()
        asyncio.ensure_future(self.check(up))

    async def place(self, call: _Call) -> tuple[Upstream, str | None]:
        """The best instance for the call under the policy's router, after probing every accepting
        instance that serves the model (and has not failed this call), and the id its probe kept the
        checked request under. The request is rendered and tokenized once: the first instance probed
        (the session's last, if it is a candidate) answers the prompt's token ids, and the others are
        probed with them; if it fails, the others are probed at once, each rendering the prompt.
        Instances whose probe refuses the request (a 4xx: their own limits) are passed over; if all
        do, the first refusal is the caller's answer. An instance that fails its probe (5xx, no
        answer) is skipped."""
        ups = self.upstreams
        if not any(call.model in up.models for up in ups):
            served = sorted({m for up in ups for m in up.models})
            raise ApiError(404, f"the model '{call.model}' does not exist (served: {', '.join(served) or 'none'})",
                           "model", "model_not_found")
        cands = [up for up in ups if up.accepting and call.model in up.models and up.name not in call.tried]
        if not cands:
            if call.error is not None:  # every instance up answered a server error: the client gets the last
                raise _Relayed(call.error)
            raise ApiError(503, f"no instance that serves '{call.model}' is up", code="unavailable")
        last = self.sessions.get(call.session_key) if call.session_key is not None else None
        cands.sort(key=lambda up: up.name != last)  # stable: the session's last instance first
        answers = []
        infer = call.sid is None and self.inference is not None
        if len(cands) > 1 or infer:
            first = await self._probe(call, cands[0], call.raw, tokens=True)
            if _failed(first[1]) and len(cands) > 1:  # the others at once, each rendering the prompt itself
                answers = [first, *await asyncio.gather(*(self._probe(call, up, call.raw, tokens=True)
                                                          for up in cands[1:]))]
                rest = []
            else:
                answers, rest = [first], cands[1:]
            ids = None
            for a in answers:  # the ids of the first that answered them (the router takes none)
                got = a[2].pop("prompt_token_ids", None) if a[2] is not None else None
                ids = got if ids is None else ids
            content = call.raw if ids is None else _with_ids(call.body, ids)
            again = []
            if infer and ids is not None:
                last = self.identify(call, ids)
                k = next((k for k, a in enumerate(answers) if a[0].name == last and a[2] is not None), None)
                if k is not None and len(cands) > 1:  # (one candidate is not ranked: the forward names the session)
                    up, _, answer = answers.pop(k)  # its answer left out the session's KV on host: asked again,
                    again = [self._probe(call, up, content, kept=answer.get("probe"))]  # by the id it kept
            answers += await asyncio.gather(*again, *(self._probe(call, up, content) for up in rest))
        else:
            answers.append(await self._probe(call, cands[0], call.raw))
        snaps, bad = [], None
        for up, r, answer in answers:
            if _failed(r):
                call.tried.add(up.name)
                call.error = r if r is not None and r.status_code != 503 else call.error
            elif r.status_code != 200:
                bad = bad or r
            else:
                snaps.append(_Snapshot(up, answer))
        if not snaps:
            if bad is not None:  # every instance that answered refused the request: its fault, as they said
                raise _Relayed(bad)
            return await self.place(call)  # every candidate failed: the next round finds none (503) or others
        c = Call(call.session_key or f"~{next(self._anonymous)}", 0, call.model, int(snaps[0].s["prompt_tokens"]),
                 0, 0.0)
        session = Session(c.session, [c], last_instance=last)
        best = router.rank(self.policy, c, session, snaps, {s.name: s.routed() for s in snaps})[0]
        return best.up, best.s.get("probe")

    def tenant(self, key: str) -> str:
        """The tenant of an API key, as the gateway groups sessions and stored responses (an HMAC)."""
        return hmac.new(self.secret, key.encode(), hashlib.sha256).hexdigest()[:16]

    def identify(self, call: _Call, prompt_ids: list[int]) -> str | None:
        """Puts a call that names no session in one inferred from its prompt's token ids (named to the
        instances by `x-session-id`); the instance its session ran on last, if any."""
        call.inferred = self.inference.identify(call.tenant, prompt_ids, _tool_ids_sent(call.body))
        call.sid, call.how = call.inferred.session, "inferred"
        call.headers |= {"x-session-id": call.sid, "x-talaria-identified": "inferred", "x-talaria-output-ids": "1"}
        return self.sessions.get(call.session_key)

    async def _probe(self, call: _Call, up: Upstream, content: bytes, tokens: bool = False, kept: str | None = None):
        """(up, its answer or None, the answer's JSON when it is a 200). `kept`: the id of the request
        as `up`'s earlier probe kept it, which `up` then reads instead of `content` while it has it."""
        params = {"kind": "chat" if call.chat else "completion"} | ({"tokens": "true"} if tokens else {})
        try:
            r = await self.http.post(f"{up.url}/talaria/probe", params=params, content=content,
                                     headers=_forward(call.headers, kept), timeout=self.probe_timeout_s)
        except httpx.HTTPError:
            asyncio.ensure_future(self.check(up))
            return up, None, None
        return up, r, r.json() if r.status_code == 200 else None

    # --- forwarding ----------------------------------------------------------------------------------
    async def call(self, request: Request, path: str, chat: bool, body: Any = None,
                   session: tuple[str, str] | None = None):
        """One client call: checked, placed, forwarded (placed again while instances fail), answered.
        `body`: the request already read and translated (a Messages or Responses request's chat form);
        `session`: what the translated request names as its session, and how (a response chain)."""
        t0 = time.perf_counter()
        key = self.caller(request)
        rid = protocol.request_id(request.headers)  # the call's id at every instance it is sent to
        if body is None:
            body = await read_json(request, self.max_body_bytes)
        try:  # what every instance would refuse is refused here, before any instance is asked
            (protocol.parse_chat if chat else protocol.parse_completion)(body, self.open_limits)
        except ApiError as e:
            if e.param not in _INSTANCE_LIMITS:  # (those the instances check, naming their own limits)
                self.m_refused.inc()
                raise
        sid, how = _session_id(request, body), "named"
        if sid is None and isinstance(body.get("prompt_cache_key"), str):
            sid, how = body["prompt_cache_key"], "prompt_cache_key"  # (its length was checked with the body)
        if sid is None and session is not None:
            sid, how = session
        if _sampled(body) and body.get("seed") is None:
            body["seed"] = secrets.randbelow(_SEED_MAX)  # a retry elsewhere draws the same tokens
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "x-request-id": rid}
        for name in ("x-session-id", "x-agent-hints"):  # (the body's session_id and agent_hints travel in the body)
            if request.headers.get(name) is not None:
                headers[name] = request.headers[name]
        if "x-agent-hints" in headers:  # refused here, as a bad body is
            protocol.agent_hints(protocol.hints_header(headers["x-agent-hints"]), "x-agent-hints")
        sid = None if sid is None else protocol.header_value(sid)  # (as the instances name it)
        if sid is not None and how != "named":  # the instances are told the session by name, and how it was found
            headers |= {"x-session-id": sid, "x-talaria-identified": how}
        call = _Call(body, json.dumps(body).encode(), headers, path, body["model"], sid, self.tenant(key), chat, how)
        if body.get("stream") is True:
            return await self.streamed(call, t0)
        while True:
            up, probed = await self.place(call)
            self.m_requests.labels(up.name).inc()
            up.inflight += 1
            try:
                r = await _until_lost(self.http.post(f"{up.url}{path}", content=call.raw,
                                                     headers=_forward(call.headers, probed)), up, request)
            except (_Lost, httpx.HTTPError) as e:
                self.failed(up, call, e)
                continue
            finally:
                up.inflight -= 1
            if r.status_code >= 500:
                call.error = r if r.status_code != 503 else call.error
                self.failed(up, call, f"HTTP {r.status_code}")
                continue
            if r.status_code != 200:
                raise _Relayed(r)  # the instance's refusal, as it wrote it (JSON or not)
            body = r.json()
            self.served(call, up, _output_ids(body), _tool_ids(body, "message"))
            self.m_e2e.observe(time.perf_counter() - t0)
            return JSONResponse(body, headers=_named(call, r))

    async def open_stream(self, call: _Call) -> _Open:
        """A streamed call's upstream response (200) on the best instance; the instance's refusal
        (4xx) as an ApiError."""
        while True:
            up, probed = await self.place(call)
            self.m_requests.labels(up.name).inc()
            up.inflight += 1
            try:
                req = self.http.build_request("POST", f"{up.url}{call.path}", content=call.raw,
                                              headers=_forward(call.headers, probed))
                r = await _until_lost(self.http.send(req, stream=True), up)
            except (_Lost, httpx.HTTPError) as e:
                up.inflight -= 1
                self.failed(up, call, e)
                continue
            if r.status_code == 200:
                return _Open(r, up)
            await r.aread()
            await r.aclose()
            up.inflight -= 1
            if r.status_code >= 500:
                call.error = r if r.status_code != 503 else call.error
                self.failed(up, call, f"HTTP {r.status_code}")
                continue
            raise _Relayed(r)

    async def streamed(self, call: _Call, t0: float) -> StreamingResponse:
        box = [await self.open_stream(call)]

        async def release():  # after the response, also when the client left before it started
            await box[0].release()
        return _Streamed(self.relay_events(call, box, t0), media_type="text/event-stream",
                         background=BackgroundTask(release), headers=_named(call, box[0].r))

    async def relay_events(self, call: _Call, box: list, t0: float):
        """The client's SSE stream: the upstream's events, and after a loss the events of the call
        placed again, trimmed of what was sent (`_Relay`). The client going away closes the upstream
        stream, which aborts the call there."""
        relay = _Relay(call.chat)
        output = None  # the output's leading token ids, from the instance that answered (for the inference)
        tool_ids: list[str] = []  # and the ids of its tool calls
        while True:
            cur = box[0]
            try:
                lines = cur.r.aiter_lines()
                while True:
                    try:
                        line = await _until_lost(lines.__anext__(), cur.up)
                    except StopAsyncIteration:
                        raise _Lost("the stream ended before [DONE]") from None
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        self.served(call, cur.up, output, tool_ids)
                        self.m_e2e.observe(time.perf_counter() - t0)
                        yield "data: [DONE]\n\n"
                        return
                    event = json.loads(line[6:])
                    output = _output_ids(event) or output
                    tool_ids += _tool_ids(event, "delta")
                    out = relay.feed(event)
                    if out is not None:
                        yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n"
            except (_Lost, httpx.HTTPError, ValueError) as e:
                await cur.release()
                if relay.complete:  # only [DONE] was missing: the answer is whole
                    yield "data: [DONE]\n\n"
                    return
                self.failed(cur.up, call, e)
                relay.attempt()
                try:
                    box[0] = await self.open_stream(call)
                except ApiError as err:
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
            except Exception as e:  # noqa: BLE001 - a bug: end the stream with an error body, not a reset
                logging.exception("relaying a stream failed")
                yield f"data: {json.dumps(ApiError(500, f'internal error ({type(e).__name__})').body())}\n\n"
                return


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


routes = APIRouter()


@routes.get("/health", **schema.HEALTH)
async def health(request: Request):
    ups = _gateway(request).upstreams
    n = sum(up.accepting for up in ups)
    instances = [{"name": up.name, "url": up.url, "up": up.accepting, "models": list(up.models)} for up in ups]
    return JSONResponse({"status": "ok" if n else "no instance", "instances_up": n, "instances": instances},
                        status_code=200 if n else 503)


@routes.get("/v1/models", **schema.MODELS)
async def list_models(request: Request):
    gw = _gateway(request)
    gw.caller(request)
    names = dict.fromkeys(m for up in gw.upstreams if up.alive for m in up.models)
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "talaria"}
                                       for n in names]}


@routes.get("/metrics", **schema.METRICS)
async def get_metrics(request: Request):
    gw = _gateway(request)
    gw.caller(request)
    for up in gw.upstreams:
        gw.m_inflight.labels(up.name).set(up.inflight)
    return Response(generate_latest(gw.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.post("/v1/completions", **schema.COMPLETIONS)
async def completions(request: Request):
    return await _gateway(request).call(request, "/v1/completions", chat=False)


@routes.post("/v1/chat/completions", **schema.CHAT_COMPLETIONS)
async def chat_completions(request: Request):
    return await _gateway(request).call(request, "/v1/chat/completions", chat=True)


@routes.post("/v1/messages", **schema.MESSAGES)
async def anthropic_messages(request: Request):
    gw = _gateway(request)
    gw.caller(request)
    chat = messages.to_chat(await read_json(request, gw.max_body_bytes))
    return messages.answer(await gw.call(request, "/v1/chat/completions", chat=True, body=chat), chat["model"])


@routes.post("/v1/responses", **schema.RESPONSES_CREATE)
async def create_response(request: Request):
    gw = _gateway(request)
    tenant = gw.tenant(gw.caller(request))
    t = responses.translate(await read_json(request, gw.max_body_bytes), gw.responses, tenant)
    chat = await gw.call(request, "/v1/chat/completions", chat=True, body=t.chat, session=t.session)
    return responses.answer(chat, t, gw.responses, tenant)


@routes.get("/v1/responses/{response_id}", **schema.RESPONSES_GET)
async def get_response(request: Request, response_id: str):
    gw = _gateway(request)
    return JSONResponse(gw.responses.get(response_id, gw.tenant(gw.caller(request))).body)


@routes.delete("/v1/responses/{response_id}", **schema.RESPONSES_DELETE)
async def delete_response(request: Request, response_id: str):
    gw = _gateway(request)
    return gw.responses.delete(response_id, gw.tenant(gw.caller(request)))


@dataclasses.dataclass
class _Call:
    """One call as the gateway forwards it (again, after a loss)."""
    body: dict
    raw: bytes
    headers: dict
    path: str
    model: str
    sid: str | None
    tenant: str
    chat: bool
    how: str  # how the session was identified: named, prompt_cache_key or inferred
    tried: set = dataclasses.field(default_factory=set)  # instances that failed this call
    error: httpx.Response | None = None  # the last 5xx an instance answered, if every one fails
    inferred: Identified | None = None  # the inference's record of the call, once its session is inferred

    @property
    def session_key(self) -> str | None:
        return None if self.sid is None else f"{self.tenant}:{self.sid}"


class _Open:
    """The upstream stream a streamed call reads now; `release` closes it and counts it off its
    instance, once (from the relay on a loss, or after the response, however it ended)."""

    def __init__(self, r: httpx.Response, up: Upstream):
        self.r, self.up, self.released = r, up, False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.up.inflight -= 1
            await self.r.aclose()


class _Streamed(StreamingResponse):
    """A StreamingResponse whose background task (the upstream's release, idempotent) runs however the
    response ended: a client gone before the stream started or mid-way included."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.background is not None:
                await self.background()


async def _until_lost(aw, up: Upstream, request: Request | None = None):
    """Awaits `aw` unless `up` is taken out first (raises _Lost) or the client of `request` goes away
    (raises ApiError 499; the upstream request is cancelled, which aborts it there)."""
    task = asyncio.ensure_future(aw)
    lost = asyncio.ensure_future(up.lost.wait())
    watch = {task, lost}
    try:
        while True:
            done, _ = await asyncio.wait(watch, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if lost in done:
                raise _Lost(f"instance {up.name} was taken out")
            if request is not None and await request.is_disconnected():
                raise ApiError(499, "the client disconnected", code="client_disconnected")
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()


def _failed(r: httpx.Response | None) -> bool:
    """A probe that failed (no answer, or a server error): the instance is passed over for the call."""
    return r is None or r.status_code >= 500


def _named(call: _Call, r: httpx.Response) -> dict:
    """The answer's headers: the call's id (as the instance `r` came from served it: an id it had in
    flight already gets a suffix), and the session the call was placed in (as the client named it,
    by `prompt_cache_key`, or as inferred)."""
    rid = {"x-request-id": r.headers.get("x-request-id", call.headers["x-request-id"])}
    return rid | {"x-talaria-session": call.sid} if call.sid is not None else rid


def _output_ids(body: dict) -> list[int] | None:
    """Takes out of an instance's answer (or stream event) the first choice's leading output token ids
    that the gateway asked for (`x-talaria-output-ids`), if they are there."""
    choices = body.get("choices") or []
    return choices[0].pop("talaria_output_token_ids", None) if choices and isinstance(choices[0], dict) else None


def _tool_ids(body: dict, part: str) -> list[str]:
    """The ids of the tool calls in the first choice of an answer (`part` "message") or of a stream
    event ("delta"): what the client sends back, naming the call that made them."""
    choices = body.get("choices") or []
    return _call_ids(choices[0].get(part) if choices and isinstance(choices[0], dict) else None)


def _tool_ids_sent(body: dict) -> list[str]:
    """The ids of the tool calls of the latest assistant message a chat request brings back."""
    for m in reversed(body.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "assistant":
            return _call_ids(m)
    return []


def _call_ids(message) -> list[str]:
    """The ids of a message's (or delta's) `tool_calls`; none for anything else."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return [c["id"] for c in calls or () if isinstance(c, dict) and isinstance(c.get("id"), str)]


def _with_ids(body: dict, ids: list[int]) -> bytes:
    """A probe's body that brings the prompt's token ids instead of the messages (the tools stay: the
    instance that serves the call parses its output for them and may constrain it to them)."""
    rest = {k: v for k, v in body.items() if k != "messages"}
    return json.dumps({**rest, "talaria_prompt_token_ids": ids}).encode()


def _forward(headers: dict, probed: str | None) -> dict:
    """The headers of a call forwarded to the instance whose probe kept it as `probed`."""
    return headers if probed is None else {**headers, "x-talaria-probe": probed}


def _error_fields(r: httpx.Response) -> dict:
    try:
        e = r.json()["error"]
        return {"message": e["message"], "param": e.get("param"), "code": e.get("code")}
    except (ValueError, KeyError, TypeError):
        return {"message": f"the instance answered {r.status_code}"}
