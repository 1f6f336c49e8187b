"""The engine's scheduler half: queues, pages, preemption, the chunked-prefill budget, prefix-cache
and host-copy admission, the draft budget; it decides and never touches an array.

`schedule(drafts)` packs, oldest first, one decode token per running request (with its draft, where
the budget and free pages leave room) and prefill chunks under the token budget, then admits waiting
requests while pages and sequence slots last, and returns a frozen `StepPlan`. When a running request
needs a page and none is free, cached pages are evicted first, then the most recently admitted
request is preempted by recompute: its pages are freed and it goes back to the head of the queue
with the tokens it has generated, so nothing is lost or duplicated (seeded sampling keys on the
output index, so even a sampled request resumes with the same tokens). `update(plan, result)`
applies what the runner drew: tokens, stops, the pages of rejected drafts.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
from absl import logging

from talaria_jax.engine.grammar import Constraint
from talaria_jax.engine.plan import Chunk, Restore, Sample, StepPlan, StepResult
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec.suffix import Draft, SuffixDrafter
from talaria_jax.kvcache.allocator import OutOfPages, PageAllocator, SequencePages
from talaria_jax.kvcache.host_tier import HostKV
from talaria_jax.kvcache.prefix import PrefixCache, evict


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    finished: int = 0  # stopped by a stop token or a length limit
    aborted: int = 0
    step_failures: int = 0
    restored_tokens: int = 0  # prompt-prefix tokens copied back from host memory instead of prefilled
    offloaded_tokens: int = 0  # tokens copied to host memory: of finished keep_kv requests, and of preempted ones
    offload_failures: int = 0  # host copies that failed (a keep_kv request finished without its KV, or a preempted one recomputes)
    prefix_query_tokens: int = 0  # tokens admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose KV came from cached pages instead of a prefill
    prefix_evicted_pages: int = 0  # cached pages freed because pages ran out
    spec_steps: int = 0  # steps that verified drafts
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted (each saves a step of its sequence)
    grammar_masks: int = 0  # grammar token masks computed (one per constrained draw and draft node)
    grammar_mask_s: float = 0.0  # host seconds spent on them
    grammar_errors: int = 0  # constrained requests ended because their grammar failed (see the log)


@dataclasses.dataclass(eq=False)  # identity: `in` and `remove` on queues must not compare fields
class Request:
    """A request's scheduling state (the engine's own; callers see `RequestOutput`s)."""
    id: str | None
    prompt: tuple[int, ...]
    params: SamplingParams
    seq: SequencePages
    seed: int = -1
    arrival: int = -1
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    keep_kv: bool = False  # offload the KV to host memory when the request finishes
    restore: HostKV | None = None  # KV of a prompt prefix to restore from host memory at admission
    cached: int = 0  # tokens the last admission found cached (prefix cache) or restored from host memory
    kv: HostKV | None = None  # the offloaded KV, once finished
    cache_salt: str | None = None  # prefix-cache tenant: only requests with the same salt share KV
    session: str | None = None  # tags the keep_kv host copy (HostTier.protect and bytes_by_session)
    owner: str = "step"  # who reports it: "step" (add_request), "generate" or "stream"
    reported: int = 0  # output tokens step() has handed out (owner "step")
    constraint: Constraint | None = None  # params.grammar's state, at the end of `output`
    grammar_done: bool = False  # finished ("stop") because the grammar was complete: the last token is text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def known_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output) if self.output else self.prompt

    def token(self, i: int) -> int:
        return self.prompt[i] if i < len(self.prompt) else self.output[i - len(self.prompt)]


@dataclasses.dataclass(frozen=True)
class Applied:
    """What `EngineScheduler.update` did with a step: the requests that gained a token, and the
    prompt tokens prefilled, tokens decoded and prefix tokens restored from host memory."""
    gained: list[Request]
    prefill_tokens: int = 0
    decode_tokens: int = 0
    restored_tokens: int = 0


class HostCopies(Protocol):
    """What the scheduler asks of host memory: whether a copy can still be restored, and a copy of a
    finished request's KV (the engine's host tier over its KV pool)."""

    def usable(self, kv: HostKV) -> bool: ...

    def offload(self, pages: list[int], tokens: tuple[int, ...], session: str | None) -> HostKV: ...


@dataclasses.dataclass(frozen=True)
class Limits:
    """The scheduler's share of EngineConfig."""
    max_seqs: int
    max_tokens_per_step: int
    max_model_len: int
    seed: int = 0


