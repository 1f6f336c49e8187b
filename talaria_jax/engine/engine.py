"""The engine loop: continuous batching over the runner, with chunked prefill mixed into decode.

Each step packs, oldest first, one decode token per running request and prefill chunks under a
token budget, then admits waiting requests while pages and sequence slots last. When a running
request needs a page and none is free, the most recently admitted request is preempted by
recompute: its pages are freed and it goes back to the head of the queue with the tokens it has
generated, so nothing is lost or duplicated (seeded sampling keys on the output index, so even a
sampled request resumes with the same tokens).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from talaria_jax.engine.runner import Runner
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache.allocator import OutOfPages, PageAllocator, SequencePages
from talaria_jax.kvcache.pool import pool_spec
from talaria_jax.models.model import ShardedModel
from talaria_jax.tokenizer import ByteTokenizer, Tokenizer


class RequestError(ValueError):
    """A request the engine cannot take; the message names the field and the limit."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None          # or kv_memory_bytes; default: room for max_seqs full sequences
    kv_memory_bytes: int | None = None
    max_seqs: int = 16
    max_tokens_per_step: int = 256       # token budget per step (prefill chunk size bound)
    max_model_len: int = 2048
    pages_per_block: int = 4            # attention block width in pages (4 x 16 tokens was fastest on CPU)
    seed: int = 0                         # seeds requests that carry no seed of their own

    def validate(self) -> None:
        for f in ("page_size", "max_seqs", "max_tokens_per_step", "max_model_len", "pages_per_block"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.max_tokens_per_step < self.max_seqs:
            raise ValueError(f"EngineConfig.max_tokens_per_step ({self.max_tokens_per_step}) must be >= "
                             f"max_seqs ({self.max_seqs}) so every running sequence can decode each step")


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    new_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)  # identity: `in` and `remove` on queues must not compare fields
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    seq: SequencePages
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    emitted: int = 0  # output tokens already reported by step()

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
    finished: int = 0
    aborted: int = 0


