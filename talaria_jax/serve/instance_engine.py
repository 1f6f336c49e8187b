"""`InstanceEngine`: a multi-model ``Instance`` under the scheduler, behind the `Engine` interface
that `AsyncEngine` steps (`add_request`, `step`, `abort`, `has_unfinished`, `requests`).

This is how the instance server serves several models on one mesh: every request becomes a `Call`
of its session, routed by a one-instance `Scheduler` running the server's policy, so admission,
session-prefill, soft reservations, slots, staging and host-KV restores are the same code the
simulator and the local replay run. Time is the real clock (seconds since the engine started).
A session is named by the caller (`session`); a request without one is a single-call session, which
holds no reservation and is forgotten once it ends. A named session idle for `session_ttl_s` is
forgotten too (its host KV copy released), and so are the least recently active idle sessions past
`max_sessions` (a bound on the session table, whatever the traffic). Calls of a session that arrive while an earlier one runs
are served side by side (an agent's parallel tool calls).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from talaria_jax.engine.engine import CheckedRequest, RequestOutput
from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.instance import Instance, LiveTokens
from talaria_jax.scheduler import Scheduler
from talaria_jax.scheduler.api import PrefixLocation
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.session import NO_HINTS, Call, Hints, Session, SessionTable

__all__ = ["InstanceEngine", "LiveSessions"]

_IDLE_POLL_S = 0.005  # while calls wait on a held slot, how often the scheduler is asked again


class _LiveSession(Session):
    """A session whose calls are not known in advance: open (likely to return) until forgotten,
    except a single-call session, which is done once its call ends."""

    def __init__(self, sid: str, single: bool):
        super().__init__(sid, [])
        self.single = single
        self.arrivals = 0  # calls so far: the next call's turn
        self.salt: str | None = None  # the tenant salt its calls bring

    @property
    def done(self) -> bool:
        return self.single and self.finished_s is not None


class LiveSessions(SessionTable):
    """`SessionTable`'s role for live sessions: calls join as they arrive, in any order."""

    def __init__(self):
        self.sessions: dict[str, _LiveSession] = {}

    def next_call(self, sid: str, single: bool, salt: str | None, model: str, prompt_tokens: int,
                  max_tokens: int, hints: Hints = NO_HINTS, request_id: str | None = None) -> Call:
        """The session's next call (its first opens the session)."""
        s = self.sessions.setdefault(sid, _LiveSession(sid, single))
        call = Call(sid, s.arrivals, model, prompt_tokens, max_tokens, 0.0, hints=hints, request_id=request_id)
        s.arrivals, s.salt = s.arrivals + 1, salt
        if not s.calls:  # the first call opens the session; the rest are not kept (`last_model` follows them)
            s.calls.append(call)
        return call

    def salt(self, sid: str) -> str | None:
        s = self.sessions.get(sid)
        return s.salt if s is not None else None

    def complete(self, call: Call, instance: str, now: float) -> None:
        s = self.sessions[call.session]
        s.next_turn, s.last_instance, s.last_model, s.finished_s = s.next_turn + 1, instance, call.model, now


