"""The engine's scheduler half on a fake runner: admission, the chunked-prefill budget, preemption and
resume, prefix and host admission, the draft budget, abort. No model, no array, no compile: a fake
runner answers each plan with hand-built draws, and a JAX compile listener checks none happens."""
import dataclasses

import jax
import numpy as np
import pytest

from talaria_jax.engine.plan import Drawn, StepPlan, StepResult
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.engine_scheduler import EngineScheduler, Limits, Request
from talaria_jax.engine.spec.suffix import Draft
from talaria_jax.kvcache.allocator import PageAllocator, SequencePages
from talaria_jax.kvcache.prefix import PrefixCache

VOCAB = 1000
PAGE = 4

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.fixture(autouse=True)
def compiles_nothing():
    before = len(_compiles)
    yield
    assert len(_compiles) == before, "a scheduling test compiled a program"


def token_at(seed: int, step: int) -> int:
    """The fake runner's draw: a function of the request's seed and output index only, as a seeded
    sample is, so a preempted request that is recomputed draws the same tokens."""
    return (seed * 31 + step * 7) % (VOCAB - 1) + 1  # never 0, the fake EOS


class FakeRunner:
    """Executes plans without a model: checks each chunk brings exactly the tokens its request has
    not computed (nothing lost, nothing twice), keeps the KV it 'writes' by page slot, and draws
    `token_at`. `accept[request_id]`: draft tokens to accept at that request's verifying steps."""

    def __init__(self, sched: EngineScheduler):
        self.sched, self.steps, self.accept = sched, 0, {}
        self.kv: dict[int, tuple[str, int]] = {}  # slot -> (tenant salt, token) written there

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.num_tokens <= self.sched.limits.max_tokens_per_step
        assert len(plan.chunks) <= self.sched.limits.max_seqs
        self.steps += 1
        drawn = {}
        for c in plan.chunks:
            req = self.sched.requests[c.request_id]
            known = req.known_tokens()
            assert c.tokens == known[c.start:c.start + len(c.tokens)], "a chunk brings the wrong tokens"
            assert len(c.pages) * PAGE >= c.start + c.num_tokens, "a chunk's pages do not hold its tokens"
            if c.restore is not None:  # the engine scatters the host copy in before the step
                for p in range(c.restore.skip * PAGE, c.restore.kv.num_tokens):
                    self.kv[c.pages[p // PAGE] * PAGE + p % PAGE] = (req.cache_salt, c.restore.kv.token_ids[p])
            for p in range(c.start):  # the KV before the chunk is there: computed, cached or restored
                slot = c.pages[p // PAGE] * PAGE + p % PAGE
                assert self.kv.get(slot) == (req.cache_salt, known[p]), f"{c.request_id}: KV of token {p} missing"
            for i, tok in enumerate(c.tokens):
                p = c.start + i
                self.kv[c.pages[p // PAGE] * PAGE + p % PAGE] = (req.cache_salt, tok)
            if c.sample is None:
                continue
            first = token_at(c.sample.seed, c.sample.step)
            if c.draft is None:
                toks = [first]
                kept = 0
            else:
                a = min(self.accept.get(c.request_id, 0), len(c.draft))
                toks = [int(t) for t in c.draft.tokens[:a]] + [first]
                kept = a
                for j in range(a):  # accepted chain nodes hold their KV in place
                    p = c.start + len(c.tokens) + j
                    self.kv[c.pages[p // PAGE] * PAGE + p % PAGE] = (req.cache_salt, toks[j])
            n = len(toks)
            drawn[c.request_id] = Drawn(np.array(toks, np.int32), np.zeros(n, np.float32), np.zeros((n, 1), np.int32),
                                        np.zeros((n, 1), np.float32), kept)
        return StepResult(drawn, 0.0, plan.num_tokens)


@dataclasses.dataclass
class FakeHostKV:
    token_ids: tuple[int, ...]
    num_pages: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class FakeHost:
    def __init__(self):
        self.offloads, self.gone = [], set()

    def usable(self, kv) -> bool:
        return id(kv) not in self.gone

    def offload(self, pages, tokens, session):
        self.offloads.append((tuple(pages), tokens, session))
        return FakeHostKV(tuple(tokens), -(-len(tokens) // PAGE))


def make(num_pages=64, max_seqs=4, budget=16, max_len=256, prefix=False, host=None):
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, PAGE) if prefix else None
    sched = EngineScheduler(Limits(max_seqs, budget, max_len), alloc, PAGE, prefix_cache=cache, host=host,
                            eos_ids=(0,))
    return sched, FakeRunner(sched)


def add(sched, prompt, max_tokens=8, rid=None, **kw) -> Request:
    req = Request(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens), SequencePages(PAGE), **kw)
    sched.enqueue(req)
    return req


def step(sched, runner, drafts=None) -> StepPlan:
    plan = sched.schedule(drafts)
    if plan:
        sched.update(plan, runner.execute(plan))
    return plan


def run(sched, runner, limit=1000) -> int:
    n = 0
    while sched.has_work():
        step(sched, runner)
        n += 1
        assert n < limit
    return n


def expected(req: Request) -> list[int]:
    return [token_at(req.seed, i) for i in range(req.params.max_tokens)]


def test_admission_stops_at_max_seqs_and_the_token_budget():
    sched, runner = make(max_seqs=2, budget=16)
    reqs = [add(sched, range(1, 6)) for _ in range(3)]
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == [reqs[0].id, reqs[1].id]  # max_seqs
    assert [len(c.tokens) for c in plan.chunks] == [5, 5] and plan.chunks[0].sample is not None
    assert list(sched.waiting) == [reqs[2]]
    sched.update(plan, runner.execute(plan))
    run(sched, runner)
    assert [r.output for r in reqs] == [expected(r) for r in reqs]
    assert sched.allocator.num_free == sched.allocator.num_pages and not sched.requests


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes():
    sched, runner = make(budget=16)
    short = add(sched, range(1, 4), max_tokens=20)
    step(sched, runner)  # short prefilled, decoding from here on
    long = add(sched, range(1, 41), max_tokens=2)
    sizes = []
    while long.num_computed < len(long.prompt):
        plan = step(sched, runner)
        chunk = next(c for c in plan.chunks if c.request_id == long.id)
        assert any(c.request_id == short.id and len(c.tokens) == 1 for c in plan.chunks)  # decode goes on
        assert plan.num_tokens <= 16
        sizes.append(len(chunk.tokens))
        assert (chunk.sample is not None) == (long.num_computed == len(long.prompt))
    assert sizes == [15, 15, 10]  # the budget less the decode token
    run(sched, runner)
    assert short.output == expected(short) and long.output == expected(long)


def test_preemption_requeues_the_newest_and_it_resumes_with_the_same_tokens():
    sched, runner = make(num_pages=6, max_seqs=4, budget=16)  # 24 token slots
    a = add(sched, range(1, 9), max_tokens=8)   # grows to 16 tokens: 4 pages
    b = add(sched, range(11, 19), max_tokens=8)  # the same: together more than 6 pages
    preempted = []
    while sched.has_work():
        plan = step(sched, runner)
        preempted += plan.preempted
    assert preempted and set(preempted) == {b.id}  # the newest goes back, not the oldest
    assert sched.stats.preemptions == len(preempted)
    assert a.output == expected(a) and b.output == expected(b)  # recomputed: same tokens, none lost or twice
    assert sched.allocator.num_free == 6


def test_prefix_admission_starts_after_the_cached_pages():
    sched, runner = make(prefix=True)
    first = add(sched, range(1, 14), max_tokens=4, cache_salt="t")
    run(sched, runner)
    # 13 prompt + 3 of 4 output tokens computed: 4 full pages cached
    prompt = (*first.prompt, *first.output, 500, 501)
    again = add(sched, prompt, max_tokens=2, cache_salt="t")
    other = add(sched, prompt, max_tokens=2, cache_salt="u")  # another tenant shares nothing
    plan = sched.schedule()
    starts = {c.request_id: c.start for c in plan.chunks}
    assert starts == {again.id: 16, other.id: 0}
    assert plan.prefix_hit_tokens == 16 and plan.prefix_query_tokens == 2 * (len(prompt) - 1)
    sched.update(plan, runner.execute(plan))  # the fake runner checks the cached pages hold the tokens
    run(sched, runner)
    assert again.output == expected(again) and other.output == expected(other)


def test_host_admission_restores_only_the_pages_past_a_device_hit():
    host = FakeHost()
    sched, runner = make(prefix=True, host=host)
    first = add(sched, range(1, 11), max_tokens=6, keep_kv=True, cache_salt="t", session="s")
    run(sched, runner)
    kv = first.kv
    assert kv.token_ids == (*first.prompt, *first.output[:-1]) and host.offloads[0][2] == "s"
    sched.prefix_cache.clear()  # the device copy is gone (a model switch): the host copy serves
    runner.kv.clear()
    nxt = add(sched, (*kv.token_ids, first.output[-1], 7), max_tokens=2, restore=kv, cache_salt="t")
    plan = sched.schedule()
    (c,) = plan.chunks
    assert c.restore is not None and c.restore.skip == 0 and c.start == kv.num_tokens == 15
    sched.update(plan, runner.execute(plan))
    assert sched.stats.restored_tokens == 15
    run(sched, runner)
    assert nxt.output == expected(nxt)
    # a host copy the device cache covers in part tops it up: the cached pages are skipped
    again = add(sched, (*nxt.prompt, *nxt.output, 9), max_tokens=1, restore=kv, cache_salt="t")
    plan = sched.schedule()
    (c,) = plan.chunks
    assert c.restore is None and c.start == 16  # the device cache holds more than the host copy
    sched.update(plan, runner.execute(plan))
    # an evicted host copy is dropped at admission: the prefix is recomputed, nothing is lost
    host.gone.add(id(kv))
    sched.prefix_cache.clear()
    runner.kv.clear()
    last = add(sched, (*kv.token_ids, 3, 4), max_tokens=1, restore=kv, cache_salt="t")
    plan = sched.schedule()
    assert plan.chunks[0].restore is None and plan.chunks[0].start == 0 and last.restore is None


def test_drafts_take_only_the_budget_later_requests_leave_and_never_preempt():
    sched, runner = make(num_pages=64, max_seqs=4, budget=8)
    reqs = [add(sched, range(1, 3), max_tokens=30) for _ in range(3)]
    step(sched, runner)  # all three prefilled: each decodes one token per step from here
    chain = lambda n: Draft(np.arange(100, 100 + n, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32),
                            np.ones(n, np.float32), float(n))
    plan = sched.schedule({reqs[0].id: chain(10), reqs[1].id: chain(10)})
    lens = [len(c.draft) if c.draft is not None else 0 for c in plan.chunks]
    # 8 tokens: the first takes 8 - 1 - 2 (two later decodes) = 5, the second what is left: 0
    assert lens == [5, 0, 0] and plan.num_tokens == 8
    runner.accept[reqs[0].id] = 3
    sched.update(plan, runner.execute(plan))
    assert reqs[0].output[-4:-1] == [100, 101, 102] and sched.stats.accepted_tokens == 3
    assert reqs[0].num_computed == reqs[0].num_tokens - 1  # accepted drafts' KV kept in place
    assert len(reqs[0].seq.pages) == -(-reqs[0].num_computed // PAGE)  # rejected drafts' pages freed
    # no free pages for a draft: it is dropped, and nobody is preempted to make room for it
    tight, runner2 = make(num_pages=2, max_seqs=2, budget=8)
    r = add(tight, range(1, 4), max_tokens=4)
    other = add(tight, range(1, 4), max_tokens=4)
    step(tight, runner2)  # one page each, and each still has room in its own
    plan = tight.schedule({r.id: chain(8)})
    assert plan.chunks[0].draft is None and not plan.preempted and tight.stats.preemptions == 0
    tight.update(plan, runner2.execute(plan))
    assert r.output == expected(r)[:2] and other.output == expected(other)[:2]


def test_abort_frees_pages_whether_waiting_or_running():
    sched, runner = make(max_seqs=1)
    running = add(sched, range(1, 9), max_tokens=20)
    waiting = add(sched, range(1, 9), max_tokens=20)
    step(sched, runner)
    assert sched.abort(waiting.id) is waiting and waiting.finish_reason == "abort"
    assert sched.abort(running.id) is running and not sched.running and not sched.waiting
    assert sched.abort(running.id) is None  # once
    assert sched.allocator.num_free == sched.allocator.num_pages and sched.stats.aborted == 2
    assert not sched.schedule()


def test_stop_token_and_length_limits():
    sched, runner = make(max_len=12)
    eos = add(sched, range(1, 4), max_tokens=10)
    long = add(sched, range(1, 9), max_tokens=10)
    runner_draw = token_at
    # the fake EOS (0) ends a request with "stop"; max_model_len ends another with "length"
    globals()["token_at"] = lambda seed, i: 0 if (seed == eos.seed and i == 2) else runner_draw(seed, i)
    try:
        run(sched, runner)
    finally:
        globals()["token_at"] = runner_draw
    assert eos.finish_reason == "stop" and len(eos.output) == 3 and eos.output[-1] == 0
    assert long.finish_reason == "length" and long.num_tokens == 12


def test_lost_kv_requeues_running_requests_in_order():
    sched, runner = make(max_seqs=3)
    reqs = [add(sched, range(1, 6), max_tokens=6) for _ in range(3)]
    step(sched, runner)
    step(sched, runner)
    sched.requeue_all()
    runner.kv.clear()  # the buffer is gone
    assert list(sched.waiting) == reqs and all(r.num_computed == 0 for r in reqs)
    run(sched, runner)
    assert [r.output for r in reqs] == [expected(r) for r in reqs]
