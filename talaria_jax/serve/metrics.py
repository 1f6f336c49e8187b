"""Prometheus metrics of the instance server (`GET /metrics`), named as vLLM names its own where one
exists (`vllm:` becomes `talaria:`).

Gauges and counters are read from the engine at scrape time (its stats are the counters); the
histograms are observed as outputs arrive: time to first token, inter-token latency, end-to-end
latency, and session completion time (SCT), the span from a session's first call to the end of its
last, closed once the session has made no call for `session_idle_s`. The time to first token and
the end-to-end latency of a request carry its request id as an exemplar (`{request_id="..."}`), which
a scrape that asks for OpenMetrics (`Accept: application/openmetrics-text`) sees: a slow bucket
names a request to look up.
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from talaria_jax.engine.engine import RequestOutput

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SCT = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
MAX_SESSIONS = 100_000  # open sessions tracked for SCT; past it, idle ones are closed at once


class ServerMetrics:
    """One registry per server (several servers may share a process, as the tests run them)."""

    def __init__(self, async_engine, model: str, session_idle_s: float = 60.0):
        self.async_engine, self.model, self.session_idle_s = async_engine, model, session_idle_s
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("talaria:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY, registry=self.registry)
        self.itl = Histogram("talaria:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_LATENCY, registry=self.registry)
        self.e2e = Histogram("talaria:e2e_request_latency_seconds", "Request latency, arrival to finish", labels,
                             buckets=_LATENCY + (120.0, 300.0), registry=self.registry)
        self.sct = Histogram("talaria:session_completion_time_seconds", "First call of a session to the end of "
                             "its last (closed after session_idle_s without a call), by how the session was "
                             "identified (named: session_id or x-session-id; prompt_cache_key; chain: "
                             "previous_response_id; conversation; inferred)",
                             labels + ["identified"], buckets=_SCT, registry=self.registry)
        self.prompt_tokens = Counter("talaria:prompt_tokens", "Prompt tokens of requests", labels, registry=self.registry)
        self.generation_tokens = Counter("talaria:generation_tokens", "Tokens generated", labels, registry=self.registry)
        self.finished = Counter("talaria:request_success", "Requests ended, by reason (stop: a stop token or string; "
                                "length; abort: the client went away)", labels + ["finished_reason"],
                                registry=self.registry)
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # request id -> time of its last token
        self._sessions: dict[str, list] = {}  # session -> [first arrival, last finish, last activity, how identified]
        self.registry.register(self)

    def on_output(self, out: RequestOutput, arrival: float, session: str | None) -> None:
        """Called for every output (engine thread)."""
        now = time.perf_counter()
        with self._lock:
            last = self._last.get(out.request_id)
            exemplar = {"request_id": out.request_id} if len(out.request_id) <= 100 else None  # (128 in all)
            if out.new_token_ids:
                self.generation_tokens.labels(self.model).inc(len(out.new_token_ids))
                if last is None:
                    self.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
                    self.ttft.labels(self.model).observe(now - arrival, exemplar)
                else:
                    self.itl.labels(self.model).observe((now - last) / len(out.new_token_ids))
                self._last[out.request_id] = now
            if out.finished:
                self._last.pop(out.request_id, None)
                self.finished.labels(self.model, out.finish_reason).inc()
                if out.finish_reason != "abort":
                    self.e2e.labels(self.model).observe(now - arrival, exemplar)
                if session is not None:
                    s = self._sessions.setdefault(session, [arrival, now, now, "named"])
                    s[0], s[1], s[2] = min(s[0], arrival), now, now
        if len(self._sessions) > MAX_SESSIONS:
            self._close_idle_sessions()

    def session_started(self, session: str, how: str = "named") -> None:
        with self._lock:
            now = time.perf_counter()
            s = self._sessions.setdefault(session, [now, now, now, how])
            s[2] = now

    def _close_idle_sessions(self) -> None:
        now = time.perf_counter()
        with self._lock:
            if len(self._sessions) > MAX_SESSIONS:  # too many open: the oldest activity closes first
                for sid in sorted(self._sessions, key=lambda k: self._sessions[k][2])[:len(self._sessions) // 10]:
                    first, end, _, how = self._sessions.pop(sid)
                    self.sct.labels(self.model, how).observe(end - first)
            for sid, (first, end, active, how) in list(self._sessions.items()):
                if now - active >= self.session_idle_s:
                    self.sct.labels(self.model, how).observe(end - first)
                    del self._sessions[sid]

    def collect(self):
        """The engine's gauges and counters, read now (prometheus_client calls this at each scrape)."""
        ae = self.async_engine
        backend = ae.engine  # an Engine, or an InstanceEngine: several engines on one KV arena
        engines = getattr(backend, "engines", [backend])
        with ae.locked():
            running = sum(e.num_running() for e in engines)
            waiting = sum(e.num_waiting() for e in engines)
            cached = sum(e.prefix_cache.num_pages for e in engines if e.prefix_cache is not None)
            budgets = list({id(e.host_tier.budget): e.host_tier.budget for e in engines}.values())  # shared or own
            host = sum(b.used_bytes for b in budgets)
            host_cap = sum(b.capacity_bytes for b in budgets) if all(b.capacity_bytes is not None for b in budgets) \
                else -1
            host_copies = sum(b.num_copies for b in budgets)
            evictions = sum(b.evictions for b in budgets)
            alloc = engines[0].allocator  # the arena's: shared by an instance's engines
            pages_used, pages = alloc.num_used, alloc.num_pages
            stats = [e.stats for e in engines]
            state = backend.state() if hasattr(backend, "state") else None
        total = lambda field: sum(getattr(st, field) for st in stats)
        if state is not None:  # calls routed to the instance wait for admission or a switch too
            waiting = state["waiting"]
        m = [self.model]
        gauges = [("num_requests_running", "Requests in the running batch", running),
                  ("num_requests_waiting", "Requests waiting for admission", waiting),
                  ("kv_pages_used", "Device KV pages held (running sequences and the prefix cache)", pages_used),
                  ("kv_pages_cached", "Device KV pages held by the prefix cache", cached),
                  ("kv_pages_total", "Device KV pages in the pool", pages),
                  ("kv_cache_usage_perc", "Fraction of device KV pages held", pages_used / max(1, pages)),
                  ("host_kv_bytes", "Bytes of session KV held in host memory", host),
                  ("host_kv_capacity_bytes", "Bound on host_kv_bytes (--host_kv_bytes; -1: unbounded)", host_cap),
                  ("host_kv_copies", "Session KV copies held in host memory", host_copies),
                  ("engine_healthy", "1 while the engine serves, 0 once draining or dead", int(ae.state == "running"))]
        for name, doc, v in gauges:
            g = GaugeMetricFamily(f"talaria:{name}", doc, labels=["model_name"])
            g.add_metric(m, v)
            yield g
        counters = [("prefill_tokens", "Prompt tokens computed (not found cached or restored)", total("prefill_tokens")),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", total("prefix_query_tokens")),
                    ("prefix_cache_hits", "Of those, tokens found cached", total("prefix_hit_tokens")),
                    ("host_restored_tokens", "Prompt tokens restored from host memory", total("restored_tokens")),
                    ("num_preemptions", "Requests preempted (recomputed later)", total("preemptions")),
                    ("host_kv_evictions", "Host KV copies evicted to stay within host_kv_capacity_bytes", evictions),
                    ("host_kv_refused", "Session KV copies not kept (larger than the whole bound, or the copy failed)",
                     total("offload_failures")),
                    ("spec_decode_num_draft_tokens", "Speculative draft tokens verified", total("draft_tokens")),
                    ("spec_decode_num_accepted_tokens", "Of those, accepted", total("accepted_tokens"))]
        if state is not None:  # an instance of several models: its switches and its sessions
            counters += [("model_switches", "Switches of the served model", state["switches"]),
                         ("model_switch_seconds", "Seconds spent switching models", state["switch_seconds"]),
                         ("recomputed_prefix_tokens", "Prompt tokens a session's earlier call had computed, computed "
                          "again (its KV was evicted from device and host, or it moved)", state["recomputed_tokens"]),
                         ("sessions_forgotten", "Idle sessions forgotten early to stay within --max_sessions",
                          state["sessions_forgotten"])]
            g = GaugeMetricFamily("talaria:sessions_held", "Sessions the instance keeps (named ones until idle for "
                                  "their ttl, or past --max_sessions)", labels=["model_name"])
            g.add_metric(m, state["sessions"])
            yield g
        for name, doc, v in counters:
            c = CounterMetricFamily(f"talaria:{name}", doc, labels=["model_name"])
            c.add_metric(m, v)
            yield c

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The metrics and their content type: OpenMetrics (with exemplars) where the `accept` header
        asks for it, else Prometheus' text format."""
        self._close_idle_sessions()
        if "application/openmetrics-text" in accept:
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"
