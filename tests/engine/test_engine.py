"""The paged engine against the full-sequence reference; donation, warm-up and recompiles, preemption, abort,
seeds, who reports which request, input checks, host KV identity."""
import contextlib
import dataclasses
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig, RequestError, StepError
from talaria_jax.engine.sampling import SamplingError, SamplingParams
from talaria_jax.kvcache.pool import buffer_pointers, pool_spec, read_pages
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.models.model import forward
from talaria_jax.sharding import make_mesh

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def config(**kw) -> EngineConfig:
    """An EngineConfig without warm-up: most tests build small engines to test other things, and
    warming each up would compile every step shape (test_warm_engine_* test warm-up)."""
    return EngineConfig(**{"warmup": False, **kw})


def prompts(seed=0, lengths=(3, 17, 40, 9, 26)):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 256, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def dense1():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)


@pytest.fixture(scope="module")
def reference(dense1):
    return greedy_generate(dense1, prompts(), GREEDY.max_tokens)


@pytest.mark.parametrize("page_size,chunk,ppb,tile", [(4, 16, 2, 4), (16, 64, 1, 16), (8, 32, 4, 1), (8, 32, 2, 5)])
def test_greedy_matches_full_forward(dense1, reference, page_size, chunk, ppb, tile):
    eng = Engine(dense1, config(page_size=page_size, max_seqs=4, max_tokens_per_step=chunk, max_model_len=128,
                                      pages_per_block=ppb, query_tile=tile))
    outs = eng.generate(prompts(), GREEDY, progress=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_compiler_options_are_the_steps_xla_options(dense1, reference):
    """EngineConfig.compiler_options reach the compiled steps: an option XLA does not know fails the
    first step, naming it; LLVM at -O2 (the process runs at -O0) gives the same tokens."""
    with pytest.raises(ValueError, match="EngineConfig.compiler_options must be a dict"):
        EngineConfig(compiler_options=["xla_backend_optimization_level"]).validate()
    kw = dict(page_size=8, max_seqs=5, max_tokens_per_step=32, max_model_len=128)
    optimized = Engine(dense1, config(**kw, compiler_options={"xla_backend_optimization_level": 2}))
    assert [o.token_ids for o in optimized.generate(prompts(), GREEDY, progress=False)] == reference
    unknown = Engine(dense1, config(**kw, compiler_options={"xla_no_such_option": 1}))
    with pytest.raises(Exception, match="xla_no_such_option"):
        unknown.generate(prompts()[:1], GREEDY, progress=False)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_greedy_on_tp8_mesh(name):
    cfg = load_model_config(name)
    one = init_model(cfg, make_mesh(jax.devices()[:1]), seed=2)
    eight = init_model(cfg, make_mesh(jax.devices(), tp=8), seed=2)
    ps = prompts(3, (5, 33, 12))
    ref = greedy_generate(one, ps, 8)
    eng = Engine(eight, config(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    out = eng.generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), progress=False)
    assert [o.token_ids for o in out] == ref
    assert len(eng.runner.kv.addressable_shards) == 8  # the pool lives on all 8 devices


def _steady(eng, steps, rng, sessions=False):
    """Keeps ~6 requests of mixed lengths in flight for `steps` steps. sessions: every third request
    keeps its KV, and its next turn (+ a few tokens) restores it from host memory."""
    turns = []

    def params():
        return SamplingParams(max_tokens=int(rng.randint(1, 20)), temperature=float(rng.choice([0, 0.8])),
                              top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])), ignore_eos=True)

    for _ in range(steps):
        while len(eng.waiting) + len(eng.running) < 6:
            if turns:
                kv, prompt = turns.pop()
                eng.add_request(prompt + rng.randint(0, 256, int(rng.randint(1, 9))).tolist(), params(), restore=kv)
            else:
                n = int(rng.randint(1, 40))
                eng.add_request(rng.randint(0, 256, n).tolist(), params(), keep_kv=sessions and rng.rand() < 1 / 3)
        for o in eng.step():
            if o.finished and o.kv is not None:
                turns.append((o.kv, list(o.prompt_token_ids) + o.token_ids))