class EngineScheduler:
    """Queues and pages of one model's requests. `prefix_key(salt)` keys the prefix cache (model,
    weights, tenant); `caches()` lists every prefix cache on the KV arena, which a shortage may evict
    from; `host` copies finished keep_kv requests out (see HostCopies)."""

    def __init__(self, limits: Limits, allocator: PageAllocator, page_size: int, *,
                 prefix_cache: PrefixCache | None = None, host: HostCopies | None = None,
                 drafter: SuffixDrafter | None = None, eos_ids: tuple[int, ...] = (),
                 prefix_key: Callable[[str | None], tuple] = lambda salt: (salt,),
                 caches: Callable[[], list[PrefixCache]] | None = None):
        self.limits, self.allocator, self.page_size = limits, allocator, page_size
        self.prefix_cache, self.host, self.drafter, self.eos_ids = prefix_cache, host, drafter, tuple(eos_ids)
        self.prefix_key = prefix_key
        self.caches = caches or (lambda: [prefix_cache] if prefix_cache is not None else [])
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # in flight; finished ones leave at once
        self.stats = EngineStats()
        self._arrivals = itertools.count()

    # ---- queries ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list[Request]:
        """Running requests whose next step decodes one token (a draft can ride along)."""
        return [r for r in self.running if r.num_tokens - r.num_computed == 1]

    # ---- requests ---------------------------------------------------------------------------------
    def enqueue(self, req: Request) -> str:
        """Queues a checked request: its arrival, id (unique among those in flight) and default seed."""
        req.arrival = next(self._arrivals)
        rid = req.id
        while rid is None or rid in self.requests:
            rid = f"req-{req.arrival}" if rid is None else f"{rid}+"
        req.id = rid
        req.seed = req.params.seed if req.params.seed is not None else stable_seed(self.limits.seed, req.arrival)
        self.requests[req.id] = req
        self.waiting.append(req)
        if self.drafter is not None:
            self.drafter.start(req.id, req.prompt, tenant=req.cache_salt)
        return req.id

    def abort(self, request_id: str) -> Request | None:
        """Stops a request in flight and frees its pages; None if there is none by that id."""
        req = self.requests.get(request_id)
        if req is None or req.finish_reason:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return req

    def requeue_all(self) -> None:
        """The KV pool was lost (a failed step consumed it): every running request goes back to the
        head of the queue, in order, to be recomputed."""
        for req in reversed(self.running[:]):
            self._preempt(req)

    def drop_restores(self, plan: StepPlan) -> None:
        """A step that may have failed mid-restore: those prefixes are recomputed, not restored again."""
        for c in plan.restores:
            self.requests[c.request_id].restore = None

    # ---- schedule ---------------------------------------------------------------------------------
    def schedule(self, drafts: dict[str, Draft] | None = None) -> StepPlan:
        """The next step's plan. A draft takes only budget that every later running request's token
        leaves, and pages that are free: it is dropped rather than preempt anyone."""
        drafts = drafts or {}
        budget = self.limits.max_tokens_per_step
        picked: list[tuple[Request, int, Draft | None, Restore | None]] = []
        preempted: list[str] = []
        running = list(self.running)
        for i, req in enumerate(running):
            if req not in self.running or budget == 0:
                continue  # preempted below as a victim, or no budget left
            n = min(req.num_tokens - req.num_computed, budget)
            draft = drafts.get(req.id)
            if draft is not None and req.constraint is not None:  # a chain, as far as the grammar allows it
                chain = int(np.argmin(np.r_[draft.parents == np.arange(-1, len(draft) - 1), False]))
                draft = draft.first(req.constraint.valid_prefix(draft.tokens[:chain]))
            if draft is not None:
                draft = draft.first(budget - n - (len(running) - i - 1)) or None
            while True:
                extra = len(draft) if draft is not None else 0
                try:
                    req.seq.grow(self.allocator, req.num_computed + n + extra)
                    break
                except OutOfPages:
                    if draft is not None:
                        draft = None
                        continue
                    if self._evict_cached(req.seq.pages_needed(req.num_computed + n)):
                        continue  # cached pages made room: nothing needs preempting
                    scheduled = {id(r) for r, *_ in picked}
                    victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                    self._preempt(victim)
                    preempted.append(victim.id)
                    if victim is req:
                        break
            if req in self.running:
                picked.append((req, n, draft, None))
                budget -= n + extra
        hit_tokens = query_tokens = 0
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_seqs:
            req = self.waiting[0]
            if req.restore is not None and (self.host is None or not self.host.usable(req.restore)):
                req.restore = None  # evicted (host budget) since add_request: the prefix is recomputed
            hit = 0
            if self.prefix_cache is not None:
                # the last known token is always computed: its logits give the next token
                req.seq.pages = self.prefix_cache.match(self.prefix_key(req.cache_salt), req.known_tokens(),
                                                        req.num_tokens - 1)
                hit = len(req.seq.pages) * self.page_size
            # a host copy fills in what the device cache lacks: its pages past the hit are restored
            restore = req.restore is not None and req.restore.num_tokens > hit
            cached = req.restore.num_tokens if restore else hit
            n = min(req.num_tokens - cached, budget)
            try:
                while True:
                    try:
                        req.seq.grow(self.allocator, cached + n)
                        break
                    except OutOfPages:
                        if not self._evict_cached(req.seq.pages_needed(cached + n)):
                            raise
            except OutOfPages:
                req.seq.release(self.allocator)  # the matched pages go back; matched again next step
                break
            self.waiting.popleft()
            self.running.append(req)
            req.num_computed = cached
            if not req.output:  # (a paused request's resumption finds its own output cached: not the prompt's)
                req.cached = min(cached, len(req.prompt))
            if self.prefix_cache is not None:
                query_tokens += req.num_tokens - 1
                hit_tokens += hit
            picked.append((req, n, None, Restore(req.restore, hit // self.page_size) if restore else None))
            budget -= n
        self.stats.prefix_query_tokens += query_tokens
        self.stats.prefix_hit_tokens += hit_tokens
        return StepPlan(tuple(self._chunk(*p) for p in picked), hit_tokens, query_tokens, tuple(preempted))

    def _chunk(self, req: Request, q: int, draft: Draft | None, restore: Restore | None) -> Chunk:
        """The chunk of `q` of the request's own tokens (1 beside a draft) from num_computed on."""
        start = req.num_computed
        first = req.seq.pages[start // self.page_size]
        if self.prefix_cache is not None and self.allocator.refcount(first) != 1:
            # the pages written from here on must be this sequence's own: cached pages are shared
            raise AssertionError(f"request {req.id} would write into shared page {first}")
        if start + q <= len(req.prompt):
            tokens = req.prompt[start:start + q]
        else:
            tokens = tuple(req.token(p) for p in range(start, start + q))
        ends = start + q == req.num_tokens  # this chunk ends the known tokens: it samples the next one
        sample = None
        if ends:
            allowed = None
            if req.constraint is not None:
                t0 = time.perf_counter()
                allowed = req.constraint.chain(draft.tokens if draft is not None else ())
                self.stats.grammar_mask_s += time.perf_counter() - t0
                self.stats.grammar_masks += len(allowed)
            sample = Sample(req.params, req.seed, len(req.output), allowed)
        return Chunk(req.id, start, tokens, tuple(req.seq.pages), draft, sample, restore)

    def preempt_running(self, to_host: bool) -> list[Request]:
        """Sends every running request back to the head of the waiting queue, in its order, freeing its
        pages; the requests it sent. Nothing is lost: a request keeps its output and continues from the
        same position and seed when admitted again. With `to_host` (and a host tier) its computed KV is
        copied to host memory first and restored then (its full pages also stay in the prefix cache,
        if any); else, or where the copy fails, that KV is recomputed."""
        sent = list(self.running)
        for req in reversed(sent):
            if to_host and self.host is not None and req.num_computed:
                tokens = req.known_tokens()[:req.num_computed]  # the last token has no KV yet
                try:
                    req.restore = self.host.offload(req.seq.pages, tokens, req.session)
                    self.stats.offloaded_tokens += len(tokens)
                except Exception:  # e.g. host memory exhausted: recomputed at admission instead
                    self.stats.offload_failures += 1
            if self.prefix_cache is not None and req.num_computed:
                self.prefix_cache.insert(self.prefix_key(req.cache_salt), req.known_tokens()[:req.num_computed],
                                         req.seq.pages)
            self._preempt(req)
        return sent

    def _preempt(self, req: Request) -> None:
        req.seq.release(self.allocator)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _evict_cached(self, need: int) -> bool:
        """Frees cached pages so `need` can be allocated (from every prefix cache on the arena, in the
        caches' eviction order); whether any were freed."""
        short = need - self.allocator.num_free
        caches = self.caches()
        if not caches or short <= 0:
            return False
        freed = evict(caches, short)
        self.stats.prefix_evicted_pages += freed
        return freed > 0

    # ---- update -----------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> Applied:
        """Applies a step the runner ran: computed tokens, drawn tokens, stops, the pages of rejected
        drafts. Returns the requests that gained a token (finished ones included, in plan order) and
        what the step computed."""
        st = self.stats
        st.steps += 1
        st.spec_steps += plan.speculative
        restored = sum(c.restore.kv.num_tokens - c.restore.skip * self.page_size for c in plan.restores)
        st.restored_tokens += restored
        prefill0, decode0 = st.prefill_tokens, st.decode_tokens
        gained = []
        for c in plan.chunks:
            req = self.requests.get(c.request_id)
            if req is None:
                continue
            q = len(c.tokens)
            if req.num_computed + q > len(req.prompt):
                st.decode_tokens += min(q, req.num_computed + q - len(req.prompt))
            st.prefill_tokens += max(0, min(req.num_computed + q, len(req.prompt)) - req.num_computed)
            req.num_computed += q
            if c.sample is None:
                continue
            drawn = result.drawn[c.request_id]
            req.num_computed += drawn.kept
            if c.draft is not None:
                st.draft_tokens += len(c.draft)
                st.accepted_tokens += len(drawn.tokens) - 1
            toks = drawn.tokens.tolist()
            for j, tok in enumerate(toks):
                if self._append(req, tok, float(drawn.logprobs[j]), drawn.top_ids[j], drawn.top_logprobs[j],
                                last=j == len(toks) - 1):
                    break
            if c.draft is not None and not req.finish_reason:  # the rejected drafts' pages go back
                req.seq.truncate(self.allocator, req.num_computed)
            gained.append(req)
        return Applied(gained, st.prefill_tokens - prefill0, st.decode_tokens - decode0, restored)

    def _append(self, req: Request, tok: int, logprob: float, top_ids, top_lps, last: bool) -> bool:
        """Appends one drawn token of a step's `last` one; finishes the request at a stop token or a
        length limit (True)."""
        req.output.append(tok)
        req.logprobs.append(logprob)
        if req.params.logprobs:
            k = req.params.logprobs
            req.top_logprobs.append({int(i): float(l) for i, l in zip(top_ids[:k], top_lps[:k])})
        if self.drafter is not None:
            self.drafter.extend(req.id, (tok,))
        p = req.params
        stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids)
        reason = "stop" if stop_token else None
        if req.constraint is not None and not stop_token:  # before the length check: a grammar done on the
            if not req.constraint.accept(tok):  # last allowed token is a stop; drawn from its mask, a refusal
                self.stats.grammar_errors += 1  # is the grammar's own failure
                logging.warning("request %s: the grammar refused token %d it allowed (%s); the request ends",
                                req.id, tok, req.constraint.error)
                reason = "stop"
            elif req.constraint.finished:
                reason = "stop"  # the grammar is complete: nothing may follow
            req.grammar_done = reason is not None
        if reason is None and (len(req.output) >= p.max_tokens or req.num_tokens >= self.limits.max_model_len):
            reason = "length"
        if reason or last:  # the last token drawn has no KV yet; accepted drafts before it keep theirs
            req.num_computed = min(req.num_computed, req.num_tokens - 1)
        if reason:
            self._finish(req, reason)
        return bool(reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.keep_kv and reason != "abort" and req.num_computed and self.host is not None:
            tokens = req.known_tokens()[:req.num_computed]  # the last token has no KV yet
            try:
                req.kv = self.host.offload(req.seq.pages, tokens, req.session)
                self.stats.offloaded_tokens += len(tokens)
            except Exception:  # e.g. host memory exhausted: the request still finishes, without its KV
                self.stats.offload_failures += 1
        if self.prefix_cache is not None and req.num_computed:  # its full computed pages stay for later requests
            self.prefix_cache.insert(self.prefix_key(req.cache_salt), req.known_tokens()[:req.num_computed],
                                     req.seq.pages)
        req.seq.release(self.allocator)
        if req in self.running:
            self.running.remove(req)
        if self.drafter is not None:
            self.drafter.finish(req.id)
        if reason == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        del self.requests[req.id]


def stable_seed(engine_seed: int, arrival: int) -> int:
    """A per-request seed from the engine seed and the arrival index, the same in every process
    (Python's hash() of strings is salted per process)."""
    digest = hashlib.blake2b(f"{engine_seed}:{arrival}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)

