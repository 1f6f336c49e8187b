"""The rollout service: generation for RL loops over several replicas, single- and multi-turn.

    service = RolloutService([spec.build() for spec in specs])      # or ray_replicas(...) for Ray actors
    groups = service.generate(prompts, SamplingParams(max_tokens=64), n=8)   # [prompt][sample] Completions
    trajs = service.rollout(prompts, make_env, params, n=4, max_turns=6)      # multi-turn, env between turns
    service.update_weights(trainer_params)                                     # after each optimizer step

    service.pause("keep")                # or "abort" / "finish": weights can change with requests in flight
    service.update_weights(new_params)   # the kept requests resume with their KV recomputed under these
    service.resume()
    done, rest = service.generate_until(prompts, params, n=8, target=24, resume=rest)   # partial rollouts

Each replica has a worker thread that feeds it the requests placed on it (at most its batch
capacity at once, in the placement's priority order), steps it, and hands each finished request to
its future; the replicas step concurrently (Ray actors in their own processes). Placement
(rollout/placement.py) is WAR's cache-aware one by default; with it, a replica with an idle slot
and an empty queue takes the most urgent waiting request of the most loaded other replica.

WAR's workload-aware choice, made before every replica step from the measured load: while any
request waits for a batch slot the replicas are saturated and steps verify no drafts (throughput is
bound by the work, and drafts add work); otherwise each engine's policy decides per step whether
suffix drafts pay at that step's batch, from its measured step-cost curve (engine/spec/policy.py).

Sampling seeds are the service's, not the replicas': sample j of prompt i draws with a seed derived
from (the params' seed, i, j) when the params carry one, else from (the service's seed, c, i, j) in
the service's c-th call; a trajectory's turn t adds t. So outputs do not depend on placement,
timing, speculation or replica count, and two services with the same seed and calls return the same
tokens (the benchmarks rely on it).

A replica that fails (its engine dead, its Ray actor gone) is dropped and its requests are placed
again on the others, recomputed from their prompts with the same seeds; a request that has brought
down `max_replacements` + 1 replicas finishes with finish_reason "error" instead.

Controls for RL loops (the same over HTTP and on Ray replicas: they live here, not in the replicas):
- `pause(mode)` stops admitting requests (new ones queue until `resume()`) and returns once no
  replica holds one: "abort" ends every request in flight with its partial tokens (finish_reason
  "abort"); "finish" lets the running ones finish; "keep" takes the running ones off their engines
  and queues them again with what they generated so far, so after `update_weights` they continue
  from prompt + those tokens with their KV computed under the new weights.
- `update_weights` is refused while requests run unpaused, and allowed in any paused state.
- Every Completion carries `weight_versions`, the weight version of each of its tokens.
- `generate_until(..., target=K, resume=partials)`: partial rollouts. It returns the first K to
  finish and hands the rest back as `Partial`s (tokens, logprobs, versions kept) to resume in a
  later call; `abort_group` stops one prompt's samples (or one rollout prompt's trajectories).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import heapq
import itertools
import threading
from collections.abc import Callable, Sequence

from absl import logging

from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.rollout.placement import Placement, PlacementRequest, ReplicaLoad, make_placement
from talaria_jax.rollout.replica import Completion, Partial, ReplicaInfo

__all__ = ["PAUSE_MODES", "RolloutService", "Trajectory"]

PAUSE_MODES = ("abort", "finish", "keep")


@dataclasses.dataclass
class Trajectory:
    """A multi-turn rollout: `prompt` (the first), then `token_ids`, every model and environment
    token after it in order, with `mask` 1 on the model's (what a policy gradient trains on) and
    `logprobs` the model's logprob of each (0.0 on environment tokens). `end`: "done" (the
    environment ended it), "max_turns", "context" (the next turn would not fit the replica's
    context), "abort" or "error"."""
    prompt: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[Completion] = dataclasses.field(default_factory=list)
    end: str | None = None

    def context(self) -> list[int]:
        return self.prompt + self.token_ids


# What an environment is to `rollout`: make_env(prompt_index, sample_index) returns a callable that
# takes each turn's Completion and returns the tokens to append before the next turn (the tool's
# message), or None to end the trajectory.
EnvFactory = Callable[[int, int], Callable[[Completion], Sequence[int] | None]]


@dataclasses.dataclass(eq=False)
class _Req:
    id: str
    prompt: tuple[int, ...]  # what the replica gets: the original prompt + the tokens generated so far
    params: SamplingParams  # max_tokens: what is left of the budget
    salt: str | None
    place: PlacementRequest
    group: str = ""
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    replaced: int = 0  # times its replica failed under it
    version: int = 0  # the weight version it was last sent to a replica under
    # before a pause ("keep") or a cut (generate_until) took it off its replica: the original prompt and
    # params, and what it generated (tokens, logprobs, each token's weight version)
    origin: tuple[int, ...] = ()
    base: SamplingParams | None = None
    done: tuple[list, list, list] = ((), (), ())

    def __post_init__(self):
        self.origin = self.origin or self.prompt
        self.base = self.base or self.params

    def partial(self, c: Completion) -> Partial:
        """What it generated so far (`c`: its Completion, tokens merged), to resume later."""
        return Partial(self.id, list(self.origin), self.base, c.token_ids, c.logprobs, c.weight_versions,
                       self.group, c.finish_reason if c.finish_reason != "abort" else None)

    def continue_after(self, c: Completion) -> bool:
        """Takes `c` (the tokens it generated since it was last sent, or a Partial's) as done: the next replica gets
        prompt + every token so far and the rest of the budget. False when no budget is left."""
        ids, lps, vers = (list(x) for x in self.done)
        ids += c.token_ids
        lps += c.logprobs
        vers += c.weight_versions or [self.version] * len(c.token_ids)
        self.done = (ids, lps, vers)
        self.prompt = self.origin + tuple(ids)
        self.place = dataclasses.replace(self.place, prompt=self.prompt)
        left = self.base.max_tokens - len(ids)
        if left > 0:  # another seed for the rest: the first one's draws are spent
            self.params = dataclasses.replace(self.base, max_tokens=left, seed=_seed(self.base.seed, len(ids)))
        return left > 0


@dataclasses.dataclass(eq=False)
class _Worker:
    index: int
    replica: object
    info: ReplicaInfo
    queue: list = dataclasses.field(default_factory=list)  # heap of (priority, seq, _Req)
    running: dict[str, _Req] = dataclasses.field(default_factory=dict)  # sent to the replica
    aborts: list[str] = dataclasses.field(default_factory=list)
    wake: threading.Event = dataclasses.field(default_factory=threading.Event)
    dead: str | None = None
    thread: threading.Thread | None = None

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(len(self.queue) + len(self.running), self.info.capacity)


def _seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # room for + turn below 2**63


class RolloutService:
    """See the module docstring. `replicas`: objects with the `Replica` interface (in process, or
    `RayReplica`), all of one model. `placement`: a name of `placement.PLACEMENTS` or a `Placement`.
    `steps_per_call`: engine steps a worker asks of its replica per call (more saves round trips to a
    Ray actor; a call returns early when a request finishes)."""

    max_replacements = 2

    def __init__(self, replicas: Sequence, placement: str | Placement = "cache_aware", *, seed: int = 0,
                 steps_per_call: int = 1):
        """Starts one worker thread per replica; `placement` places each request (cache-aware by default).

        Raises:
            ValueError: no replicas, `steps_per_call` < 1, or replicas that serve different models.
        """
        if not replicas:
            raise ValueError("RolloutService needs at least one replica")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        infos = [r.info() for r in replicas]
        models = {(i.model, i.vocab_size) for i in infos}
        if len(models) > 1:
            raise ValueError(f"replicas serve different models: {sorted(models)}")
        self.info = min(infos, key=lambda i: i.max_model_len)
        if isinstance(placement, str):
            placement = make_placement(placement, len(replicas), block=infos[0].page_size,
                                       capacity_blocks=min(i.num_pages for i in infos))
        self.placement, self.seed, self.steps_per_call = placement, seed, steps_per_call
        self._lock = threading.RLock()
        self._calls = itertools.count()
        self._order = itertools.count()
        self._closed = False
        self._ids: set[str] = set()  # in flight
        self._rollouts = 0  # rollout() calls running (their trajectories have requests between turns)
        self._paused: str | None = None  # a PAUSE_MODES mode while paused
        self._changed = threading.Condition(self._lock)  # a worker took requests off a replica
        self.weight_version = 0
        self.counts = dict(requests=0, completed=0, aborted=0, generated_tokens=0, prompt_tokens=0, cached_tokens=0,
                           replaced=0, stolen=0)
        self.workers = [_Worker(i, r, info) for i, (r, info) in enumerate(zip(replicas, infos))]
        for w in self.workers:
            w.thread = threading.Thread(target=self._run, args=(w,), name=f"rollout-replica-{w.index}", daemon=True)
            w.thread.start()

    # ---- API -----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), n: int = 1, *,
                 trajectory_ids: Sequence[str] | None = None, turns: Sequence[int] | None = None,
                 request_ids: Sequence[str] | None = None, cache_salt: str | None = None) -> list[list[Completion]]:
        """`n` samples of each prompt (token ids), as [prompt][sample] Completions, once all finished.
        `trajectory_ids` / `turns` (per prompt) tell placement which requests continue which
        trajectory and how far along it is (an HTTP client's multi-turn loop passes them);
        `request_ids` (per prompt; "-j" is appended for n > 1) name requests for `abort`. Bad input
        raises RequestError naming the prompt and field before anything is queued."""
        futures = self.submit(prompts, params, n, trajectory_ids=trajectory_ids, turns=turns,
                              request_ids=request_ids, cache_salt=cache_salt)
        return [[f.result() for f in group] for group in futures]

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), n: int = 1, *,
               trajectory_ids: Sequence[str] | None = None, turns: Sequence[int] | None = None,
               request_ids: Sequence[str] | None = None,
               cache_salt: str | None = None) -> list[list[concurrent.futures.Future]]:
        """`generate` without waiting: a future per sample, [prompt][sample], each resolving to its
        Completion (the HTTP server awaits them)."""
        reqs = self._requests(prompts, params, n, trajectory_ids, turns, request_ids, cache_salt)
        self._submit(reqs)
        return [[r.future for r in reqs[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def _requests(self, prompts, params: SamplingParams, n: int, trajectory_ids, turns, request_ids,
                  cache_salt) -> list[_Req]:
        """The requests of a generate call, [prompt][sample] flattened; a prompt's samples form a group
        (its request id, or "g{call}-{i}")."""
        prompts = self._check_prompts(prompts, params, n)
        for name, v in (("trajectory_ids", trajectory_ids), ("turns", turns), ("request_ids", request_ids)):
            if v is not None and len(v) != len(prompts):
                raise RequestError(f"{name} has {len(v)} entries for {len(prompts)} prompts")
        call = next(self._calls)
        reqs = []
        for i, p in enumerate(prompts):
            group = f"g{call}-{i}" if request_ids is None else str(request_ids[i])
            for j in range(n):
                rid = group if request_ids is not None and n == 1 else f"{group}-{j}"
                traj = str(trajectory_ids[i]) if trajectory_ids is not None else f"g{call}-{i}"
                turn = int(turns[i]) if turns is not None else 0
                reqs.append(self._request(rid, p, params, cache_salt, traj, turn, (call, i, j), group))
        return reqs

    def generate_until(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), n: int = 1,
                       *, target: int, resume: Sequence[Partial] = (), request_ids: Sequence[str] | None = None,
                       cache_salt: str | None = None) -> tuple[list[Completion], list[Partial]]:
        """Partial rollouts: runs the `resume`d Partials of an earlier call and `n` samples of each
        prompt, returns the first `target` to finish (in the order they finished) once they have,
        and stops the rest, handing them back as Partials (tokens, logprobs and weight versions so
        far) to pass as `resume` next time. Over-provision the prompts (say 25%) so the slowest
        samples do not hold up a synchronous step.

        Raises:
            RequestError: a prompt or sampling field out of range (named), a `resume` entry that is not a
                Partial or has used its max_tokens, or a `target` outside [1, the requests of this call].
        """
        reqs = self._requests(prompts, params, n, None, None, request_ids, cache_salt)
        ready = []  # resumed Partials that had finished
        for p in resume:
            if not isinstance(p, Partial):
                raise RequestError(f"resume holds a {type(p).__name__}, not a Partial")
            base = self._check_prompts([p.prompt], p.params, 1)[0]
            req = _Req(p.request_id, base, p.params, cache_salt, PlacementRequest(base, p.group, 0, next(self._order)),
                       p.group)
            c = Completion(p.request_id, list(p.token_ids), list(p.logprobs), p.finish_reason or "abort",
                           weight_versions=list(p.weight_versions))
            if p.finish_reason is not None:
                ready.append((req, c))
            elif req.continue_after(c):
                reqs.insert(0, req)
            else:
                raise RequestError(f"resume: {p.request_id} has used its max_tokens ({p.params.max_tokens}) already")
        total = len(reqs) + len(ready)
        if not isinstance(target, int) or not 1 <= target <= total:
            raise RequestError(f"target must be an integer in [1, {total}] (the requests of this call), got {target!r}")
        self._submit(reqs)
        finished = list(ready)
        pending = {r.future: r for r in reqs}
        while len(finished) < target:
            done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
            finished += [(pending.pop(f), f.result()) for f in done]
        for f in self._stop([r.id for r in pending.values()]):
            f.result(timeout=60.0)
        rest = finished[target:] + [(r, r.future.result()) for r in pending.values()]
        return [c for _, c in finished[:target]], [r.partial(c) for r, c in rest]

    def rollout(self, prompts: Sequence[Sequence[int]], make_env: EnvFactory, params: SamplingParams = SamplingParams(),
                n: int = 1, *, max_turns: int = 8, cache_salt: str | None = None) -> list[list[Trajectory]]:
        """`n` multi-turn trajectories per prompt, as [prompt][sample]: each turn generates from the
        context so far, then the trajectory's environment (`make_env(i, j)`) returns the tokens to
        append or None to end. Environments run in the calling thread, as turns finish; each next
        turn is placed at once (its earlier turns' KV is where placement looks first).

        Raises:
            RequestError: `max_turns` not an integer >= 1, or a prompt or sampling field out of range (named).
        """
        if not isinstance(max_turns, int) or max_turns < 1:
            raise RequestError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        prompts = self._check_prompts(prompts, params, n)
        call = next(self._calls)
        trajs = [[Trajectory(list(p)) for _ in range(n)] for p in prompts]
        envs = {(i, j): make_env(i, j) for i in range(len(prompts)) for j in range(n)}
        pending: dict[concurrent.futures.Future, tuple[str, int, int]] = {}  # -> (request id, i, j)

        def submit(i: int, j: int) -> None:
            t = trajs[i][j]
            turn = len(t.turns)
            req = self._request(f"r{call}-{i}-{j}-t{turn}", tuple(t.context()), params, cache_salt,
                                f"r{call}-{i}-{j}", turn, (call, i, j), f"r{call}-{i}")
            pending[req.future] = (req.id, i, j)
            self._submit([req])

        with self._lock:
            self._rollouts += 1
        try:
            for i in range(len(prompts)):
                for j in range(n):
                    submit(i, j)
            self._turns(trajs, envs, pending, submit, params, max_turns)
        finally:
            with self._lock:
                self._rollouts -= 1
            for rid, _, _ in list(pending.values()):  # an environment raised: stop the rest
                self.abort(rid)
        return trajs

    def _turns(self, trajs, envs, pending, submit, params: SamplingParams, max_turns: int) -> None:
        while pending:
            ready, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in ready:
                _, i, j = pending.pop(fut)
                t, c = trajs[i][j], fut.result()
                t.turns.append(c)
                t.token_ids += c.token_ids
                t.mask += [1] * len(c.token_ids)
                t.logprobs += c.logprobs
                if c.finish_reason in ("abort", "error"):
                    t.end = c.finish_reason
                    continue
                more = envs[i, j](c)
                if more is None:
                    t.end = "done"
                    continue
                more = [int(x) for x in more]
                t.token_ids += more
                t.mask += [0] * len(more)
                t.logprobs += [0.0] * len(more)
                if len(t.turns) >= max_turns:
                    t.end = "max_turns"
                elif len(t.context()) + params.max_tokens > self.info.max_model_len:
                    t.end = "context"
                else:
                    submit(i, j)

    def abort(self, request_id: str, timeout_s: float = 60.0) -> Completion | None:
        """Stops a request; its Completion with the tokens generated so far (finish_reason "abort"),
        or its final one if it finished first; None for an unknown id."""
        futures = self._stop([request_id])
        return futures[0].result(timeout=timeout_s) if futures else None

    def abort_group(self, group: str, timeout_s: float = 60.0) -> list[Completion]:
        """Stops every request of a group (a generate prompt's samples: its request id or
        "g{call}-{i}"; a rollout prompt's trajectories: "r{call}-{i}"); their Completions."""
        with self._lock:
            ids = [r.id for w in self.workers for r in list(w.running.values()) + [q[2] for q in w.queue]
                   if r.group == group]
        return [f.result(timeout=timeout_s) for f in self._stop(ids)]

    def _stop(self, ids: Sequence[str]) -> list[concurrent.futures.Future]:
        """Asks requests to stop: a queued one ends at once, a running one at its replica's next call.
        Their futures (unknown ids skipped)."""
        out = []
        with self._lock:
            for rid in ids:
                for w in self.workers:
                    k = next((k for k, q in enumerate(w.queue) if q[2].id == rid), None)
                    if k is not None:  # not sent to its replica yet
                        req = w.queue.pop(k)[2]
                        heapq.heapify(w.queue)
                        self._complete(w, req, Completion(req.id, [], [], "abort"))
                        out.append(req.future)
                        break
                    if rid in w.running:
                        w.aborts.append(rid)
                        w.wake.set()
                        out.append(w.running[rid].future)
                        break
        return out

    def pause(self, mode: str = "keep", timeout_s: float = 600.0) -> None:
        """Stops admitting requests and returns once no replica holds one (see the module docstring
        for the modes). Requests submitted while paused queue until `resume`.

        Raises:
            RequestError: an unknown mode.
            TimeoutError: the replicas still hold requests after `timeout_s`.
        """
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._lock:
            self._paused = mode
            if mode == "abort":
                self._stop([r.id for w in self.workers for r in list(w.running.values()) + [q[2] for q in w.queue]])
            for w in self.workers:
                w.wake.set()
            if not self._changed.wait_for(lambda: not any(w.running for w in self.workers if w.dead is None),
                                          timeout=timeout_s):
                raise TimeoutError(f"pause({mode!r}): replicas still hold requests after {timeout_s} s")

    def resume(self) -> None:
        """Admits requests again after `pause` (the kept ones first, by the placement's priority)."""
        with self._lock:
            self._paused = None
            for w in self.workers:
                w.wake.set()

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None."""
        return self._paused

    def update_weights(self, params) -> None:
        """Every replica serves `params` from now on (see Engine.update_weights: resharded onto each
        replica's mesh; no KV, prefix or draft of the old weights reused), and `weight_version` counts
        one more. RequestError while requests are in flight or a `rollout` runs, unless paused: then
        the queued and kept requests run under the new weights after `resume`. The replicas update
        concurrently; Ray replicas get the parameters through the object store once
        (`share_weights`). A replica whose update fails is dropped (it would serve the old policy) and
        the error raised.

        Raises:
            RequestError: requests are in flight or a `rollout` runs and the service is not paused, or the
                pause has not taken effect yet.
            RuntimeError: every replica has failed.
        """
        with self._lock:
            if self._paused is None and (self._ids or self._rollouts):
                raise RequestError(f"update_weights: {len(self._ids)} requests are in flight ({self._rollouts} "
                                   f"rollouts running); pause, finish or abort them first")
            live = [w for w in self.workers if w.dead is None]
            if any(w.running for w in live):
                raise RequestError("update_weights: the pause has not taken effect yet (a replica holds requests)")
            if not live:
                raise RuntimeError("update_weights: every replica has failed")
            shared = {}  # per replica type: what its update_weights takes (a Ray object ref: put once)
            for w in live:
                share = getattr(w.replica, "share_weights", None)
                if share is not None and type(w.replica) not in shared:
                    shared[type(w.replica)] = share(params)
            with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
                futures = {w: pool.submit(w.replica.update_weights, shared.get(type(w.replica), params)) for w in live}
            errors = {w: f.exception() for w, f in futures.items() if f.exception() is not None}
            self.placement.reset()
            self.weight_version += len(errors) < len(live)  # a new version where any replica took it
            if errors and len(errors) < len(live):
                for w, e in errors.items():
                    self._drop(w, f"update_weights failed: {type(e).__name__}: {e}")
            if errors:
                raise next(iter(errors.values()))

    def stats(self) -> dict:
        """The service's counters and each live replica's engine stats (steps, speculative steps,
        accepted draft tokens, prefix-cache hits, ...)."""
        with self._lock:
            out = dict(self.counts, in_flight=len(self._ids), placement=self.placement.name)
            workers = list(self.workers)
        out["replicas"] = [dict(w.replica.stats(), queued=len(w.queue)) if w.dead is None else {"dead": w.dead}
                           for w in workers]
        return out

    def close(self) -> None:
        """Stops the workers and the replicas (Ray actors are killed); requests still in flight fail
        with RuntimeError."""
        with self._lock:
            self._closed = True
            for w in self.workers:
                w.wake.set()
        for w in self.workers:
            w.thread.join(timeout=60)
        with self._lock:
            self._fail([r for w in self.workers for r in list(w.running.values()) + [q[2] for q in w.queue]],
                       "the rollout service closed")
        for w in self.workers:
            close = getattr(w.replica, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ------------------------------------------------------------------------------------
    def _check_prompts(self, prompts, params: SamplingParams, n: int) -> list[tuple[int, ...]]:
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RequestError(f"n must be an integer >= 1, got {n!r}")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.info.vocab_size)
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str) or not hasattr(p, "__len__"):
                raise RequestError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}")
            if len(p) == 0:
                raise RequestError(f"prompts[{i}] is empty")
            for k, t in enumerate(p):
                if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                    raise RequestError(f"prompts[{i}][{k}] is {t!r}, not an integer token id")
                if not 0 <= int(t) < self.info.vocab_size:
                    raise RequestError(f"prompts[{i}][{k}] is {int(t)}, outside the vocabulary "
                                       f"[0, {self.info.vocab_size})")
            if len(p) + params.max_tokens > self.info.max_model_len:
                raise RequestError(f"prompts[{i}] ({len(p)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                   f"replicas' context limit of {self.info.max_model_len} tokens")
            out.append(tuple(int(t) for t in p))
        return out

    def _request(self, rid: str, prompt: tuple[int, ...], params: SamplingParams, salt: str | None, traj: str,
                 turn: int, key: tuple[int, int, int], group: str) -> _Req:
        """key: (call, prompt index, sample index); a caller's seed leaves the call out (same seed, same
        tokens, whatever ran before)."""
        base = ("params", params.seed, *key[1:]) if params.seed is not None else ("service", self.seed, *key)
        seeded = dataclasses.replace(params, seed=_seed(*base) + turn)
        return _Req(rid, prompt, seeded, salt, PlacementRequest(prompt, traj, turn, next(self._order)), group)

    def _submit(self, reqs: list[_Req]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the rollout service is closed")
            dup = [r.id for r in reqs if r.id in self._ids]
            if dup or len({r.id for r in reqs}) < len(reqs):
                raise RequestError(f"request ids already in flight or repeated: {dup or [r.id for r in reqs][:3]}")
            for r in reqs:
                self._ids.add(r.id)
                self.counts["requests"] += 1
                self._place(r)

    def _place(self, req: _Req) -> None:
        if all(w.dead is not None for w in self.workers):
            self._complete(None, req, Completion(req.id, [], [], "error", error="every replica has failed"))
            return
        w = self.workers[self.placement.choose(req.place, [w.load() if w.dead is None else None
                                                           for w in self.workers])]
        heapq.heappush(w.queue, (self.placement.priority(req.place), req.place.arrival, req))
        self.placement.computed(w.index, req.prompt)  # its prompt's KV will be there
        w.wake.set()

    def _complete(self, w: _Worker | None, req: _Req, c: Completion) -> None:
        """Resolves `req` with `c`, its tokens since it was last sent, after the ones it made before."""
        if req.future.done():
            return
        c.replica = w.index if w is not None else -1
        self._ids.discard(req.id)
        self.counts["completed"] += 1
        self.counts["aborted"] += c.finish_reason == "abort"
        self.counts["generated_tokens"] += len(c.token_ids)
        self.counts["prompt_tokens"] += len(req.prompt)
        self.counts["cached_tokens"] += c.cached_tokens
        if c.token_ids and w is not None:
            self.placement.computed(w.index, req.prompt + tuple(c.token_ids))
        ids, lps, vers = req.done
        c.weight_versions = list(vers) + [req.version] * len(c.token_ids)
        c.token_ids, c.logprobs = list(ids) + c.token_ids, list(lps) + c.logprobs
        req.future.set_result(c)

    def _fail(self, reqs: list[_Req], why: str) -> None:
        for r in reqs:
            self._ids.discard(r.id)
            if not r.future.done():
                r.future.set_exception(RuntimeError(why))

    # ---- the worker threads --------------------------------------------------------------------------
    def _run(self, w: _Worker) -> None:
        while True:
            with self._lock:
                if self._closed or w.dead is not None:
                    return
                aborts, w.aborts = w.aborts, []
                adds = []
                while (self._paused is None and len(w.running) < w.info.capacity
                       and (w.queue or (self.placement.steal and self._steal(w)))):
                    req = heapq.heappop(w.queue)[2]
                    req.version = self.weight_version
                    w.running[req.id] = req
                    adds.append(req)
                if self.placement.steal and self._paused is None and w.queue:
                    for x in self.workers:  # requests wait for a slot here: an idle replica takes them now
                        if x is not w:
                            x.wake.set()
                # pause("keep"): off the replica, back in the queue with what they generated
                keep = [rid for rid in w.running if rid not in aborts] if self._paused == "keep" else []
                busy = bool(w.running) and not keep
                # the workload-aware switch: requests waiting for a slot anywhere mean the replicas are
                # saturated, and drafts would only add work; otherwise each engine's policy decides per step
                speculate = not any(x.queue for x in self.workers if x.dead is None)
                w.wake.clear()
            done, failure = [], None
            kept = []
            try:
                if aborts:
                    done += w.replica.abort(aborts)
                if keep:
                    kept = w.replica.abort(keep)
                if adds:
                    done += w.replica.add([(r.id, r.prompt, r.params, r.salt) for r in adds])
                if busy:
                    done += w.replica.step(self.steps_per_call, speculate)
            except Exception as e:  # noqa: BLE001 - the replica is gone: place its requests elsewhere
                logging.exception("rollout replica %d failed", w.index)
                failure = f"{type(e).__name__}: {e}"
            with self._lock:
                for c in done:
                    req = w.running.pop(c.request_id, None)
                    if req is not None:
                        self._complete(w, req, c)
                for c in kept:
                    req = w.running.pop(c.request_id, None)
                    if req is None:
                        continue
                    if req.continue_after(c):
                        heapq.heappush(w.queue, (self.placement.priority(req.place), req.place.arrival, req))
                    else:  # its budget was spent when it was taken off
                        self._complete(w, req, Completion(req.id, [], [], "length"))
                self._changed.notify_all()
                if failure is not None:
                    self._drop(w, failure, aborted=aborts)
                    return
            if not busy:
                w.wake.wait(1.0)

    def _steal(self, w: _Worker) -> bool:
        """An idle slot of `w` takes the most urgent waiting request of the most loaded other replica
        (its cached prefix there is lost, but a slot left idle while requests wait costs more)."""
        others = [x for x in self.workers  # only requests that wait because their replica is full
                  if x is not w and x.dead is None and x.queue and len(x.running) >= x.info.capacity]
        if not others:
            return False
        victim = max(others, key=lambda x: (x.load().share, -x.index))
        item = heapq.heappop(victim.queue)
        heapq.heappush(w.queue, item)
        self.counts["stolen"] += 1
        self.placement.computed(w.index, item[2].prompt)
        return True

    def _drop(self, w: _Worker, why: str, aborted: Sequence[str] = ()) -> None:
        """Takes a failed replica out: its aborted requests end as aborts, the others go elsewhere
        (or end with "error" once they have outlived max_replacements replicas)."""
        with self._lock:
            w.dead = why
            orphans = list(w.running.values()) + [q[2] for q in w.queue]
            gone = set(aborted) | set(w.aborts)
            w.running.clear()
            w.queue.clear()
            w.aborts.clear()
            for req in orphans:
                if req.id in gone:
                    self._complete(w, req, Completion(req.id, [], [], "abort"))
                elif req.replaced >= self.max_replacements:
                    self._complete(w, req, Completion(req.id, [], [], "error", error=f"{req.replaced + 1} replicas "
                                                      f"failed under this request; the last: {why}"))
                else:
                    req.replaced += 1
                    self.counts["replaced"] += 1
                    self._place(req)
            self._changed.notify_all()  # a pause waits for no replica to hold a request