def test_pool_buffers_stable_and_donation_usable():
    # TP=4: 4 kv heads split over 4 devices, so every device holds its own shard of each page.
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:4], tp=4), seed=1)
    eng = Engine(model, config(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128))
    pages = read_pages(eng.runner.kv, eng.pool_spec, model.mesh, np.arange(2))
    assert pages.sharding.spec[3] == "tp" and pages.addressable_shards[0].data.shape[3] == 1
    before = buffer_pointers(eng.runner.kv)
    assert len(before) == 4  # one buffer per device, every layer's K and V in it
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        _steady(eng, 100, np.random.RandomState(0))
    assert eng.stats.steps == 100
    assert buffer_pointers(eng.runner.kv) == before


@contextlib.contextmanager
def lowerings():
    """Names of the programs JAX lowers (every new compile, persistent-cache hits included) meanwhile."""
    names = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_warm_engine_compiles_nothing_more(dense1):
    # warm-up is on by default: every step shape (7 token buckets, plus tiles of 8 from 16 tokens) and
    # the host tier's gather and scatter for 1, 2, 4, 8 and 16 pages (max_model_len 128 in pages of 8)
    eng = Engine(dense1, EngineConfig(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128,
                                      query_tile=8))
    steps, copies = eng.runner.compilations, eng.host_tier.compilations
    assert steps == len(eng.runner.step_shapes()) > len(eng.runner.buckets)
    assert copies == 2 * 5
    with lowerings() as new:
        _steady(eng, 200, np.random.RandomState(1), sessions=True)
    assert eng.stats.offloaded_tokens > 0 and eng.stats.restored_tokens > 0
    assert (eng.runner.compilations, eng.host_tier.compilations, new) == (steps, copies, [])


def test_small_pool_preempts_and_completes(dense1, reference):
    # 16 pages of 4 tokens (64 slots): the 5 prompts (95 tokens + 60 new) cannot all fit at once.
    eng = Engine(dense1, config(page_size=4, num_pages=16, max_seqs=5, max_tokens_per_step=32,
                                      max_model_len=64, pages_per_block=2))
    outs = eng.generate(prompts(), GREEDY, progress=False)
    assert eng.stats.preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert eng.allocator.num_free == 16


def test_abort_frees_pages(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=128))
    keep = eng.add_request(prompts()[1], GREEDY)
    gone = eng.add_request(prompts()[2], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    held = len(eng.requests[gone].seq.pages)
    assert held > 0
    free_before = eng.allocator.num_free
    out = eng.abort(gone)
    assert out.finish_reason == "abort" and len(out.token_ids) >= 1
    assert eng.allocator.num_free == free_before + held
    finished = {}
    while eng.has_unfinished():
        finished.update({o.request_id: o.finish_reason for o in eng.step() if o.finished})
    assert finished == {keep: "length"} and eng.stats.aborted == 1
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_seeded_request_same_alone_and_in_batch(dense1):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    cfg = config(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128)
    alone = Engine(dense1, cfg).generate([prompts()[2]], p, progress=False)[0].token_ids
    others = [SamplingParams(max_tokens=7, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    batch = Engine(dense1, cfg).generate(prompts()[:2] + [prompts()[2]] + prompts()[3:], others[:2] + [p] + others[2:],
                                         progress=False)
    assert batch[2].token_ids == alone
    unseeded = Engine(dense1, cfg).generate([prompts()[2]] * 2, SamplingParams(max_tokens=10, ignore_eos=True),
                                            progress=False)
    assert len({tuple(o.token_ids) for o in unseeded}) == 2  # different requests, different draws


def test_bad_requests_are_rejected_and_engine_keeps_going(dense1):
    eng = Engine(dense1, config(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=64))
    eng.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match="context limit of 64"):
        eng.add_request(list(range(60)), GREEDY)
    with pytest.raises(RequestError, match=r"prompt token 1 is 9999, outside the vocabulary \[0, 512\)"):
        eng.add_request([1, 9999], GREEDY)
    with pytest.raises(SamplingError, match="max_tokens must be >= 1"):
        eng.add_request([1], SamplingParams(max_tokens=0))
    with pytest.raises(SamplingError, match="top_p"):
        eng.add_request([1], SamplingParams(top_p=0.0))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.finished == 1 and not eng.requests  # finished requests leave once reported
    with pytest.raises(RequestError, match=r"prompt 1: prompt token 0 is 9999"):
        eng.generate([[1, 2], [9999]], GREEDY, progress=False)
    assert not eng.waiting and not eng.requests  # nothing of the failed batch was queued
    with pytest.raises(RequestError, match="prompt token 1 is 1.5, not an integer"):
        eng.add_request([1, 1.5], GREEDY)


def test_sampled_seeded_requests_survive_preemption(dense1):
    ps = prompts(5, (9, 14, 22, 5, 17))
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True) for i in range(5)]
    roomy = Engine(dense1, config(page_size=4, max_seqs=5, max_tokens_per_step=32, max_model_len=64))
    tight = Engine(dense1, config(page_size=4, num_pages=12, max_seqs=5, max_tokens_per_step=32,
                                        max_model_len=48))
    want = [o.token_ids for o in roomy.generate(ps, params, progress=False)]
    got = [o.token_ids for o in tight.generate(ps, params, progress=False)]
    assert tight.stats.preemptions > 0 and got == want


