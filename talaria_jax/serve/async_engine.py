"""An `Engine` stepped by one background thread, fed by asyncio request handlers.

The serving loop of the instance server: handlers `submit` requests (validated by the engine, so bad
input raises `RequestError` at once and nothing is queued) and read each request's outputs from its
own `asyncio.Queue`; the thread steps the engine while any request is unfinished and hands every
output to its request's queue on the handler's event loop. The engine is not thread-safe: only
`submit` (run in a worker thread) and the engine thread call it, under one lock. `abort` never
waits for a step: it records the request, and the engine thread aborts it (freeing its pages) before
its next step. `drain` refuses new requests and waits for the running ones. A `StepError` is
recoverable (the engine requeued its requests) and is retried, up to `max_step_failures` in a row;
past that, or on any other failure, the loop is dead: every request in flight gets `EngineDead`,
and the server answers 503 from then on.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

from absl import logging

from talaria_jax.engine.engine import CheckedRequest, Engine, RequestOutput, StepError
from talaria_jax.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineDead", "Unavailable"]


class Unavailable(RuntimeError):
    """The loop is draining or dead: no new request is taken (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine failed for good (or the server closed) while the request ran."""


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    session: str | None


class AsyncEngine:
    """See the module docstring. `on_output(output, arrival_s, session)` runs on the engine thread for
    every output, including the final one of a request aborted by `abort` (metrics); it may be set
    after construction, before the first request."""

    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput, float, str | None], None] | None = None,
                 max_step_failures: int = 3):
        self.engine, self.on_output, self.max_step_failures = engine, on_output, max_step_failures
        self.state = "running"  # running | draining | dead
        self.error: str | None = None
        self._lock = threading.Lock()  # the engine's: held for every call on it, a whole step included
        self._mu = threading.Lock()  # the streams and pending aborts: never held across a step
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._aborts: list[tuple[str, _Stream, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="talaria-engine", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, prompt: list[int] | CheckedRequest, params: SamplingParams | None,
               loop: asyncio.AbstractEventLoop, request_id: str | None = None, *, cache_salt: str | None = None,
               session: str | None = None, **route) -> tuple[str, asyncio.Queue]:
        """Queues a request under `request_id` (None: the engine makes one; one in flight already gets a
        suffix, `<id>.<hex>`, so a client that sends one id twice loses neither call); returns its id and
        the queue its outputs arrive on (a `RequestOutput` per step that advanced it, the last one
        finished, or an `EngineDead`). The engine's RequestError for bad input, Unavailable while
        draining or dead. Blocks for up to a step: call it off the loop. `route`: more arguments of the
        engine's add_request (an `InstanceEngine` wants `model`)."""
        with self._lock:
            if self.state != "running":
                raise Unavailable(f"the server is {self.state}")
            while request_id is not None and self._taken(request_id):
                request_id = f"{request_id}.{secrets.token_hex(4)}"
            rid = self.engine.add_request(prompt, params, request_id, cache_salt=cache_salt, session=session,
                                          **route)
            with self._mu:
                self._streams[rid] = _Stream(loop, asyncio.Queue(), time.perf_counter(), session)
                queue = self._streams[rid].queue
        self._wake.set()
        return rid, queue

    def _taken(self, rid: str) -> bool:
        """Whether `rid` names a request in flight, one whose last output is not handed out yet, or
        one whose abort is pending (the engine lock held)."""
        with self._mu:
            return rid in self.engine.requests or rid in self._streams or any(a[0] == rid for a in self._aborts)

    def abort(self, rid: str, queue: asyncio.Queue, reason: str = "abort") -> None:
        """Stops `rid`, the request whose outputs arrive on `queue` (what `submit` returned), if still in
        flight: its queue gets nothing more, and the engine thread aborts it (freeing its pages) before
        its next step. `reason` is what metrics record ("stop": a stop string matched). Never waits for
        a step; a no-op for a finished request (or for another request that took its id since)."""
        with self._mu:
            stream = self._streams.get(rid)
            if stream is not None and stream.queue is queue:
                del self._streams[rid]
                self._aborts.append((rid, stream, reason))
            else:
                stream = None
        if stream is not None:
            self._wake.set()

    @contextlib.contextmanager
    def locked(self):
        """Holds the engine between steps for a block (no step runs, nothing is added): yields the
        engine, for reads that must not see a step half done."""
        with self._lock:
            yield self.engine

    def num_in_flight(self) -> int:
        with self._mu:
            return len(self._streams) + len(self._aborts)

    def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits up to `timeout_s` for those in flight; whether they all finished."""
        with self._mu:
            if self.state == "running":
                self.state = "draining"
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.num_in_flight() == 0

    def close(self) -> None:
        """Stops the engine thread; requests still in flight get EngineDead."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._fail_all("the server closed")

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop:
                with self._lock:
                    aborted = self._apply_aborts()
                    busy = self.engine.has_unfinished()
                    outs = []
                    if busy:
                        try:
                            outs = self.engine.step()
                            failures = 0
                        except StepError as e:  # recoverable: the engine requeued every request
                            failures += 1
                            if failures >= self.max_step_failures:
                                raise
                            logging.warning("engine step failed (%d in a row), retrying: %s", failures, e)
                self._deliver(aborted, outs)
                idle = getattr(self.engine, "idle_s", 0.0)  # an InstanceEngine whose calls wait on the scheduler
                if not busy or idle:
                    self._wake.wait(idle or None)
                    self._wake.clear()
        except Exception as e:  # noqa: BLE001 - the engine is unusable: fail every request, loudly
            logging.exception("engine failed")
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine failed: {self.error}")

    def _apply_aborts(self) -> list[tuple[_Stream, RequestOutput]]:
        with self._mu:
            aborts, self._aborts = self._aborts, []
        out = []
        for rid, stream, reason in aborts:
            if rid in self.engine.requests:
                final = self.engine.abort(rid)
                if final is not None:
                    final.finish_reason = reason
                    out.append((stream, final))
        return out

    def _deliver(self, aborted: list[tuple[_Stream, RequestOutput]], outs: list[RequestOutput]) -> None:
        ready = []
        with self._mu:
            for out in outs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile: its abort reports it
                if out.finished:
                    del self._streams[out.request_id]
                ready.append((stream, out, True))
        for stream, out, to_queue in [(s, o, False) for s, o in aborted] + ready:
            if self.on_output is not None:
                try:
                    self.on_output(out, stream.arrival, stream.session)
                except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
                    logging.exception("on_output failed")
            if to_queue:
                _put(stream, out)

    def _fail_all(self, why: str) -> None:
        with self._mu:
            self.state = "dead"
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _put(stream, EngineDead(why))


def _put(stream: _Stream, item) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the handler's event loop is closed: nobody is waiting
        pass