class InstanceEngine:
    """See the module docstring. `instance.tokens` must be a `LiveTokens` (the instance's models'
    tokenizers are `tokenizers[model]`): each request's prompt, params and tenant salt go there."""

    def __init__(self, instance: Instance, policy: PolicyConfig, session_ttl_s: float = 3600.0,
                 max_sessions: int = 10_000):
        if not isinstance(instance.tokens, LiveTokens):
            raise ValueError(f"instance {instance.name}: serving needs tokens=LiveTokens(), "
                             f"got {type(instance.tokens).__name__}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.instance, self.session_ttl_s, self.max_sessions = instance, session_ttl_s, max_sessions
        self.forgotten_sessions = 0  # named sessions forgotten before their ttl (past max_sessions)
        self._t0 = time.monotonic()
        self._ids = itertools.count()
        self.reset(policy)

    def reset(self, policy: PolicyConfig) -> None:
        """Serves under `policy` from now on, with an empty instance (nothing may be in flight)."""
        if getattr(self, "requests", None):
            raise RuntimeError(f"instance {self.instance.name}: reset with {len(self.requests)} requests in flight")
        self.policy = policy
        self.instance.reset(host_kv=policy.host_kv, staging=policy.staging, drop_kv_on_switch=policy.drop_kv_on_switch)
        self.instance.tokens.clear()
        self.idle_s = 0.0  # after a step that ran nothing: how long to wait before the next (AsyncEngine)
        self.sessions = LiveSessions()
        self.scheduler = Scheduler(policy, [self.instance], self.sessions)
        self.requests: dict[str, Call] = {}  # in flight: request id -> call
        self._now = self._swept = 0.0

    # --- what AsyncEngine and the server read ------------------------------------------------------
    @property
    def models(self) -> tuple[str, ...]:
        return self.instance.models()

    def engine_of(self, model: str):
        return self.instance.served[model].engine

    @property
    def engines(self) -> list:
        return [s.engine for s in self.instance.served.values()]

    def clock(self) -> float:
        self._now = max(self._now, time.monotonic() - self._t0)
        return self._now

    # --- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str | CheckedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, *, model: str, cache_salt: str | None = None,
                    session: str | None = None, hints: Hints = NO_HINTS) -> str:
        """Checks the request against `model`'s engine (RequestError, nothing queued; a `CheckedRequest`
        of that engine is not checked again, and the engine takes it as it is at admission) and routes
        it as the next call of `session`, with what the agent said of it (`Hints`; a call that ends its
        session frees the session's KV when it finishes). `request_id` (None: `req-<n>`) names the
        request here and in the engine, and its outputs."""
        if model not in self.instance.served:
            raise RequestError(f"model {model!r} is not served here (serving {', '.join(self.models)})")
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a str or None, got {type(request_id).__name__}")
        checked = self.engine_of(model).check_request(prompt, params)
        rid = request_id
        while rid is None or (request_id is None and rid in self.requests):  # (a caller may have named one so)
            rid = f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request_id {rid!r} is already in flight")
        call = self.sessions.next_call(session if session is not None else f"~{rid}", session is None, cache_salt,
                                       model, len(checked.prompt), checked.params.max_tokens, hints, request_id=rid)
        self.instance.tokens.begin(call, checked, salt=cache_salt, single=session is None)
        self.requests[rid] = call
        self.scheduler.on_arrival(call, self.clock())
        return rid

    def abort(self, rid: str) -> RequestOutput | None:
        """Stops a request wherever it is (routed, admitted or running); its partial output if its
        engine had started it."""
        call = self.requests.pop(rid, None)
        if call is None:
            return None
        self.instance.tokens.end(call)
        out = None if self.scheduler.withdraw(call) else self.instance.cancel(call)
        self.sessions.complete(call, self.instance.name, self.clock())  # the call has ended
        if self.scheduler.ends(call):
            self._forget(call.session)
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Plans the instance (admissions, staging, a switch), runs its next chunk (a switch or one
        engine step), and returns the outputs of that chunk."""
        inst, now = self.instance, self.clock()
        wake = self.scheduler.plan(inst, now)
        end = inst.start_chunk(now)
        if end is None:  # calls wait (a held slot, a reservation): ask again shortly, or on a new request
            self.idle_s = min(_IDLE_POLL_S, max(0.0, (wake or now) - now)) or _IDLE_POLL_S
            return []
        self.idle_s = 0.0
        self._now = max(self._now, end)
        finished = inst.finish_chunk(end)
        outs = [out for call, out in inst.step_outputs if call.id in self.requests]
        for call in finished:
            inst.outputs.pop(call.key, None)
            self.instance.tokens.end(call)
            self.requests.pop(call.id, None)
            self.sessions.complete(call, inst.name, end)
            self.scheduler.on_finish(call, inst, end)
            if self.scheduler.ends(call):  # a single call, or one that said it ends its session (believed)
                self._forget(call.session)
        if end - self._swept >= min(60.0, self.session_ttl_s):
            self._sweep(end)
        if len(self.sessions.sessions) > self.max_sessions:
            self._trim()
        return outs

    def _trim(self) -> None:
        """Forgets the least recently finished idle sessions until a tenth of max_sessions is free."""
        busy = {c.session for c in self.requests.values()}
        idle = sorted((s for s in self.sessions if s.id not in busy and s.finished_s is not None),
                      key=lambda s: s.finished_s)
        for s in idle[:len(self.sessions.sessions) - self.max_sessions * 9 // 10]:
            self._forget(s.id)
            self.forgotten_sessions += 1

    def _sweep(self, now: float) -> None:
        """Forgets the sessions idle for session_ttl_s (none with a call in flight)."""
        self._swept = now
        busy = {c.session for c in self.requests.values()}
        for s in list(self.sessions):
            if s.id not in busy and s.finished_s is not None and now - s.finished_s >= self.session_ttl_s:
                self._forget(s.id)

    def _forget(self, sid: str) -> None:
        self.instance.forget(sid)
        self.scheduler.forget(sid)
        self.sessions.sessions.pop(sid, None)

    # --- what the router asks (POST /talaria/probe) -------------------------------------------------
    def prefix_of(self, session: str | None, model: str, prompt: Sequence[int],
                  cache_salt: str | None) -> PrefixLocation:
        known = session is not None and session in self.sessions.sessions
        if known and self.sessions.salt(session) != cache_salt:
            return PrefixLocation()  # another tenant's session of that name
        return self.instance.prefix_of(session or "~", model, prompt, cache_salt)

    def state(self, session: str | None = None) -> dict:
        """The instance as the router's InstanceAPI sees it (see `talaria_jax.serve.gateway`); pages
        kept for `session`'s own return are not counted as reserved."""
        inst = self.instance
        pending = len(self.scheduler.state[inst.name].pending)
        return {
            "name": inst.name, "policy": self.policy.name, "models": list(inst.models()),
            "active_model": inst.active_model(),
            "weights": {m: inst.weight_state(m).value for m in inst.models()},
            "switch_s": {m: inst.estimate_switch_s(m) for m in inst.models()},
            "page_size": {m: inst.served[m].engine.page_size for m in inst.models()},
            "kv_pages_total": inst.kv_pages_total(), "kv_pages_used": inst.kv_pages_used(),
            "kv_pages_reserved": inst.kv_pages_reserved(session),
            "running": inst.num_running(), "waiting": inst.num_waiting() + pending,
            "switches": inst.stats.switches, "switch_seconds": inst.stats.switch_s,
            "recomputed_tokens": inst.stats.recomputed_tokens, "sessions": len(self.sessions.sessions),
            "sessions_forgotten": self.forgotten_sessions,
            "host_kv_bytes": inst.kv.budget.used_bytes,
        }