class Engine:
    """Continuous-batching generation over one model on one mesh."""

    def __init__(self, model: ShardedModel, config: EngineConfig = EngineConfig(), tokenizer: Tokenizer | None = None):
        config.validate()
        self.model, self.config = model, config
        self.cfg = model.cfg
        self.tokenizer = tokenizer or ByteTokenizer()
        max_pages_per_seq = -(-config.max_model_len // config.page_size)
        num_pages = config.num_pages
        if num_pages is None and config.kv_memory_bytes is None:
            num_pages = config.max_seqs * max_pages_per_seq
        self.pool_spec = pool_spec(self.cfg, config.page_size, num_pages=num_pages,
                                   memory_bytes=config.kv_memory_bytes)
        self.allocator = PageAllocator(self.pool_spec.num_pages)
        self.runner = Runner(model, self.pool_spec, max_seqs=config.max_seqs, max_pages_per_seq=max_pages_per_seq,
                             max_tokens_per_step=config.max_tokens_per_step, pages_per_block=config.pages_per_block)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queues a request; bad input raises RequestError/SamplingError and changes nothing."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        params.validate(self.cfg.vocab_size)
        if not ids:
            raise RequestError("prompt is empty")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.cfg.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token {bad} is {ids[bad]}, outside the vocabulary [0, {self.cfg.vocab_size})")
        limit = min(self.config.max_model_len, self.pool_spec.num_slots)
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"context limit of {limit} tokens")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests and not self.requests[rid].finish_reason:
            raise RequestError(f"request_id {rid!r} is already running")
        arrival = next(self._ids)
        seed = params.seed if params.seed is not None else hash((self.config.seed, rid, arrival)) & (2**63 - 1)
        req = _Request(rid, ids, params, seed, arrival, SequencePages(self.config.page_size))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request; its pages are freed and its partial output is returned."""
        req = self.requests.get(request_id)
        if req is None or req.finish_reason:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self.stats.aborted += 1
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def _preempt(self, req: _Request) -> None:
        req.seq.release(self.allocator)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _schedule(self) -> list[tuple[_Request, int]]:
        budget = self.config.max_tokens_per_step
        batch: list[tuple[_Request, int]] = []
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue  # preempted below as a victim, or no budget left
            n = min(req.num_tokens - req.num_computed, budget)
            while True:
                try:
                    req.seq.grow(self.allocator, req.num_computed + n)
                    break
                except OutOfPages:
                    scheduled = {id(r) for r, _ in batch}
                    victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                    self._preempt(victim)
                    if victim is req:
                        break
            if req in self.running:
                batch.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            try:
                req.seq.grow(self.allocator, n)
            except OutOfPages:
                break
            self.waiting.popleft()
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        return batch

    def step(self) -> list[RequestOutput]:
        """Runs one batched step; returns outputs of requests that produced tokens or finished."""
        batch = self._schedule()
        if not batch:
            return []
        total = sum(n for _, n in batch)
        b = self.runner.empty_batch(total)
        rows: list[_Request] = []
        t = 0
        max_pages = 0
        for i, (req, n) in enumerate(batch):
            pos = np.arange(req.num_computed, req.num_computed + n)
            b.tokens[t:t + n] = [req.token(p) for p in pos]
            b.positions[t:t + n] = pos
            b.seq[t:t + n] = i
            b.slots[t:t + n] = [req.seq.slot(p) for p in pos]
            b.page_tables[i, :len(req.seq.pages)] = req.seq.pages
            max_pages = max(max_pages, len(req.seq.pages))
            if req.num_computed + n == req.num_tokens:  # this chunk ends the known tokens: sample the next one
                b.logits_idx[len(rows)] = t + n - 1
                b.sampling.set_row(len(rows), req.params, req.seed, len(req.output))
                rows.append(req)
            t += n
        b.num_blocks = -(-max_pages // self.runner.pages_per_block)
        out = self.runner.step(b)
        self.stats.steps += 1
        for req, n in batch:
            if req.num_computed + n > len(req.prompt):
                self.stats.decode_tokens += min(n, req.num_computed + n - len(req.prompt))
            self.stats.prefill_tokens += max(0, min(req.num_computed + n, len(req.prompt)) - req.num_computed)
            req.num_computed += n
        results = []
        for r, req in enumerate(rows):
            tok = int(out.tokens[r])
            req.output.append(tok)
            req.logprobs.append(float(out.logprobs[r]))
            if req.params.logprobs:
                k = req.params.logprobs
                req.top_logprobs.append({int(i): float(l) for i, l in zip(out.top_ids[r, :k], out.top_logprobs[r, :k])})
            reason = self._stop_reason(req, tok)
            if reason:
                self._finish(req, reason)
            results.append(self._output(req))
        return results

    def _stop_reason(self, req: _Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.cfg.eos_token_id):
            return "stop"
        if len(req.output) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, req: _Request, reason: str) -> None:
        req.finish_reason = reason
        req.seq.release(self.allocator)
        if req in self.running:
            self.running.remove(req)
        self.stats.finished += 1

    def _output(self, req: _Request) -> RequestOutput:
        new = req.output[req.emitted:]
        req.emitted = len(req.output)
        stops = set(req.params.stop_token_ids) | ({self.cfg.eos_token_id} if not req.params.ignore_eos else set())
        text_ids = req.output[:-1] if req.finish_reason == "stop" and req.output and req.output[-1] in stops \
            else req.output
        return RequestOutput(req.id, list(req.prompt), list(req.output), self.tokenizer.decode(text_ids),
                             list(req.logprobs), list(req.top_logprobs), req.finish_reason, new)

    # ---- library API ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams(), progress: bool = True) -> list[RequestOutput]:
        """Runs all prompts to completion; outputs in prompt order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(rids), desc="generate", disable=not progress or len(rids) < 2, leave=False) as bar:
            while len(done) < len(rids) and self.has_unfinished():
                for o in self.step():
                    if o.finished and o.request_id in rids:
                        done[o.request_id] = o
                        bar.update(1)
        for rid in rids:  # requests finished outside step() (e.g. aborted)
            done.setdefault(rid, self._output(self.requests[rid]))
        return [done[r] for r in rids]

    def stream(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yields this request's output each time it gains tokens (other requests advance too)."""
        rid = self.add_request(prompt, params, request_id)
        req = self.requests[rid]
        while not req.finish_reason:
            for o in self.step():
                if o.request_id == rid:
                    yield o
            if not self.has_unfinished() and not req.finish_reason:
                break
        if req.emitted < len(req.output) or req.finish_reason == "abort":
            yield self._output(req)
