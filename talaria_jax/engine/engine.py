"""The engine: continuous batching over one model, with chunked prefill mixed into decode.

A step is three calls with plain data between them: the scheduler half decides
(`EngineScheduler.schedule` -> a frozen `StepPlan`: queues, pages, preemption, the chunked-prefill
budget, prefix and host admission, the draft budget), the runner executes the plan
(`Runner.execute` -> `StepResult`), and `EngineScheduler.update` applies the result to the requests.
The engine wires them: drafts from the suffix drafter where the speculation policy finds them worth
a step, host copies scattered in before the step, outputs reported to whoever queued each request.

Each request is reported to the caller that queued it: `step()` reports the requests of
`add_request`, `generate()` and `stream()` their own. Whoever steps the engine, progress of
`add_request` requests is kept until the next `step()` hands it out, once.
"""
from __future__ import annotations

import dataclasses
import functools
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from talaria_jax.engine.engine_scheduler import EngineScheduler, EngineStats, Limits, Request
from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.grammar import Grammars
from talaria_jax.engine.plan import StepPlan
from talaria_jax.engine.runner import ATTENTION, Runner, attention_kind, layers_per_program
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec.policy import SpecPolicy
from talaria_jax.engine.spec.suffix import Draft, SpecConfig, SuffixDrafter
from talaria_jax.kvcache.allocator import SequencePages
from talaria_jax.kvcache.host_tier import HostKV, HostKVEvicted, HostTier
from talaria_jax.kvcache.pool import KVArena
from talaria_jax.kvcache.prefix import PrefixCache
from talaria_jax.kvcache.session_kv import ModelKV
from talaria_jax.models.model import ShardedModel, with_params
from talaria_jax.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["CheckedRequest", "Engine", "EngineConfig", "EngineStats", "RequestError", "RequestOutput", "StepError"]


