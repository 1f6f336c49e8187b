"""A rollout replica: one engine on one mesh, behind a small call interface that works the same in
process and as a Ray actor (rollout/ray_replicas.py), so the service never knows which it drives.

Every call takes and returns plain Python values (token lists, floats, strings), so a Ray actor
sends nothing but those; parameters for `update_weights` are any pytree `models.with_params` takes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from talaria_jax.engine.engine import Engine, EngineConfig, RequestOutput, StepError
from talaria_jax.engine.sampling import SamplingParams

__all__ = ["Completion", "Partial", "Replica", "ReplicaSpec", "ReplicaInfo"]


@dataclasses.dataclass
class Completion:
    """One finished (or aborted) generation: the sampled ids, the model's logprob of each (the raw
    log-softmax at temperature 1, which is what a trainer recomputes), and why it ended ("stop",
    "length", "abort"). `cached_tokens`: prompt tokens the replica reused instead of prefilling.
    `weight_versions`: the service's weight version that produced each token (`update_weights`
    counts them from 0), so a trainer knows which tokens came from which policy."""
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int = 0
    replica: int = -1
    error: str | None = None  # set instead of tokens when the replica refused the request
    weight_versions: list[int] = dataclasses.field(default_factory=list)

    @staticmethod
    def of(out: RequestOutput) -> Completion:
        return Completion(out.request_id, list(out.token_ids), [float(x) for x in out.logprobs],
                          out.finish_reason or "abort", out.cached_tokens)


@dataclasses.dataclass
class Partial:
    """A rollout handed back unfinished (`RolloutService.generate_until`), to resume in a later call:
    its prompt, its sampling params (max_tokens: the whole budget) and what it generated so far, with
    the weight version of each token. `finish_reason` is set when it had in fact finished (it
    beat the cut): resuming it returns it as is."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    group: str = ""
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What the service needs to know of a replica to validate and place requests."""
    model: str
    vocab_size: int
    max_model_len: int
    capacity: int  # sequences at once (EngineConfig.max_seqs)
    page_size: int
    num_pages: int


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """How to build a replica where it runs (in this process, or in a Ray actor's): the model by
    name or path (`load_model`), which of the process's devices form its mesh, and the engine."""
    model: str = "tiny-dense"
    devices: tuple[int, ...] | None = None  # indices into jax.devices(); None: all
    dtype: str | None = None
    seed: int = 0  # random weights only (a config name)
    engine: EngineConfig = EngineConfig(prefix_cache=True)
    compilation_cache: str | None = "off"  # a folder, None for the default, "off"

    def build(self) -> Replica:
        """Loads the model onto `devices` (all of this process's when None) and builds its engine.

        Raises:
            ValueError: `devices` names devices this process does not have.
        """
        import jax

        from talaria_jax.engine import enable_compilation_cache
        from talaria_jax.sharding import make_mesh
        from talaria_jax.weights import load_model

        if self.compilation_cache != "off":
            enable_compilation_cache(self.compilation_cache)
        devices = jax.devices()
        if self.devices is not None:
            if max(self.devices, default=-1) >= len(devices) or min(self.devices, default=0) < 0:
                raise ValueError(f"ReplicaSpec.devices {self.devices}: this process has {len(devices)} devices")
            devices = [devices[i] for i in self.devices]
        lm = load_model(self.model, make_mesh(devices), dtype=self.dtype, seed=self.seed)
        return Replica(Engine(lm.model, self.engine, tokenizer=lm.tokenizer))


class Replica:
    """An engine driven one call at a time by its owner (the service's worker thread for it)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._failures = 0

    def info(self) -> ReplicaInfo:
        e = self.engine
        return ReplicaInfo(e.model.cfg.name, e.model.cfg.vocab_size, min(e.config.max_model_len, e.pool_spec.num_slots),
                           e.config.max_seqs, e.page_size, e.allocator.num_pages)

    def add(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams, str | None]]) -> list[Completion]:
        """Queues (request_id, prompt, params, cache_salt) requests; returns a Completion with `error`
        for each one the engine refused (the others are queued)."""
        refused = []
        for rid, prompt, params, salt in requests:
            try:
                self.engine.add_request(list(prompt), params, rid, cache_salt=salt)
            except ValueError as e:  # RequestError: named field and limit
                refused.append(Completion(rid, [], [], "error", error=str(e)))
        return refused

    max_step_failures = 3  # StepErrors in a row before the replica counts as failed

    def step(self, max_steps: int = 1, speculate: bool = True) -> list[Completion]:
        """Up to `max_steps` engine steps, fewer once a request finishes; the finished ones. A failed
        step (StepError: the engine requeued its requests) is retried, up to max_step_failures in a row.
        `speculate` False: no draft is verified in these steps (the service's call under load)."""
        self.engine.speculate = speculate
        done = []
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                break
            try:
                outs = self.engine.step()
            except StepError:
                self._failures += 1
                if self._failures >= self.max_step_failures:
                    raise
                continue
            self._failures = 0
            done += [Completion.of(o) for o in outs if o.finished]
            if done:
                break
        return done

    def abort(self, request_ids: Sequence[str]) -> list[Completion]:
        """Stops requests in flight; their partial outputs (unknown or finished ids are skipped)."""
        outs = [self.engine.abort(rid) for rid in request_ids]
        return [Completion.of(o) for o in outs if o is not None]

    def update_weights(self, params) -> None:
        self.engine.update_weights(params)

    def stats(self) -> dict:
        s = dataclasses.asdict(self.engine.stats)
        s["running"], s["waiting"] = len(self.engine.running), len(self.engine.waiting)
        return s