def test_sliding_window_layers_match_reference():
    cfg = load_model_config("tiny-dense").replace(sliding_windows=(6, 0, 6, 0))
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=5)
    ps = prompts(6, (4, 19, 11))
    ref = greedy_generate(model, ps, 8)
    eng = Engine(model, config(page_size=4, max_seqs=3, max_tokens_per_step=16, max_model_len=64))
    assert [o.token_ids for o in eng.generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                              progress=False)] == ref


def test_failed_step_requeues_everything_and_recovers(dense1, reference):
    eng = Engine(dense1, config(page_size=8, max_seqs=5, max_tokens_per_step=32, max_model_len=128))
    for p in prompts():
        eng.add_request(p, GREEDY)
    for _ in range(3):
        eng.step()
    def broken(plan):
        eng.before_step = None
        raise RuntimeError("injected device failure")

    eng.before_step = broken
    with pytest.raises(StepError, match="injected device failure"):
        eng.step()
    assert not eng.running and len(eng.waiting) == 5 and eng.allocator.num_free == eng.allocator.num_pages
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [outs[f"req-{i}"] for i in range(5)] == reference


def test_extra_eos_ids_stop(dense1):
    first = greedy_generate(dense1, [prompts()[0]], 1)[0][0]
    model = dataclasses.replace(dense1, cfg=dense1.cfg.replace(eos_token_id=None, extra_eos_token_ids=(first,)))
    eng = Engine(model, config(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    out = eng.generate([prompts()[0]], SamplingParams(max_tokens=5, temperature=0.0), progress=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == [first] and out.text == ""


def test_unseeded_sampling_is_reproducible_across_engines(dense1):
    cfg = config(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64, seed=3)
    p = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    a = Engine(dense1, cfg).generate([prompts()[0]], p, progress=False)[0].token_ids
    b = Engine(dense1, cfg).generate([prompts()[0]], p, progress=False)[0].token_ids
    assert a == b


def test_kv_budget_is_per_device():
    cfg = load_model_config("tiny-dense")
    one = pool_spec(cfg, 8, make_mesh(jax.devices()[:1]), memory_bytes_per_device=1 << 20)
    four = pool_spec(cfg, 8, make_mesh(jax.devices()[:4], tp=4), memory_bytes_per_device=1 << 20)
    eight = pool_spec(cfg, 8, make_mesh(jax.devices(), tp=8), memory_bytes_per_device=1 << 20)
    assert four.num_pages == 4 * one.num_pages  # kv heads split 4 ways
    assert eight.num_pages == one.num_pages  # 4 kv heads on 8 ranks: replicated, whole pages per device
    with pytest.raises(ValueError, match="holds no page"):
        pool_spec(cfg, 8, make_mesh(jax.devices()[:1]), memory_bytes_per_device=10)


def test_runner_returns_logits_at_the_rows_asked_for(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    p0, p1 = prompts()[0], prompts()[3]
    b = eng.runner.empty_batch(len(p0) + len(p1))
    for i, (p, pages) in enumerate(((p0, [0, 1]), (p1, [2, 3, 4]))):
        off = 0 if i == 0 else len(p0)
        b.tokens[off:off + len(p)] = p
        b.positions[off:off + len(p)] = np.arange(len(p))
        b.seq[off:off + len(p)] = i
        b.slots[off:off + len(p)] = [pages[j // 4] * 4 + j % 4 for j in range(len(p))]
        b.page_tables[i, :len(pages)] = pages
    b.num_blocks = 2
    b.logits_idx[:2] = [1, len(p0) + len(p1) - 1]  # an inner position of p0, the last of p1
    out = eng.runner.step(b)
    full0 = np.asarray(forward(dense1, np.asarray([p0])))[0]
    full1 = np.asarray(forward(dense1, np.asarray([p1])))[0]
    np.testing.assert_allclose(np.asarray(out.logits[0]), full0[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logits[1]), full1[-1], rtol=1e-5, atol=1e-5)


def test_streamed_outputs_are_snapshots_with_lazy_text(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    outs = list(eng.stream(prompts()[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert all(o.prompt_token_ids == tuple(prompts()[0]) for o in outs)
    # text is decoded only now, after the generation went on: each output still decodes its own tokens
    assert [len(o.text_token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert [o.text for o in outs] == [eng.tokenizer.decode(o.token_ids) for o in outs]


def test_session_kv_restored_from_host_matches_recompute(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=3, max_tokens_per_step=32, max_model_len=96))
    turn1 = prompts()[2]  # 40 tokens
    rid = eng.add_request(turn1, GREEDY, keep_kv=True)
    while eng.has_unfinished():
        outs = {o.request_id: o for o in eng.step()}
    first = outs[rid]
    kv = first.kv
    assert kv is not None and kv.token_ids == tuple(turn1) + tuple(first.token_ids[:-1])  # the last has no KV yet
    assert eng.allocator.num_free == eng.allocator.num_pages  # the device pages went back to the pool
    eng.generate(prompts(seed=5), GREEDY, progress=False)  # other work overwrites those pages
    turn2 = list(turn1) + first.token_ids + prompts(seed=9, lengths=(7,))[0]  # + a tool observation
    before = eng.stats.prefill_tokens
    rid2 = eng.add_request(turn2, GREEDY, restore=kv)
    while eng.has_unfinished():
        outs = {o.request_id: o for o in eng.step()}
    assert eng.stats.restored_tokens == kv.num_tokens
    assert eng.stats.prefill_tokens - before == len(turn2) - kv.num_tokens  # only the new tokens were computed
    assert outs[rid2].token_ids == greedy_generate(dense1, [turn2], GREEDY.max_tokens)[0]


def test_bad_restore_is_rejected(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=96))
    out = eng.generate([prompts()[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), progress=False)
    assert out[0].kv is None  # only keep_kv requests pay for the copy
    rid = eng.add_request(prompts()[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), keep_kv=True)
    while eng.has_unfinished():
        done = {o.request_id: o for o in eng.step()}
    kv = done[rid].kv  # 3 prompt tokens + 2 outputs
    p = list(kv.token_ids)
    with pytest.raises(RequestError, match="differs from the restored prefix at token 1"):
        eng.add_request([p[0], (p[1] + 1) % 256] + p[2:] + [1], GREEDY, restore=kv)
    with pytest.raises(RequestError, match="must extend it by at least one"):
        eng.add_request(p, GREEDY, restore=kv)
    with pytest.raises(RequestError, match="restore must be a HostKV"):
        eng.add_request(p + [1], GREEDY, restore="kv")
    with pytest.raises(RequestError, match="must hold 1 pages of 4, holds 2"):
        eng.add_request(p + [1], GREEDY, restore=dataclasses.replace(kv, token_ids=kv.token_ids[:3]))
    assert not eng.has_unfinished() and eng.stats.restored_tokens == 0
    # the rejected requests took nothing: the next one gets the arrival (and default seed) it would have
    assert eng.add_request(p + [1], GREEDY) == "req-2"


def test_failed_host_copies_lose_nothing(dense1, reference, monkeypatch):
    eng = Engine(dense1, config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=96))
    rid = eng.add_request(prompts()[0], GREEDY, keep_kv=True)
    other = eng.add_request(prompts()[1], GREEDY)
    kv = None
    with monkeypatch.context() as m:
        m.setattr(eng.host_tier, "offload", lambda *a: (_ for _ in ()).throw(MemoryError("pinned host memory")))
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[rid].kv is None and eng.stats.offload_failures == 1  # finished, without its KV
    assert [done[rid].token_ids, done[other].token_ids] == reference[:2]
    rid = eng.add_request(prompts()[0], GREEDY, keep_kv=True)
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    kv = done[rid].kv
    turn2 = list(kv.token_ids) + done[rid].token_ids[-1:] + [7, 8, 9]
    with monkeypatch.context() as m:  # a restore that fails on the device: one StepError, then a recompute
        m.setattr(eng.host_tier, "restore", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("H2D copy failed")))
        r2 = eng.add_request(turn2, GREEDY, restore=kv)
        with pytest.raises(StepError, match="H2D copy failed"):
            eng.step()
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.stats.step_failures == 1 and eng.stats.restored_tokens == 0
    assert done[r2].token_ids == greedy_generate(dense1, [turn2], GREEDY.max_tokens)[0]


def test_restored_request_restores_again_after_preemption(dense1):
    big = Engine(dense1, config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=96))
    turn1 = prompts()[2]
    rid = big.add_request(turn1, GREEDY, keep_kv=True)
    while big.has_unfinished():
        outs = {o.request_id: o for o in big.step()}
    kv = outs[rid].kv  # 51 tokens in 13 pages of 4
    turn2 = list(turn1) + outs[rid].token_ids + prompts(seed=9, lengths=(7,))[0]
    # 24 pages: the fresh request (7 pages at first) and the restored one (15) fit at admission, not
    # while both decode (10 + 18 pages), so the newest, the restored one, is preempted and restores again
    eng = Engine(dense1, config(page_size=4, num_pages=24, max_seqs=2, max_tokens_per_step=64, max_model_len=96))
    fresh = eng.add_request(prompts()[4], GREEDY)
    rest = eng.add_request(turn2, GREEDY, restore=kv)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.stats.preemptions >= 1 and eng.stats.restored_tokens == 2 * kv.num_tokens
    ref = greedy_generate(dense1, [prompts()[4], turn2], GREEDY.max_tokens)
    assert [done[fresh].token_ids, done[rest].token_ids] == ref


def test_generate_and_stream_keep_the_outputs_of_step_requests(dense1):
    # generate() and a stream step the shared engine; the add_request requests they advance must
    # reach the next step() calls: one finishes meanwhile (short), one goes on after (long)
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    short = eng.add_request(prompts()[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    long = eng.add_request(prompts()[3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    mine = eng.generate([prompts()[1]], GREEDY, progress=False)[0]
    assert mine.finished and eng.requests[long].output  # the long one advanced during generate()
    streamed = list(eng.stream(prompts()[4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    assert streamed[-1].finished
    reported = {short: [], long: []}
    while eng.has_unfinished():
        for o in eng.step():
            reported[o.request_id].append(o)  # only add_request requests: a KeyError otherwise
    assert not eng.step()  # everything was handed out once
    for rid in (short, long):
        outs = reported[rid]
        assert outs, f"{rid}'s outputs were lost"
        final = outs[-1]
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert [o.finished for o in outs].count(True) == 1 and final.finish_reason == "length"
    assert len(reported[long][-1].token_ids) == 30 and len(reported[short][-1].token_ids) == 3


def test_step_request_finished_during_generate_keeps_has_unfinished_true(dense1):
    # the usual `while has_unfinished(): step()` loop must still collect a request that finished while
    # generate() drove the engine and nothing else is left to run
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    short = eng.add_request(prompts()[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.generate([prompts()[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), progress=False)
    assert eng.has_unfinished()
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == [short] and outs[0].finished and len(outs[0].token_ids) == 2


def test_unstarted_stream_closed_or_dropped_aborts_its_request(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    s = eng.stream(prompts()[0], params)
    s.close()  # before its first item
    assert not eng.requests and not eng.has_unfinished()
    eng.stream(prompts()[1], params)  # dropped at once
    import gc

    gc.collect()
    assert not eng.requests and eng.stats.aborted == 2


def test_failed_generate_leaves_no_request_running_unreported(dense1, monkeypatch):
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    keep = eng.add_request(prompts()[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    calls = {"n": 0}
    real = eng.runner.step

    def flaky(b):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(b)

    monkeypatch.setattr(eng.runner, "step", flaky)
    with pytest.raises(StepError):
        eng.generate(prompts()[1:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), progress=False)
    assert list(eng.requests) == [keep]  # generate()'s own requests were aborted, the step request survives
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].request_id == keep and outs[-1].finished and len(outs[-1].token_ids) == 4


def test_step_request_aborted_after_others_stepped_reports_the_rest(dense1):
    eng = Engine(dense1, config(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    rid = eng.add_request(prompts()[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    first = eng.step()
    eng.generate([prompts()[1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), progress=False)
    last = eng.abort(rid)
    assert last.finish_reason == "abort" and first[0].new_token_ids + last.new_token_ids == last.token_ids
    assert not eng.step()


def test_restore_refuses_kv_of_other_weights_or_layout(dense1):
    other = init_model(dense1.cfg, dense1.mesh, seed=2)  # same config and shapes, other weights
    assert other.fingerprint != dense1.fingerprint
    cfg = config(page_size=4, max_seqs=2, max_tokens_per_step=32, max_model_len=96)
    eng = Engine(dense1, cfg)
    rid = eng.add_request(prompts()[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), keep_kv=True)
    while eng.has_unfinished():
        done = {o.request_id: o for o in eng.step()}
    kv = done[rid].kv
    turn2 = list(kv.token_ids) + done[rid].token_ids[-1:] + [7, 8]
    with pytest.raises(RequestError, match=f"weights '{dense1.fingerprint}' vs '{other.fingerprint}'"):
        Engine(other, cfg).add_request(turn2, GREEDY, restore=kv)
    with pytest.raises(RequestError, match="page_size 4 vs 8"):
        Engine(dense1, dataclasses.replace(cfg, page_size=8)).add_request(turn2, GREEDY, restore=kv)
    same = Engine(dense1, cfg)  # another engine over the same weights takes it
    rid = same.add_request(turn2, GREEDY, restore=kv)
    while same.has_unfinished():
        done = {o.request_id: o for o in same.step()}
    assert same.stats.restored_tokens == kv.num_tokens and len(done[rid].token_ids) == GREEDY.max_tokens


def _gen(x):
    yield from x


BAD_PROMPTS = [5, None, 1.5, b"\x01\x02", bytearray(b"\x01"), {1, 2}, {1: 2}, _gen([1, 2]), np.array([1.0, 2.0]),
               np.array([[1, 2]]), np.int64(3), [1, True], [1, 2.0], ["a"]]
BAD_PARAMS = [  # (params, field named in the error)
    (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(max_tokens="4"), "max_tokens"),
    (dict(top_k=2.7), "top_k"), (dict(top_k=False), "top_k"), (dict(temperature="0.5"), "temperature"),
    (dict(temperature=None), "temperature"), (dict(top_p="1"), "top_p"), (dict(seed=1.0), "seed"),
    (dict(seed=True), "seed"), (dict(logprobs=2.0), "logprobs"), (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
    (dict(stop_token_ids=(True,)), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(temperature=float("nan")), "temperature"),
]


def test_a_checked_request_is_taken_as_it_is_by_its_engine_only(dense1, monkeypatch):
    """`check_request` checks once: the engine that checked a request queues it without checking it
    again (its params validated once), other params for the same prompt check the params alone, and
    any other engine, whose limits may differ, checks it whole."""
    eng = Engine(dense1, config(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    small = Engine(dense1, config(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=16))
    validate, seen = SamplingParams.validate, []
    monkeypatch.setattr(SamplingParams, "validate", lambda p, vocab: (seen.append(p), validate(p, vocab))[1])
    checked = eng.check_request(np.arange(1, 9), GREEDY)
    assert checked.prompt == tuple(range(1, 9)) and checked.params is GREEDY and len(seen) == 1
    assert eng.check_request(checked) is checked and len(seen) == 1
    rid = eng.add_request(checked, None, "c")
    assert len(seen) == 1 and eng.requests[rid].prompt is checked.prompt
    other = eng.check_request(checked, dataclasses.replace(GREEDY, seed=3))
    assert other.prompt is checked.prompt and other.params.seed == 3 and len(seen) == 2
    with pytest.raises(RequestError, match="exceeds the context limit of 16"):
        small.add_request(checked, None)  # checked by another engine: checked again
    with pytest.raises(RequestError, match="exceeds the context limit of 64"):  # a copy is no engine's check
        eng.add_request(dataclasses.replace(checked, params=dataclasses.replace(GREEDY, max_tokens=60)), None)
    mixed = eng.check_request([np.uint64(1), np.int64(2), 3], GREEDY)  # no common int dtype: each an int
    assert mixed.prompt == (1, 2, 3) and all(type(t) is int for t in mixed.prompt)
    with pytest.raises(RequestError, match="exceeds the context limit of 64"):
        eng.check_request(checked, dataclasses.replace(GREEDY, max_tokens=60))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].request_id == "c" and outs[-1].token_ids == greedy_generate(dense1, [list(range(1, 9))], 12)[0]


def test_loose_input_is_a_request_error_and_queues_nothing(dense1):
    from talaria_jax.engine import RequestError as PublicRequestError, SamplingError as PublicSamplingError

    assert PublicRequestError is RequestError and issubclass(PublicSamplingError, RequestError)
    eng = Engine(dense1, config(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    for p in BAD_PROMPTS:
        for call in (lambda: eng.add_request(p, GREEDY), lambda: eng.generate([[1], p], GREEDY, progress=False),
                     lambda: eng.stream(p, GREEDY)):
            with pytest.raises(RequestError, match="prompt"):
                call()
    for kw, field in BAD_PARAMS:
        sp = SamplingParams(**kw)
        for call in (lambda: eng.add_request([1, 2], sp), lambda: eng.generate([[1]], [GREEDY, sp][1:], progress=False),
                     lambda: eng.stream([1, 2], sp)):
            with pytest.raises(SamplingError, match=field):
                call()
    loose = {"temperature": 0.0}  # a dict is not a SamplingParams (None is: the defaults)
    for call in (lambda: eng.add_request([1], loose), lambda: eng.generate([[1]], loose, progress=False),
                 lambda: eng.stream([1], loose), lambda: eng.generate([[1]], None, progress=False)):
        with pytest.raises(RequestError, match="params must be a SamplingParams"):
            call()
    with pytest.raises(RequestError, match="prompts must be a list or tuple"):
        eng.generate("hello", GREEDY, progress=False)
    with pytest.raises(RequestError, match="request_id must be a str"):
        eng.add_request([1], GREEDY, request_id=3)
    with pytest.raises(RequestError, match="keep_kv must be a bool"):
        eng.add_request([1], GREEDY, keep_kv="yes")
    assert not eng.has_unfinished() and not eng.requests and not eng.step()  # nothing was queued
    # valid: lists and tuples of ints (numpy ints too) and 1-D integer arrays; the first takes arrival 0
    assert eng.add_request(np.array([1, 2, 3], np.int32), GREEDY) == "req-0"
    eng.add_request((np.int64(4), 5), dataclasses.replace(GREEDY, max_tokens=np.int64(2), temperature=np.float32(0)))
    outs = eng.generate([[1, 2, 3], np.arange(4)], GREEDY, progress=False)
    assert all(o.finished for o in outs)


def test_max_model_len_beyond_the_models_positions_is_refused(dense1):
    with pytest.raises(ValueError, match=r"max_model_len \(8192\) exceeds tiny-dense's max_position \(4096\)"):
        Engine(dense1, config(max_model_len=8192))