class StepError(RuntimeError):
    """A step failed on the device. The pool was reallocated and every running request requeued
    for recompute, so no request is lost; the step can be retried."""


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request an engine has checked (`Engine.check_request`): its prompt's token ids and its
    sampling params. That engine's `add_request` takes it as it is; any other engine checks it again."""
    prompt: tuple[int, ...]
    params: SamplingParams
    # the checking engine's token, set by the engine alone (a copy by dataclasses.replace has none)
    checked_by: object = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def _by(cls, token: object, prompt: tuple[int, ...], params: SamplingParams) -> CheckedRequest:
        checked = cls(prompt, params)
        object.__setattr__(checked, "checked_by", token)
        return checked


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
    # Speculative decoding with suffix-tree drafts (engine/spec/): drafts from the request's own
    # text and from earlier and in-flight responses of the same cache_salt, verified losslessly in
    # the step; how many per step is chosen from the measured step-cost curve (engine/spec/policy.py).
    speculation: SpecConfig | None = None
    # Which ragged paged attention the step runs: "reference" (plain jnp, engine/paged_attention.py),
    # "pallas" (the kernel of engine/kernels/, interpreted off GPU: slow, for tests) or "auto" (the
    # kernel where the model's devices are GPUs and it takes the pool's page_size and head_dim).
    attention: str = "auto"
    # XLA options of the compiled steps (jax.jit's compiler_options, e.g. {"xla_backend_optimization_level":
    # 2}); they win over the process's XLA_FLAGS for this engine's steps only. None: the flags alone.
    compiler_options: dict[str, Any] | None = None
    # Steps as programs of at most this many layers (the most that divide the model's depth evenly), one
    # program serving every run of like layers (0: each step one program). None: LAYERS_PER_PROGRAM_CPU
    # layers where the step's attention is the jnp reference on CPUs and the model is deeper than that
    # (compiles and maps a fraction of the whole step's program; docs/benchmarks/layer_programs.md), else
    # 0 (a GPU runs each step as one program, launched once).
    layers_per_program: int | None = None

    def validate(self) -> None:
        """Checks every field's type and range (the engine calls it).

        Raises:
            ValueError: a field of the wrong type or out of range, named with its limit.
        """
        for f in ("page_size", "max_seqs", "max_tokens_per_step", "max_model_len", "pages_per_block", "query_tile"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("warmup", "prefix_cache"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"EngineConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {', '.join(map(repr, ATTENTION))}, got "
                             f"{self.attention!r}")
        if self.compiler_options is not None and not (
                isinstance(self.compiler_options, dict) and all(isinstance(k, str) for k in self.compiler_options)):
            raise ValueError(f"EngineConfig.compiler_options must be a dict of XLA option names, got "
                             f"{self.compiler_options!r}")
        if self.layers_per_program is not None and (isinstance(self.layers_per_program, bool) or
                                                    not isinstance(self.layers_per_program, int) or
                                                    self.layers_per_program < 0):
            raise ValueError(f"EngineConfig.layers_per_program must be None or an int >= 0, got "
                             f"{self.layers_per_program!r}")
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


class Engine:
    """Continuous-batching generation over one model on one mesh.

    `before_step`: None, or a function called with each step's plan inside the step, before its
    device work (host-KV restores, the jitted step). What it raises fails the step as a device
    failure would (`StepError`; the pool reallocated, every running request requeued): fault
    injection for tests and failure drills, without reaching into the runner.
    """

    def __init__(self, model: ShardedModel, config: EngineConfig = EngineConfig(), tokenizer: Tokenizer | None = None,
                 arena: KVArena | None = None, kv: ModelKV | None = None, weight_slot: tuple | None = None):
        """Allocates the KV pool (or takes a share of `arena`) and, unless `config.warmup` is off, compiles
        everything serving runs.
        `arena`: a KV arena shared with other engines on the same mesh (`KVArena.for_models`), which
        then sizes the pool and its pages (EngineConfig.num_pages and kv_memory_bytes_per_device must be
        unset); None: the engine's own, of config.page_size tokens per page.
        `kv`: the prefix cache and host tier to use, built over `arena` by their owner (an instance's
        ``SessionKV``); None: the engine builds its own (a prefix cache only with config.prefix_cache).
        `weight_slot`: (a ``WeightSlot``, this model's ``SlotLayout`` in it): the steps read the weights
        from the slot that several models share (``Runner.use_slot``); None: from the model's arrays.

        Raises:
            ValueError: an invalid `config` (`EngineConfig.validate` names the field), a `max_model_len` past
                the model's, tree drafts on a model without full attention, a pool size given beside a shared
                `arena`, an `arena` on another mesh, or `kv` not over `arena`.
        """
        config.validate()
        if config.speculation is not None and config.speculation.tree and any(model.cfg.sliding_windows):
            raise ValueError(f"EngineConfig.speculation: tree drafts need full attention; {model.cfg.name} has "
                             f"sliding windows (use chain drafts: SpecConfig(tree=False))")
        if config.max_model_len > model.cfg.max_position:
            raise ValueError(f"EngineConfig.max_model_len ({config.max_model_len}) exceeds {model.cfg.name}'s "
                             f"max_position ({model.cfg.max_position})")
        self.model, self.config = model, config
        self.before_step: Callable[[StepPlan], None] | None = None
        self.tokenizer = tokenizer or ByteTokenizer()
        if arena is None:
            num_pages = config.num_pages
            if num_pages is None and config.kv_memory_bytes_per_device is None:
                num_pages = config.max_seqs * -(-config.max_model_len // config.page_size)
            arena = KVArena.for_models([self.model.cfg], model.mesh, config.page_size, num_pages=num_pages,
                                       memory_bytes_per_device=config.kv_memory_bytes_per_device)
        elif config.num_pages is not None or config.kv_memory_bytes_per_device is not None:
            raise ValueError("EngineConfig.num_pages and kv_memory_bytes_per_device must be unset with a shared "
                             "arena: the arena sizes the pool")
        elif arena.mesh != model.mesh:  # another mesh would reshard (copy) the arena at every step
            raise ValueError(f"the KV arena is on mesh {arena.mesh}, {self.model.cfg.name} on {model.mesh}")
        self.arena, self.pool_spec = arena, arena.spec_for(self.model.cfg)
        self.page_size = self.pool_spec.page_size  # tokens per page: config.page_size unless the arena is shared
        self.max_pages_per_seq = max_pages_per_seq = -(-config.max_model_len // self.page_size)
        self.allocator = arena.allocator
        if kv is None:
            self.prefix_cache = PrefixCache(self.allocator, self.page_size) if config.prefix_cache else None
            self.host_tier = HostTier(self.pool_spec, model.mesh, model=self.model.cfg.name, weights=model.fingerprint)
        elif kv.prefix_cache.allocator is not self.allocator or kv.host_tier.spec != self.pool_spec:
            raise ValueError(f"Engine(kv=...): {self.model.cfg.name}'s prefix cache and host tier must be built over "
                             f"the engine's KV arena (SessionKV.add_model)")
        else:
            self.prefix_cache, self.host_tier = kv.prefix_cache, kv.host_tier
        spec = config.speculation
        attention = attention_kind(config.attention, model.mesh, self.pool_spec)
        self.runner = Runner(model, arena, self.pool_spec, max_seqs=config.max_seqs,
                             max_pages_per_seq=max_pages_per_seq, max_tokens_per_step=config.max_tokens_per_step,
                             pages_per_block=config.pages_per_block, query_tile=config.query_tile,
                             attention=attention, draft_nodes=spec.max_spec_tokens + 1 if spec is not None else 0,
                             compiler_options=config.compiler_options,
                             layers_per_program=layers_per_program(config.layers_per_program, model.mesh, attention,
                                                                   model.cfg.num_layers))
        if weight_slot is not None:
            self.runner.use_slot(*weight_slot)
        self.scheduler = EngineScheduler(
            Limits(config.max_seqs, config.max_tokens_per_step, config.max_model_len, config.seed), self.allocator,
            self.page_size, prefix_cache=self.prefix_cache, host=_HostCopies(self),
            drafter=SuffixDrafter(spec) if spec is not None else None, eos_ids=tuple(self.model.cfg.eos_ids),
            prefix_key=self.prefix_key, caches=lambda: list(arena.prefix_caches))
        self._arena_generation = arena.generation
        # grammar-constrained requests' masks (llguidance's view of the tokenizer, built at the first)
        self.grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, tuple(self.model.cfg.eos_ids))
        self._checks = object()  # what this engine's CheckedRequests carry
        self._placed = False  # an owner places the weights (place_weights)
        self._last = StepReport()  # what the last step computed (run_step reports it)
        # add_request requests with progress step() has not handed out yet, in the order they made it
        self._unreported: dict[Request, None] = {}
        self._spec_policy: SpecPolicy | None = None  # measured at the first step that could draft
        # Whether steps may verify drafts at all (with config.speculation): a caller that sees the load
        # beyond this engine turns it off (the rollout service does while requests wait for a slot).
        self.speculate = True
        if config.warmup:
            self.warmup(progress=None)
        if self.prefix_cache is not None:  # last: a constructor that failed leaves nothing on the arena
            arena.attach(self.prefix_cache)

    # ---- state (read-only views of the scheduler's) -----------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """Requests in flight, by id (finished ones leave at once)."""
        return self.scheduler.requests

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def drafter(self) -> SuffixDrafter | None:
        return self.scheduler.drafter

    @property
    def context_limit(self) -> int:
        """The most tokens a request may hold, prompt and output: max_model_len, or fewer where the
        KV pool is smaller."""
        return min(self.config.max_model_len, self.pool_spec.num_slots)

    # ---- queries (what an instance asks of its engines) -------------------------------------------
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def is_waiting(self, request_id: str) -> bool:
        """Whether the request is queued and not admitted (it holds no pages)."""
        req = self.scheduler.requests.get(request_id)
        return req is not None and req in self.scheduler.waiting

    def clear_prefix_cache(self) -> None:
        """Drops every page the prefix cache keeps (the next requests prefill their prompts whole);
        nothing without a prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def warmup(self, progress: bool | None = None) -> None:
        """Compiles every program serving runs: each step shape (`Runner.step_shapes`), and the host
        tier's gather and scatter for every padded page count a sequence's copy can take (powers of
        two up to max_pages_per_seq, a handful), so a steady workload with offloads and restores
        compiles nothing more. Nothing in the pool changes. progress: a bar, none, or (None) one
        only on a terminal."""
        if self.runner.slot is None:  # (a slot's warm-up runs whatever the slot holds)
            self.runner.require_weights()
        t0, steps, copies = time.perf_counter(), self.runner.compilations, self.host_tier.compilations
        self.runner.warmup(progress)
        self.runner.kv = self.host_tier.warmup(self.runner.kv, self.max_pages_per_seq)
        logging.info("engine warm-up: %d step programs and %d host-tier programs built in %.1f s",
                     self.runner.compilations - steps, self.host_tier.compilations - copies, time.perf_counter() - t0)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str | CheckedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, *, keep_kv: bool = False, restore: HostKV | None = None,
                    cache_salt: str | None = None, session: str | None = None) -> str:
        """Queues a request, reported by `step()`; bad input raises RequestError (SamplingError is one)
        naming the field and changes nothing. The prompt is a str, a list or tuple of int token ids, a
        1-D integer numpy array, or a `CheckedRequest` this engine's `check_request` made (not checked
        again; `params` None takes its params); a str is encoded without BOS (prepend it yourself if
        the model wants one). `params` None: the defaults. `keep_kv`: when the request finishes, its KV
        goes to host memory (`RequestOutput.kv`).
        `restore`: such a KV (of the same weights and page layout) for a prefix of `prompt`; it is
        copied back into the pool at admission instead of being recomputed, and the prompt must start
        with its tokens. `cache_salt`: the prefix-cache tenant (with `EngineConfig.prefix_cache`); only
        requests with the same salt (None is one) reuse each other's cached KV. `session` tags the keep_kv
        host copy for the host tier's per-session accounting and `protect`.

        Raises:
            RequestError: the prompt, params, request id or restore are invalid (SamplingError for the
                params, GrammarError for a grammar the library cannot compile); the message names the
                field, and nothing is queued.
        """
        if not isinstance(keep_kv, (bool, np.bool_)):
            raise RequestError(f"keep_kv must be a bool, got {keep_kv!r} ({type(keep_kv).__name__})")
        for name, v in (("cache_salt", cache_salt), ("session", session)):
            if v is not None and not isinstance(v, str):
                raise RequestError(f"{name} must be a str or None, got {type(v).__name__}")
        req = self._make_request(prompt, params, request_id, restore)
        req.keep_kv, req.restore, req.cache_salt, req.session = bool(keep_kv), restore, cache_salt, session
        return self._enqueue(req)

    def check_request(self, prompt: Sequence[int] | str | CheckedRequest,
                      params: SamplingParams | None = None) -> CheckedRequest:
        """The checks of `add_request` without queueing anything: the request checked, which this
        engine's add_request takes as it is (a server checks a request once, when it arrives), or the
        RequestError that add_request would raise. A `CheckedRequest` of this engine as the prompt
        is not checked again: only `params`, if given (the choices of one prompt). Safe off the thread
        that steps the engine: it reads only what is fixed at construction (the vocabulary, the
        context limit, the tokenizer) and the grammar cache, which has its own lock."""
        if isinstance(prompt, CheckedRequest) and prompt.checked_by is self._checks and params is None:
            return prompt
        return self._check(prompt, params)

    def _check(self, prompt, params: SamplingParams | None) -> CheckedRequest:
        if isinstance(prompt, CheckedRequest):
            if params is None:
                params = prompt.params
            if prompt.checked_by is self._checks:
                self._check_params(len(prompt.prompt), params)
                return CheckedRequest._by(self._checks, prompt.prompt, params)
            prompt = prompt.prompt
        if params is None:
            params = SamplingParams()
        ids = self._prompt_ids(prompt)
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise RequestError("prompt is empty")
        arr = _token_array(ids)  # checked at once; the loop below only names the first bad token
        if arr is None or np.any((arr < 0) | (arr >= vocab)):
            for i, t in enumerate(ids):
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise RequestError(f"prompt token {i} is {t!r}, not an integer token id")
                if not 0 <= t < vocab:
                    raise RequestError(f"prompt token {i} is {t}, outside the vocabulary [0, {vocab})")
        # (ints of mixed numpy types make no int array: each is an int token id, checked above)
        ids = tuple(arr.tolist()) if arr is not None else tuple(int(t) for t in ids)
        self._check_params(len(ids), params)
        return CheckedRequest._by(self._checks, ids, params)

    def _check_params(self, prompt_tokens: int, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.model.cfg.vocab_size)
        limit = self.context_limit
        if prompt_tokens + params.max_tokens > limit:
            raise RequestError(f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"context limit of {limit} tokens")
        if params.grammar is not None:
            self.grammars.check(params.grammar)  # compiled once and kept (GrammarError where refused)

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

    def _enqueue(self, req: Request) -> str:
        return self.scheduler.enqueue(req)

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

    def _make_request(self, prompt, params: SamplingParams | None, request_id: str | None,
                      restore: HostKV | None = None, owner: str = "step") -> Request:
        checked = self.check_request(prompt, params)
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if restore is not None:
            self._check_restore(checked.prompt, restore)
        p = checked.params
        constraint = self.grammars.constraint(p.grammar) if p.grammar is not None else None  # (compiled: a copy)
        # id, seed and arrival come at _enqueue: a request rejected here (or a batch that fails on a
        # later prompt) takes no arrival, so the next one gets the default seed it would have had
        return Request(request_id, checked.prompt, p, SequencePages(self.page_size), owner=owner,
                       constraint=constraint)

    def preempt_running(self, to_host: bool = True) -> list[str]:
        """Pauses this engine's running requests: each goes back to the head of the waiting queue with
        its pages freed, and continues where it stopped when a later step admits it again: the same
        tokens and logprobs as a run without the pause (`EngineScheduler.preempt_running`). Its full
        pages stay in the prefix cache (if on) until something needs them; with `to_host` its KV is
        also copied to host memory and restored from there, else recomputed. For an instance that
        serves another model's calls in between and needs their pages. The ids of the requests paused."""
        self._sync_arena()  # a lost KV buffer: nothing of it may be copied or cached
        return [r.id for r in self.scheduler.preempt_running(to_host)]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request; its pages are freed and its partial output is returned (None if it is not
        in flight). For an add_request request this output is its last report: its new_token_ids are
        those step() has not handed out, and step() reports it no more."""
        self._sync_arena()  # a lost KV buffer: nothing of it may reach the prefix cache
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
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
        output; abort or finish them first.

        Raises:
            RequestError: requests are in flight, or the engine reads its weights from a shared slot (an
                instance's).
        """
        if self.requests:
            raise RequestError(f"update_weights: {len(self.requests)} requests are in flight; finish or abort them "
                               f"first")
        if self.runner.slot is not None or self._placed:
            raise RequestError("update_weights: an instance places this engine's weights (a shared slot or a weight "
                               "budget); load them through the instance")
        self.model = with_params(self.model, params, tag=secrets.token_hex(8))
        self.runner.set_model(self.model)
        self.host_tier.release_all()
        self.host_tier.source = dataclasses.replace(self.host_tier.source, weights=self.model.fingerprint)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.drafter is not None:
            self.scheduler.drafter = SuffixDrafter(self.config.speculation)

    def place_weights(self, state: Any) -> None:
        """Steps read this engine's weights from `state`, the same weights (its fingerprint: nothing
        cached is invalidated) in other device arrays of the model's structure, shapes and shardings
        (`weights.budget.DeviceWeights` brings them back from host memory); None: the engine keeps no
        device copy (an instance evicted it) and its steps are refused until one is placed. Not for an
        engine that reads a shared weight slot. Once placed, the owner keeps the weights:
        `update_weights` is refused.

        Raises:
            ValueError: the engine reads a weight slot, or `state` does not match the model's parameters.
        """
        if self.runner.slot is not None:
            raise ValueError("place_weights: this engine reads its weights from a shared slot")
        self._placed = True  # its owner keeps the weights (update_weights is refused: the owner's copy would differ)
        if state is None:
            from talaria_jax.weights.slot import without_weights  # here: talaria_jax.weights imports orbax

            self.model = without_weights(self.model)  # the arrays are freed once no one else holds them
            self.runner.set_model(self.model, on_device=False)
            return
        want = [(v.shape, v.dtype, v.sharding) for v in jax.tree.leaves(self.model.state)]
        got = [(v.shape, v.dtype, v.sharding) for v in jax.tree.leaves(state)]
        if jax.tree.structure(state) != jax.tree.structure(self.model.state) or got != want:
            raise ValueError(f"place_weights: the state does not match {self.model.cfg.name}'s parameters "
                             f"(structure, shapes, dtypes and shardings)")
        self.model = dataclasses.replace(self.model, state=state)
        self.runner.set_model(self.model)

    def has_unfinished(self) -> bool:
        """Whether `step()` has anything left to do: requests to run, or progress still to hand out
        (an add_request request may have finished while generate() or a stream drove the engine)."""
        return bool(self._has_work() or self._unreported)

    def _has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ---------------------------------------------------------------------------------
    def prefix_key(self, cache_salt: str | None = None) -> tuple:
        """The prefix-cache key of this engine's requests with `cache_salt` (model, weights, tenant)."""
        return self.host_tier.source.prefix_key(cache_salt)

    def run_step(self) -> StepReport:
        """`step()`, with what the step computed: prompt tokens prefilled, tokens decoded, prefix tokens
        restored from host memory and found in the prefix cache (all 0 when nothing ran)."""
        self._last = StepReport()
        outs = self.step()
        return dataclasses.replace(self._last, outputs=outs)

    def step(self) -> list[RequestOutput]:
        """Runs one batched step. Returns one output per add_request request that gained tokens or
        finished since the last step() call, whoever stepped the engine in between (generate() and
        streams do), in the order they did: new_token_ids holds the tokens not handed out before, so
        they add up to token_ids, and a finish is reported once. Requests of generate() and stream()
        are reported by those, not here. On StepError nothing is lost: the next call reports it.

        Raises:
            StepError: the step failed on the device; the pool was reallocated and every running
                request requeued, so the step can be retried.
        """
        self._advance()
        return self._drain()

    def _report(self, req: Request) -> RequestOutput:
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

    def _drafts(self) -> dict[str, Draft]:
        """Drafts for the running requests that decode this step, as many tokens each as the policy
        finds worth verifying at this batch size (none, often), within max_tokens and max_model_len."""
        if self.drafter is None or not self.speculate:
            return {}
        decoding = self.scheduler.decoding()
        running = len(self.running)
        k = self.spec_policy().draft_len(running) if decoding else 0
        if k == 0:
            return {}
        caps = [min(k, r.params.max_tokens - len(r.output) - 1, self.config.max_model_len - r.num_tokens)
                for r in decoding]
        drafts = {r.id: d for r, d in zip(decoding, self.drafter.draft([r.id for r in decoding], caps)) if len(d)}
        if drafts and not self.spec_policy().worth(running, sum(len(d) for d in drafts.values()),
                                                   sum(d.score for d in drafts.values())):
            return {}  # these drafts are not worth their step's cost: a plain step
        return drafts

    def _sync_arena(self) -> None:
        """Another engine's failed step replaced the arena's buffer: every running request here is
        requeued for recompute (the arena emptied the prefix caches)."""
        if self._arena_generation != self.arena.generation:
            self._arena_generation = self.arena.generation
            self.scheduler.requeue_all()

    def _advance(self) -> list[Request]:
        """Runs one step (plan, execute, update); returns the requests that gained a token (finished
        ones included)."""
        self._sync_arena()
        self.runner.require_weights()  # before anything is planned: a refused step changes nothing
        plan = self.scheduler.schedule(self._drafts())
        if not plan:
            return []
        try:
            if self.before_step is not None:
                self.before_step(plan)
            for c in plan.restores:  # host-to-device into the donated pool, before the step reads it
                r = c.restore
                self.runner.kv = self.host_tier.restore(self.runner.kv, r.kv, list(c.pages[:r.kv.num_pages]),
                                                        skip=r.skip)
            result = self.runner.execute(plan)
        except Exception as e:  # the donated pool may be gone: start it afresh and recompute every sequence
            self._step_failed(plan)
            raise StepError(f"engine step failed ({type(e).__name__}: {e}); {len(self.waiting)} requests "
                            f"requeued for recompute") from e
        if self._spec_policy is not None:
            self._spec_policy.observe_step(plan.speculative, result.padded_tokens, result.seconds)
        applied = self.scheduler.update(plan, result)
        for c in plan.chunks:
            if c.draft is not None:
                self._spec_policy.observe(len(c.draft), len(result.drawn[c.request_id].tokens) - 1, c.draft.score)
        for req in applied.gained:
            if req.owner == "step":
                self._unreported.setdefault(req, None)  # kept until step() hands it out
        self._last = StepReport([], applied.prefill_tokens, applied.decode_tokens, applied.restored_tokens,
                                plan.prefix_hit_tokens)
        return applied.gained

    def _step_failed(self, plan: StepPlan) -> None:
        self.stats.step_failures += 1
        self.scheduler.drop_restores(plan)  # a restore that may have failed is not retried: recomputed
        self.arena.reset()  # every engine on the arena recomputes, this one now
        self._sync_arena()

    def _output(self, req: Request, new: list[int] | None = None) -> RequestOutput:
        # "stop" is set by a stop or EOS token, which the text leaves out, or by a complete grammar
        ids = list(req.output)
        text_ids = ids[:-1] if req.finish_reason == "stop" and not req.grammar_done else list(ids)
        return RequestOutput(req.id, req.prompt, ids, list(req.logprobs), list(req.top_logprobs), req.finish_reason,
                             list(new or []), text_ids, self.tokenizer, req.kv, req.cached)

    # ---- library API ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams(), progress: bool = True) -> list[RequestOutput]:
        """Runs all prompts (a list or tuple of prompts, each as `add_request` takes it) to completion;
        outputs in prompt order. Any invalid prompt or params raises RequestError before anything is
        queued. Requests queued with add_request advance too; step() reports their progress later.

        Raises:
            RequestError: a prompt or its params are invalid (the message names the field); nothing
                is queued.
        """
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
        the iterator early aborts the request.

        Raises:
            RequestError: the prompt or params are invalid (the message names the field); nothing is
                queued.
        """
        req = self._make_request(prompt, params, request_id, owner="stream")
        self._enqueue(req)
        return _Stream(self, req)

    def _stream(self, req: Request) -> Iterator[RequestOutput]:
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

    def __init__(self, engine: Engine, req: Request):
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



def _token_array(ids: list) -> np.ndarray | None:
    """The ids as an int64 array, or None unless every one is an int (a bool is not a token id)."""
    if any(type(t) is bool or type(t) is np.bool_ for t in ids):
        return None
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):
        return None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        return None
    return arr.astype(np.int64, copy=False)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """`Engine.run_step`'s answer: the outputs `step()` returns, and what the step computed."""
    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    restored_tokens: int = 0  # prefix tokens copied in from host memory
    prefix_hit_tokens: int = 0  # prefix tokens admissions found in the prefix cache


class _HostCopies:
    """The scheduler's view of host memory: the engine's host tier over its runner's KV pool."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def usable(self, kv: HostKV) -> bool:
        return self._engine.host_tier.usable(kv)

    def offload(self, pages: list[int], tokens: tuple[int, ...], session: str | None) -> HostKV:
        e = self._engine
        return e.host_tier.offload(e.runner.kv, pages, tokens, session=session)
