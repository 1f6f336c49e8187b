"""An `Engine` stepped by one background thread, fed by asyncio request handlers.

The serving loop of the instance server: handlers `submit` requests (validated by the engine, so bad
input raises `RequestError` at once and nothing is queued) and read each request's outputs from its
own `asyncio.Queue`; the thread steps the engine while any request is unfinished and hands every
output to its request's queue on the handler's event loop. `abort` stops a request and frees its
pages (a client that went away). `drain` refuses new requests and waits for the running ones; a
failure the engine cannot recover from marks the loop dead, fails every request in flight, and the
server answers 503 from then on. A `StepError` is recoverable (the engine requeued its requests):
the loop retries.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable

from absl import logging

from talaria_jax.engine.engine import Engine, RequestOutput, StepError
from talaria_jax.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineDead", "Unavailable"]


class Unavailable(RuntimeError):
    """The loop is draining or dead: no new request is taken (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine failed for good while the request ran."""


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    session: str | None


class AsyncEngine:
    """See the module docstring. `on_output(output, arrival_s, session)` runs on the engine thread for
    every output (metrics)."""

    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput, float, str | None], None] | None = None):
        self.engine = engine
        self.on_output = on_output
        self.state = "running"  # running | draining | dead
        self.error: str | None = None
        self._lock = threading.Lock()  # the engine is not thread-safe: every call on it holds this
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="talaria-engine", daemon=True)
        self._thread.start()

    # -- requests (any thread; handlers call them through asyncio.to_thread) -------------------------
    def submit(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop, *,
               cache_salt: str | None = None, session: str | None = None) -> tuple[str, asyncio.Queue]:
        """Queues a request; returns its id and the queue its outputs arrive on (a `RequestOutput` per
        step that advanced it, the last one finished, or an `EngineDead`). The engine's RequestError for
        bad input, Unavailable while draining or dead."""
        with self._lock:
            if self.state != "running":
                raise Unavailable(f"the engine is {self.state}" + (f": {self.error}" if self.error else ""))
            rid = self.engine.add_request(prompt, params, cache_salt=cache_salt, session=session)
            stream = _Stream(loop, asyncio.Queue(), time.perf_counter(), session)
            self._streams[rid] = stream
            self._wake.notify()
        return rid, stream.queue

    def abort(self, rid: str) -> None:
        """Stops `rid` (if still in flight) and frees its pages; its queue gets nothing more."""
        with self._lock:
            self._streams.pop(rid, None)
            if rid in self.engine.requests:
                self.engine.abort(rid)

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits up to `timeout_s` for those in flight; whether they all finished."""
        with self._lock:
            if self.state == "running":
                self.state = "draining"
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.num_in_flight() == 0

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stop:
                    return
                try:
                    outs = self.engine.step()
                except StepError as e:  # recoverable: the engine requeued every request
                    logging.warning("engine step failed, retrying: %s", e)
                    continue
                except Exception as e:  # noqa: BLE001 - the engine is unusable: fail every request, loudly
                    logging.exception("engine failed")
                    self.state, self.error = "dead", f"{type(e).__name__}: {e}"
                    for stream in self._streams.values():
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDead(self.error))
                    self._streams.clear()
                    return
                ready = []
                for out in outs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue  # aborted meanwhile
                    if out.finished:
                        del self._streams[out.request_id]
                    ready.append((stream, out))
            for stream, out in ready:
                if self.on_output is not None:
                    self.on_output(out, stream.arrival, stream.session)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
