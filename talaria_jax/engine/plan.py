"""The plain data between the engine's three calls: the scheduler's `StepPlan` (what to run), the
runner's `StepResult` (what it drew), nothing else.

A step is `plan = scheduler.schedule(drafts)`, `result = runner.execute(plan)`,
`scheduler.update(plan, result)`. A plan is frozen and names everything the runner needs: each
chunk's token ids, RoPE positions, page table, draft tree and sampling row. The runner reads no
request and no queue, so scheduling is tested against a fake runner that returns hand-built results.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec.suffix import Draft
from talaria_jax.kvcache.host_tier import HostKV


@dataclasses.dataclass(frozen=True)
class Sample:
    """A chunk that ends its request's known tokens draws the next one: with these params and seed,
    at output index `step` (the seeded key of a draw depends on it, not on the batch), among the
    tokens its grammar allows."""
    params: SamplingParams
    seed: int
    step: int
    # a grammar's token masks (engine/grammar.py), i32 [1 + draft nodes, W]: the draw after the
    # chunk's last token, then one per draft node (a draft is then a chain); None: unconstrained
    allowed: np.ndarray | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Restore:
    """A host copy to scatter into the chunk's pages before the step reads them; its first `skip`
    pages were on device already (a prefix-cache hit), so they are not copied in."""
    kv: HostKV
    skip: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's part of a step: the tokens at positions start, start + 1, ... (its own known
    tokens, then the draft's nodes in depth-first order, which sit at positions start + len(tokens) + j
    in the pages and take RoPE positions of their depth)."""
    request_id: str
    start: int                   # tokens of the request whose KV is in its pages already
    tokens: tuple[int, ...]      # the request's own tokens this step computes
    pages: tuple[int, ...]       # the request's page table
    draft: Draft | None = None   # draft nodes verified after the last token
    sample: Sample | None = None  # set when the chunk ends the known tokens
    restore: Restore | None = None

    @property
    def num_tokens(self) -> int:
        """Query tokens the chunk brings: its own and its draft's."""
        return len(self.tokens) + (len(self.draft) if self.draft is not None else 0)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step runs, in page-table row order. `speculative`: the step verifies drafts (every
    sampling chunk is then a row of the verifier). Empty when nothing can run."""
    chunks: tuple[Chunk, ...] = ()
    prefix_hit_tokens: int = 0   # tokens the step's admissions found in the prefix cache
    prefix_query_tokens: int = 0  # tokens they looked up there
    preempted: tuple[str, ...] = ()  # requests sent back to the queue to free pages

    @property
    def speculative(self) -> bool:
        return any(c.draft is not None for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def restores(self) -> tuple[Chunk, ...]:
        return tuple(c for c in self.chunks if c.restore is not None)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclasses.dataclass(frozen=True)
class Drawn:
    """What a sampling chunk drew: the tokens emitted (accepted drafts, then the correction or bonus
    token; one without drafts), their logprobs and top logprobs, and `kept`: how many of the
    accepted draft tokens hold their KV in place (a tree's side branch is recomputed next step)."""
    tokens: np.ndarray        # i32 [n]
    logprobs: np.ndarray      # f32 [n]
    top_ids: np.ndarray       # i32 [n, N]
    top_logprobs: np.ndarray  # f32 [n, N]
    kept: int = 0


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The runner's answer to a plan: what each sampling chunk drew, by request id; the seconds the
    step took and its padded token count (what the speculation policy learns its cost curve from)."""
    drawn: dict[str, Drawn]
    seconds: float = 0.0
    padded_tokens: int = 0
