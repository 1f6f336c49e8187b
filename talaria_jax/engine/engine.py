"""The engine loop: continuous batching over the runner, with chunked prefill mixed into decode.

Each step packs, oldest first, one decode token per running request and prefill chunks under a
token budget, then admits waiting requests while pages and sequence slots last. When a running
request needs a page and none is free, the most recently admitted request is preempted by
recompute: its pages are freed and it goes back to the head of the queue with the tokens it has
generated, so nothing is lost or duplicated (seeded sampling keys on the output index, so even a
sampled request resumes with the same tokens).

Each request is reported to the caller that queued it: `step()` reports the requests of
`add_request`, `generate()` and `stream()` their own. Whoever steps the engine, progress of
`add_request` requests is kept until the next `step()` hands it out, once.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import secrets
import time
from collections.abc import Iterator, Sequence

import numpy as np
from absl import logging
from tqdm.auto import tqdm

from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.runner import ATTENTION, DraftBatch, Runner, attention_kind
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache.allocator import OutOfPages, SequencePages
from talaria_jax.kvcache.host_tier import HostKV, HostKVEvicted, HostTier
from talaria_jax.kvcache.pool import KVArena
from talaria_jax.kvcache.prefix import PrefixCache, evict
from talaria_jax.models.model import ShardedModel, with_params
from talaria_jax.rollout.policy import SpecPolicy
from talaria_jax.rollout.suffix import Draft, SpecConfig, SuffixDrafter
from talaria_jax.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestError", "RequestOutput", "StepError"]


class StepError(RuntimeError):
    """A step failed on the device. The pool was reallocated and every running request requeued
    for recompute, so no request is lost; the step can be retried."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None          # or kv_memory_bytes_per_device; default: room for max_seqs full sequences
    kv_memory_bytes_per_device: int | None = None
    max_seqs: int = 16
    max_tokens_per_step: int = 256       # token budget per step (prefill chunk size bound)
    max_model_len: int = 2048
    pages_per_block: int = 4            # attention block width in pages (4 x 16 tokens was fastest on CPU)
    query_tile: int = 16                # prefill tokens of one sequence that share each page-block read
    seed: int = 0                         # seeds requests that carry no seed of their own (stable across runs)
    # Compile every step shape and host-tier copy at construction (`Engine.warmup`), so serving never
    # stalls on a compile; with `enable_compilation_cache` a later process loads them instead.
    warmup: bool = True
    # Automatic prefix caching: finished sequences leave their full pages in a radix tree over token
    # ids (per model, weights and `cache_salt`), and a new request reuses the longest cached prefix
    # instead of prefilling it. Off by default: cached pages stay allocated after their requests
    # finish (evicted only when pages run out), which changes what free-page counts and preemption
    # tests expect; serving turns it on where sessions return (talaria_jax.instance does). A request's
    # `restore` then tops up a hit: only the host copy's pages past the cached ones are copied in.
    prefix_cache: bool = False
    # Speculative decoding with suffix-tree drafts (talaria_jax.rollout): drafts from the request's own
    # text and from earlier and in-flight responses of the same cache_salt, verified losslessly in
    # the step; how many per step is chosen from the measured step-cost curve (rollout/policy.py).
    speculation: SpecConfig | None = None
    # Which ragged paged attention the step runs: "reference" (plain jnp, engine/paged_attention.py),
    # "pallas" (the kernel of engine/kernels/, interpreted off GPU: slow, for tests) or "auto" (the
    # kernel where the model's devices are GPUs and it takes the pool's page_size and head_dim).
    attention: str = "auto"

    def validate(self) -> None:
        for f in ("page_size", "max_seqs", "max_tokens_per_step", "max_model_len", "pages_per_block", "query_tile"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("warmup", "prefix_cache"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"EngineConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {', '.join(map(repr, ATTENTION))}, got "
                             f"{self.attention!r}")
        if self.num_pages is not None and self.kv_memory_bytes_per_device is not None:
            raise ValueError("EngineConfig: set num_pages or kv_memory_bytes_per_device, not both")
        if self.speculation is not None:
            if not isinstance(self.speculation, SpecConfig):
                raise ValueError(f"EngineConfig.speculation must be a SpecConfig or None, got "
                                 f"{type(self.speculation).__name__}")
            self.speculation.validate()
        if self.max_tokens_per_step < self.max_seqs:
            raise ValueError(f"EngineConfig.max_tokens_per_step ({self.max_tokens_per_step}) must be >= "
                             f"max_seqs ({self.max_seqs}) so every running sequence can decode each step")


@dataclasses.dataclass
class RequestOutput:
    """A request's state when it was reported. `text` is decoded on first access, so a step that
    reports every running request does not decode every whole output again (quadratic over a long
    generation); `prompt_token_ids` is the request's own immutable tuple, not a copy."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    new_token_ids: list[int] = dataclasses.field(default_factory=list)  # produced since the caller's last output
    text_token_ids: list[int] = dataclasses.field(default_factory=list, repr=False)  # what `text` decodes
    tokenizer: Tokenizer | None = dataclasses.field(default=None, repr=False, compare=False)
    # keep_kv requests, once finished: the KV of every token but the last, in host memory (pass it
    # as `restore` with the next turn's prompt to skip recomputing that prefix)
    kv: HostKV | None = dataclasses.field(default=None, repr=False, compare=False)
    # prompt tokens whose KV came from the prefix cache or a host restore at the request's last
    # admission instead of a prefill (vLLM's usage.prompt_tokens_details.cached_tokens)
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @functools.cached_property
    def text(self) -> str:
        return self.tokenizer.decode(self.text_token_ids) if self.tokenizer is not None else ""


@dataclasses.dataclass(eq=False)  # identity: `in` and `remove` on queues must not compare fields
class _Request:
    id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: int
    seq: SequencePages
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    keep_kv: bool = False  # offload the KV to host memory when the request finishes
    restore: HostKV | None = None  # KV of a prompt prefix to restore from host memory at admission
    restore_skip: int = 0  # leading pages of `restore` the prefix cache held already (not copied in)
    cached: int = 0  # tokens the last admission found cached (prefix cache) or restored from host memory
    kv: HostKV | None = None  # the offloaded KV, once finished
    cache_salt: str | None = None  # prefix-cache tenant: only requests with the same salt share KV
    session: str | None = None  # tags the keep_kv host copy (HostTier.protect and bytes_by_session)
    owner: str = "step"  # who reports it: "step" (add_request), "generate" or "stream"
    reported: int = 0  # output tokens step() has handed out (owner "step")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        return self.prompt[i] if i < len(self.prompt) else self.output[i - len(self.prompt)]


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
    offloaded_tokens: int = 0  # tokens of finished keep_kv requests copied to host memory
    offload_failures: int = 0  # keep_kv requests that finished without their KV (the copy failed)
    prefix_query_tokens: int = 0  # tokens admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose KV came from cached pages instead of a prefill
    prefix_evicted_pages: int = 0  # cached pages freed because pages ran out
    spec_steps: int = 0  # steps that verified drafts
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted (each saves a step of its sequence)


class Engine:
    """Continuous-batching generation over one model on one mesh."""

    def __init__(self, model: ShardedModel, config: EngineConfig = EngineConfig(), tokenizer: Tokenizer | None = None,
                 arena: KVArena | None = None):
        """Allocates the KV pool (or takes a share of `arena`) and, unless `config.warmup` is off, compiles
        everything serving runs.
        `arena`: a KV arena shared with other engines on the same mesh (`KVArena.for_models`), which
        then sizes the pool and its pages (EngineConfig.num_pages and kv_memory_bytes_per_device must be
        unset); None: the engine's own, of config.page_size tokens per page."""
        config.validate()
        if config.speculation is not None and config.speculation.tree and any(model.cfg.sliding_windows):
            raise ValueError(f"EngineConfig.speculation: tree drafts need full attention; {model.cfg.name} has "
                             f"sliding windows (use chain drafts: SpecConfig(tree=False))")
        if config.max_model_len > model.cfg.max_position:
            raise ValueError(f"EngineConfig.max_model_len ({config.max_model_len}) exceeds {model.cfg.name}'s "
                             f"max_position ({model.cfg.max_position})")
        self.model, self.config = model, config
        self.cfg = model.cfg
        self.tokenizer = tokenizer or ByteTokenizer()
        if arena is None:
            num_pages = config.num_pages
            if num_pages is None and config.kv_memory_bytes_per_device is None:
                num_pages = config.max_seqs * -(-config.max_model_len // config.page_size)
            arena = KVArena.for_models([self.cfg], model.mesh, config.page_size, num_pages=num_pages,
                                       memory_bytes_per_device=config.kv_memory_bytes_per_device)
        elif config.num_pages is not None or config.kv_memory_bytes_per_device is not None:
            raise ValueError("EngineConfig.num_pages and kv_memory_bytes_per_device must be unset with a shared "
                             "arena: the arena sizes the pool")
        elif arena.mesh != model.mesh:  # another mesh would reshard (copy) the arena at every step
            raise ValueError(f"the KV arena is on mesh {arena.mesh}, {self.cfg.name} on {model.mesh}")
        self.arena, self.pool_spec = arena, arena.spec_for(self.cfg)
        self.page_size = self.pool_spec.page_size  # tokens per page: config.page_size unless the arena is shared
        self.max_pages_per_seq = max_pages_per_seq = -(-config.max_model_len // self.page_size)
        self.allocator = arena.allocator
        self.prefix_cache = PrefixCache(self.allocator, self.page_size) if config.prefix_cache else None
        self.host_tier = HostTier(self.pool_spec, model.mesh, model=self.cfg.name, weights=model.fingerprint)
        self.runner = Runner(model, arena, self.pool_spec, max_seqs=config.max_seqs,
                             max_pages_per_seq=max_pages_per_seq, max_tokens_per_step=config.max_tokens_per_step,
                             pages_per_block=config.pages_per_block, query_tile=config.query_tile,
                             attention=attention_kind(config.attention, model.mesh, self.pool_spec))
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}  # in flight; finished ones leave at once
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        # add_request requests with progress step() has not handed out yet, in the order they made it
        self._unreported: dict[_Request, None] = {}
        spec = config.speculation
        self.drafter = SuffixDrafter(spec) if spec is not None else None
        self.draft_nodes = spec.max_spec_tokens + 1 if spec is not None else 0  # K1 of the verifying step
        self._spec_policy: SpecPolicy | None = None  # measured at the first step that could draft
        # Whether steps may verify drafts at all (with config.speculation): a caller that sees the load
        # beyond this engine turns it off (the rollout service does while requests wait for a slot).
        self.speculate = True
        if config.warmup:
            self.warmup(progress=None)
        arena.attach(self)  # last: a constructor that failed leaves nothing on the arena

    def warmup(self, progress: bool | None = None) -> None:
        """Compiles every program serving runs: each step shape (`Runner.step_shapes`), and the host
        tier's gather and scatter for every padded page count a sequence's copy can take (powers of
        two up to max_pages_per_seq, a handful), so a steady workload with offloads and restores
        compiles nothing more. Nothing in the pool changes. progress: a bar, none, or (None) one
        only on a terminal."""
        t0, steps, copies = time.perf_counter(), self.runner.compilations, self.host_tier.compilations
        self.runner.warmup(progress, self.draft_nodes)
        self.runner.kv = self.host_tier.warmup(self.runner.kv, self.max_pages_per_seq)
        logging.info("engine warm-up: %d step programs and %d host-tier programs built in %.1f s",
                     self.runner.compilations - steps, self.host_tier.compilations - copies, time.perf_counter() - t0)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, *, keep_kv: bool = False, restore: HostKV | None = None,
                    cache_salt: str | None = None, session: str | None = None) -> str:
        """Queues a request, reported by `step()`; bad input raises RequestError (SamplingError is one)
        naming the field and changes nothing. The prompt is a str, a list or tuple of int token ids, or
        a 1-D integer numpy array; a str is encoded without BOS (prepend it yourself if the model wants
        one). `keep_kv`: when the request finishes, its KV goes to host memory (`RequestOutput.kv`).
        `restore`: such a KV (of the same weights and page layout) for a prefix of `prompt`; it is
        copied back into the pool at admission instead of being recomputed, and the prompt must start
        with its tokens. `cache_salt`: the prefix-cache tenant (with `EngineConfig.prefix_cache`); only
        requests with the same salt (None is one) reuse each other's cached KV. `session` tags the keep_kv
        host copy for the host tier's per-session accounting and `protect`."""
        if not isinstance(keep_kv, (bool, np.bool_)):
            raise RequestError(f"keep_kv must be a bool, got {keep_kv!r} ({type(keep_kv).__name__})")
        for name, v in (("cache_salt", cache_salt), ("session", session)):
            if v is not None and not isinstance(v, str):
                raise RequestError(f"{name} must be a str or None, got {type(v).__name__}")
        req = self._make_request(prompt, params, request_id, restore)
        req.keep_kv, req.restore, req.cache_salt, req.session = bool(keep_kv), restore, cache_salt, session
        return self._enqueue(req)

    def check_request(self, prompt: Sequence[int] | str, params: SamplingParams) -> tuple[int, ...]:
        """The checks of `add_request` without queueing anything: the prompt's token ids, or the
        RequestError that add_request would raise."""
        return self._make_request(prompt, params, None).prompt

    def _check_restore(self, prompt: tuple[int, ...], kv: HostKV) -> None:
        if not isinstance(kv, HostKV):
            raise RequestError(f"restore must be a HostKV (RequestOutput.kv), got {type(kv).__name__}")
        try:
            self.host_tier.check(kv)
        except HostKVEvicted:
            pass  # evicted to stay within the host budget: _schedule recomputes the prefix, nothing is lost
        except ValueError as e:
            raise RequestError(f"restore: {e}") from None
        if kv.num_tokens >= len(prompt):
            raise RequestError(f"restore holds {kv.num_tokens} tokens; the prompt ({len(prompt)} tokens) must "
                               f"extend it by at least one")
        if prompt[:kv.num_tokens] != kv.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(prompt, kv.token_ids)) if a != b)
            raise RequestError(f"restore: the prompt differs from the restored prefix at token {i} "
                               f"({prompt[i]} vs {kv.token_ids[i]})")

    def _enqueue(self, req: _Request) -> str:
        req.arrival = next(self._arrivals)
        rid = req.id
        while rid is None or rid in self.requests:
            rid = f"req-{req.arrival}" if rid is None else f"{rid}+"
        req.id = rid
        req.seed = req.params.seed if req.params.seed is not None else _stable_seed(self.config.seed, req.arrival)
        self.requests[req.id] = req
        self.waiting.append(req)
        if self.drafter is not None:
            self.drafter.start(req.id, req.prompt, tenant=req.cache_salt)
        return req.id

    def _prompt_ids(self, prompt) -> list:
        """The prompt's token ids (not yet checked one by one); RequestError for any other type: bytes,
        sets, dicts and iterators are not prompts, and a number is not a prompt of one token."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise RequestError(f"prompt array must be 1-D of integers, got shape {prompt.shape} {prompt.dtype}")
            return prompt.tolist()
        hint = " (decode bytes to a str first)" if isinstance(prompt, (bytes, bytearray)) else ""
        raise RequestError(f"prompt must be a str, a list or tuple of int token ids or a 1-D integer numpy array, "
                           f"got {type(prompt).__name__}{hint}")

    def _make_request(self, prompt: Sequence[int] | str, params: SamplingParams, request_id: str | None,
                      restore: HostKV | None = None, owner: str = "step") -> _Request:
        ids = self._prompt_ids(prompt)
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.cfg.vocab_size)
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"prompt token {i} is {t!r}, not an integer token id")
            if not 0 <= t < self.cfg.vocab_size:
                raise RequestError(f"prompt token {i} is {t}, outside the vocabulary [0, {self.cfg.vocab_size})")
        limit = min(self.config.max_model_len, self.pool_spec.num_slots)
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"context limit of {limit} tokens")
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if restore is not None:
            self._check_restore(tuple(int(t) for t in ids), restore)
        # id, seed and arrival come at _enqueue: a request rejected here (or a batch that fails on a
        # later prompt) takes no arrival, so the next one gets the default seed it would have had
        return _Request(request_id, tuple(int(t) for t in ids), params, -1, -1, SequencePages(self.page_size),
                        owner=owner)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request; its pages are freed and its partial output is returned (None if it is not
        in flight). For an add_request request this output is its last report: its new_token_ids are
        those step() has not handed out, and step() reports it no more."""
        req = self.requests.get(request_id)
        if req is None or req.finish_reason:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        del self.requests[req.id]
        if req.owner != "step":
            return self._output(req)
        self._unreported.pop(req, None)
        return self._report(req)

    def update_weights(self, params) -> None:
        """Serves new weights from now on (an RL trainer's, after an optimizer step): `params` as
        `models.with_params` takes them, on any devices; they are resharded onto this engine's mesh
        and need no recompile. Nothing computed by the old weights is reused: the prefix cache is
        emptied, host KV copies of the old weights are freed (and refused by `restore`), and suffix
        drafts start from empty trees. The new fingerprint is random: no other engine's KV matches it.
        Refused (RequestError) while requests are in flight, which would mix two policies in one
        output; abort or finish them first."""
        if self.requests:
            raise RequestError(f"update_weights: {len(self.requests)} requests are in flight; finish or abort them "
                               f"first")
        if self.runner.slot is not None:
            raise RequestError("update_weights: this engine reads its weights from a shared slot (an instance's); "
                               "load them through the instance")
        self.model = with_params(self.model, params, tag=secrets.token_hex(8))
        self.runner.model = self.model
        self.host_tier.release_all()
        self.host_tier.source = dataclasses.replace(self.host_tier.source, weights=self.model.fingerprint)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.drafter is not None:
            self.drafter = SuffixDrafter(self.config.speculation)

    def has_unfinished(self) -> bool:
        """Whether `step()` has anything left to do: requests to run, or progress still to hand out
        (an add_request request may have finished while generate() or a stream drove the engine)."""
        return bool(self._has_work() or self._unreported)

    def _has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def _preempt(self, req: _Request) -> None:
        req.seq.release(self.allocator)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def kv_lost(self) -> None:
        """The arena's buffer was replaced (a failed step consumed it): every running request is requeued
        for recompute and the prefix cache, whose KV went with it, is emptied."""
        for req in reversed(self.running[:]):  # appendleft in reverse keeps their order at the queue head
            self._preempt(req)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _schedule(self, restores: list[_Request], drafts: dict[_Request, Draft]) -> list[tuple[_Request, int, Draft | None]]:
        """The step's (request, tokens, draft) triples (tokens count the draft's); admitted requests
        whose prefix comes from host memory are appended to `restores` (their pages are allocated and
        num_computed counts the prefix). A draft takes only budget that every later running request's
        token leaves, and pages that are free: it is dropped rather than preempt anyone."""
        budget = self.config.max_tokens_per_step
        batch: list[tuple[_Request, int, Draft | None]] = []
        running = list(self.running)
        for i, req in enumerate(running):
            if req not in self.running or budget == 0:
                continue  # preempted below as a victim, or no budget left
            n = min(req.num_tokens - req.num_computed, budget)
            draft = drafts.get(req)
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
                    scheduled = {id(r) for r, _, _ in batch}
                    victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                    self._preempt(victim)
                    if victim is req:
                        break
            if req in self.running:
                batch.append((req, n + extra, draft))
                budget -= n + extra
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs:
            req = self.waiting[0]
            if req.restore is not None and not self.host_tier.usable(req.restore):
                req.restore = None  # evicted (host budget) since add_request: the prefix is recomputed
            hit = 0
            if self.prefix_cache is not None:
                # the last known token is always computed: its logits give the next token
                req.seq.pages = self.prefix_cache.match(self._prefix_key(req), self._known_tokens(req),
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
            if restore:
                restores.append(req)
                req.restore_skip = hit // self.page_size
            req.num_computed = req.cached = cached
            if self.prefix_cache is not None:
                self.stats.prefix_query_tokens += req.num_tokens - 1
                self.stats.prefix_hit_tokens += hit
            batch.append((req, n, None))
            budget -= n
        return batch

    def prefix_key(self, cache_salt: str | None = None) -> tuple:
        """The prefix-cache key of this engine's requests with `cache_salt` (model, weights, tenant)."""
        return self.cfg.name, self.model.fingerprint, cache_salt

    def _prefix_key(self, req: _Request) -> tuple:
        return self.prefix_key(req.cache_salt)

    def _known_tokens(self, req: _Request) -> tuple[int, ...]:
        return req.prompt + tuple(req.output) if req.output else req.prompt

    def _evict_cached(self, need: int) -> bool:
        """Frees cached pages so `need` can be allocated (from the prefix caches of every engine on the
        arena, in the caches' eviction order); whether any were freed."""
        short = need - self.allocator.num_free
        caches = [e.prefix_cache for e in self.arena.engines if e.prefix_cache is not None]
        if not caches or short <= 0:
            return False
        freed = evict(caches, short)
        self.stats.prefix_evicted_pages += freed
        return freed > 0

    def step(self) -> list[RequestOutput]:
        """Runs one batched step. Returns one output per add_request request that gained tokens or
        finished since the last step() call, whoever stepped the engine in between (generate() and
        streams do), in the order they did: new_token_ids holds the tokens not handed out before, so
        they add up to token_ids, and a finish is reported once. Requests of generate() and stream()
        are reported by those, not here. On StepError nothing is lost: the next call reports it."""
        self._advance()
        return self._drain()

    def _report(self, req: _Request) -> RequestOutput:
        out = self._output(req, new=req.output[req.reported:])
        req.reported = len(req.output)
        return out

    def _drain(self) -> list[RequestOutput]:
        outs = [self._report(req) for req in self._unreported]
        self._unreported.clear()
        return outs

    def spec_policy(self) -> SpecPolicy:
        """The speculation policy; its step-cost curve is measured on first use (when the engine first
        has requests to draft for: an instance's engine reads its weights from the slot only then)."""
        if self._spec_policy is None:
            self._spec_policy = SpecPolicy.measure(self.runner, self.config.speculation)
        return self._spec_policy

    def _drafts(self) -> dict[_Request, Draft]:
        """Drafts for the running requests that decode this step, as many tokens each as the policy
        finds worth verifying at this batch size (none, often), within max_tokens and max_model_len."""
        if self.drafter is None or not self.speculate:
            return {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        k = self.spec_policy().draft_len(len(self.running)) if decoding else 0
        if k == 0:
            return {}
        caps = [min(k, r.params.max_tokens - len(r.output) - 1, self.config.max_model_len - r.num_tokens)
                for r in decoding]
        drafts = {r: d for r, d in zip(decoding, self.drafter.draft([r.id for r in decoding], caps)) if len(d)}
        if drafts and not self.spec_policy().worth(len(self.running), sum(len(d) for d in drafts.values()),
                                                   sum(d.score for d in drafts.values())):
            return {}  # these drafts are not worth their step's cost: a plain step
        return drafts

    def _advance(self) -> list[_Request]:
        """Runs one batched step; returns the requests that gained a token (finished ones included)."""
        restores: list[_Request] = []
        batch = self._schedule(restores, self._drafts())
        if not batch:
            return []
        spec = any(d is not None for _, _, d in batch)
        b = self.runner.empty_batch(sum(n for _, n, _ in batch))
        d = DraftBatch.empty(len(b.tokens), self.config.max_seqs, self.draft_nodes) if spec else None
        rows: list[tuple[int, _Request]] = []  # (sampling row, request)
        t = 0
        max_pages = 0
        for i, (req, n, draft) in enumerate(batch):
            first = req.seq.pages[req.num_computed // self.page_size]
            if self.prefix_cache is not None and self.allocator.refcount(first) != 1:
                # the pages written from here on must be this sequence's own: cached pages are shared
                raise AssertionError(f"request {req.id} would write into shared page {first}")
            m = len(draft) if draft is not None else 0
            q = n - m  # tokens of the request's own (1 beside a draft)
            pos = np.arange(req.num_computed, req.num_computed + n)  # a draft's nodes in depth-first order
            b.tokens[t:t + q] = [req.token(p) for p in pos[:q]]
            b.positions[t:t + n] = pos
            b.seq[t:t + n] = i
            b.slots[t:t + n] = [req.seq.slot(p) for p in pos]
            b.page_tables[i, :len(req.seq.pages)] = req.seq.pages
            max_pages = max(max_pages, len(req.seq.pages))
            if d is not None:
                d.mask_pos[t:t + n] = pos
            if m:
                depth, anc = _tree_layout(draft.parents)
                b.tokens[t + 1:t + n] = draft.tokens
                b.positions[t + 1:t + n] = req.num_computed + depth
                d.base[t + 1:t + n] = req.num_computed + 1
                d.anc[t + 1:t + n] = anc
            if req.num_computed + q == req.num_tokens:  # this chunk ends the known tokens: sample the next one
                row = i if spec else len(rows)
                if spec:
                    d.node_idx[i, :m + 1] = t + q - 1 + np.arange(m + 1)
                    d.parent[i, 0] = -1
                    d.active[i] = True
                    d.draw_step[t + q - 1] = len(req.output)
                    if m:
                        d.parent[i, 1:m + 1] = draft.parents + 1
                        d.draw_step[t + 1:t + n] = len(req.output) + depth
                else:
                    b.logits_idx[row] = t + n - 1
                b.sampling.set_row(row, req.params, req.seed, len(req.output))
                rows.append((row, req))
            t += n
        b.num_blocks = -(-max_pages // self.runner.pages_per_block)
        try:
            for req in restores:  # host-to-device into the donated pool, before the step reads it
                r = req.restore
                self.runner.kv = self.host_tier.restore(self.runner.kv, r, req.seq.pages[:r.num_pages],
                                                        skip=req.restore_skip)
            t0 = time.perf_counter()
            out = self.runner.verify_step(b, d) if spec else self.runner.step(b)
            if self._spec_policy is not None:
                self._spec_policy.observe_step(spec, len(b.tokens), time.perf_counter() - t0)
        except Exception as e:  # the donated pool may be gone: start it afresh and recompute every sequence
            self.stats.step_failures += 1
            for req in restores:
                req.restore = None  # a restore that may have failed is not retried: the prefix is recomputed
            self.arena.reset()  # every engine on the arena recomputes (kv_lost), this one too
            raise StepError(f"engine step failed ({type(e).__name__}: {e}); {len(self.waiting)} requests "
                            f"requeued for recompute") from e
        self.stats.steps += 1
        self.stats.spec_steps += spec
        self.stats.restored_tokens += sum(req.restore.num_tokens - req.restore_skip * self.page_size
                                          for req in restores)
        drafted = {}
        for req, n, draft in batch:
            q = n - (len(draft) if draft is not None else 0)
            if req.num_computed + q > len(req.prompt):
                self.stats.decode_tokens += min(q, req.num_computed + q - len(req.prompt))
            self.stats.prefill_tokens += max(0, min(req.num_computed + q, len(req.prompt)) - req.num_computed)
            req.num_computed += q
            if draft is not None:
                drafted[req] = draft
        for r, req in rows:
            if spec:
                count = int(out.count[r])
                toks, lps, path = out.tokens[r, :count], out.logprobs[r, :count], out.path[r, :count]
                top_ids, top_lps = out.top_ids[r, :count], out.top_logprobs[r, :count]
                # accepted nodes 1, 2, ... in place hold their KV; after a jump (a tree's side branch)
                # the accepted tokens are known but recomputed next step
                kept = int(np.argmin(np.r_[path[1:] == np.arange(1, count), False]))
                req.num_computed += kept
                if req in drafted:
                    self.stats.draft_tokens += len(drafted[req])
                    self.stats.accepted_tokens += count - 1
                    self.spec_policy().observe(len(drafted[req]), count - 1, drafted[req].score)
            else:
                toks, lps = out.tokens[r:r + 1], out.logprobs[r:r + 1]
                top_ids, top_lps = out.top_ids[r:r + 1], out.top_logprobs[r:r + 1]
            for j, tok in enumerate(toks.tolist()):
                if self._append(req, tok, float(lps[j]), top_ids[j], top_lps[j]):
                    break
            if req in drafted and not req.finish_reason:  # the rejected drafts' pages go back
                req.seq.truncate(self.allocator, req.num_computed)
            if req.owner == "step":
                self._unreported.setdefault(req, None)  # kept until step() hands it out
        return [req for _, req in rows]

    def _append(self, req: _Request, tok: int, logprob: float, top_ids, top_lps) -> bool:
        """Appends one sampled token; finishes the request at a stop token or a length limit (True)."""
        req.output.append(tok)
        req.logprobs.append(logprob)
        if req.params.logprobs:
            k = req.params.logprobs
            req.top_logprobs.append({int(i): float(l) for i, l in zip(top_ids[:k], top_lps[:k])})
        req.num_computed = min(req.num_computed, req.num_tokens - 1)  # the KV of the tokens it keeps
        if self.drafter is not None:
            self.drafter.extend(req.id, (tok,))
        reason = self._stop_reason(req, tok)
        if reason:
            self._finish(req, reason)
            del self.requests[req.id]
        return bool(reason)

    def _stop_reason(self, req: _Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.cfg.eos_ids):
            return "stop"
        if len(req.output) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, req: _Request, reason: str) -> None:
        req.finish_reason = reason
        if req.keep_kv and reason != "abort" and req.num_computed:
            tokens = (req.prompt + tuple(req.output))[:req.num_computed]  # the last token has no KV yet
            try:
                req.kv = self.host_tier.offload(self.runner.kv, req.seq.pages, tokens, session=req.session)
                self.stats.offloaded_tokens += len(tokens)
            except Exception:  # e.g. host memory exhausted: the request still finishes, without its KV
                self.stats.offload_failures += 1
        if self.prefix_cache is not None and req.num_computed:  # its full computed pages stay for later requests
            self.prefix_cache.insert(self._prefix_key(req), self._known_tokens(req)[:req.num_computed], req.seq.pages)
        req.seq.release(self.allocator)
        if req in self.running:
            self.running.remove(req)
        if self.drafter is not None:
            self.drafter.finish(req.id)
        if reason == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1

    def _output(self, req: _Request, new: list[int] | None = None) -> RequestOutput:
        # "stop" is only ever set by a stop or EOS token, which the text leaves out.
        ids = list(req.output)
        text_ids = ids[:-1] if req.finish_reason == "stop" else list(ids)
        return RequestOutput(req.id, req.prompt, ids, list(req.logprobs), list(req.top_logprobs), req.finish_reason,
                             list(new or []), text_ids, self.tokenizer, req.kv, req.cached)

    # ---- library API ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams(), progress: bool = True) -> list[RequestOutput]:
        """Runs all prompts (a list or tuple of prompts, each as `add_request` takes it) to completion;
        outputs in prompt order. Any invalid prompt or params raises RequestError before anything is
        queued. Requests queued with add_request advance too; step() reports their progress later."""
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a list or tuple of prompts, got {type(prompts).__name__}")
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        elif isinstance(params, (list, tuple)):
            plist = list(params)
        else:
            raise RequestError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                reqs.append(self._make_request(p, sp, None, owner="generate"))
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        for req in reqs:
            self._enqueue(req)
        ours = set(reqs)
        try:
            with tqdm(total=len(reqs), desc="generate", disable=not progress or len(reqs) < 2, leave=False) as bar:
                while any(not r.finish_reason for r in reqs) and self._has_work():
                    bar.update(sum(1 for r in self._advance() if r in ours and r.finish_reason))
        except BaseException:  # a failed step or an interrupt: nobody would report ours, so none may run on
            for r in reqs:
                if not r.finish_reason:
                    self.abort(r.id)
            raise
        return [self._output(r) for r in reqs]

    def stream(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Queues the request now (bad input raises here) and returns an iterator that yields its
        output whenever it gains tokens, ending with the finished output. Other requests advance
        too; several streams may be interleaved, and step() reports the add_request ones later. Closing
        the iterator early aborts the request."""
        req = self._make_request(prompt, params, request_id, owner="stream")
        self._enqueue(req)
        return _Stream(self, req)

    def _stream(self, req: _Request) -> Iterator[RequestOutput]:
        seen = 0
        try:
            while not req.finish_reason:
                if len(req.output) == seen:
                    if not self._has_work():
                        break
                    self._advance()
                if len(req.output) > seen and not req.finish_reason:
                    out, seen = self._output(req, new=req.output[seen:]), len(req.output)
                    yield out  # other callers may step while we are suspended here
            yield self._output(req, new=req.output[seen:])
        finally:
            if not req.finish_reason:
                self.abort(req.id)


class _Stream:
    """The iterator `Engine.stream` returns. Closing it, or dropping it, aborts the request even
    before its first item (a bare generator skips its `finally` when it never started)."""

    def __init__(self, engine: Engine, req: _Request):
        self._engine, self._req = engine, req
        self._gen = engine._stream(req)

    def __iter__(self) -> "_Stream":
        return self

    def __next__(self) -> RequestOutput:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        if not self._req.finish_reason:
            self._engine.abort(self._req.id)

    def __del__(self):
        self.close()


def _tree_layout(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth (1 for the root's children) and ancestor bits (bit j: node j; each node has its own) of
    draft nodes in depth-first order (parents[j] < j, -1 for the root)."""
    depth = np.zeros(len(parents), np.int32)
    anc = np.zeros(len(parents), np.int32)
    for j, p in enumerate(parents.tolist()):
        depth[j] = 1 if p < 0 else depth[p] + 1
        anc[j] = (1 << j) | (0 if p < 0 else anc[p])
    return depth, anc


def _stable_seed(engine_seed: int, arrival: int) -> int:
    """A per-request seed from the engine seed and the arrival index, the same in every process
    (Python's hash() of strings is salted per process)."""
    digest = hashlib.blake2b(f"{engine_seed}:{arrival}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
