"""The paged engine against the full-sequence reference; donation, recompiles, preemption, abort, seeds."""
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig, RequestError
from talaria_jax.engine.sampling import SamplingError, SamplingParams
from talaria_jax.kvcache.pool import buffer_pointers
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.sharding import make_mesh

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(seed=0, lengths=(3, 17, 40, 9, 26)):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 256, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def dense1():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)


@pytest.fixture(scope="module")
def reference(dense1):
    return greedy_generate(dense1, prompts(), GREEDY.max_tokens)


@pytest.mark.parametrize("page_size,chunk,ppb", [(4, 16, 2), (16, 64, 1), (8, 32, 4)])
def test_greedy_matches_full_forward(dense1, reference, page_size, chunk, ppb):
    eng = Engine(dense1, EngineConfig(page_size=page_size, max_seqs=4, max_tokens_per_step=chunk, max_model_len=128,
                                      pages_per_block=ppb))
    outs = eng.generate(prompts(), GREEDY, progress=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_greedy_on_tp8_mesh(name):
    cfg = load_model_config(name)
    one = init_model(cfg, make_mesh(jax.devices()[:1]), seed=2)
    eight = init_model(cfg, make_mesh(jax.devices(), tp=8), seed=2)
    ps = prompts(3, (5, 33, 12))
    ref = greedy_generate(one, ps, 8)
    eng = Engine(eight, EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=96))
    out = eng.generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), progress=False)
    assert [o.token_ids for o in out] == ref
    k = eng.runner.kv[0][0]
    assert len(k.addressable_shards) == 8  # the pool lives on all 8 devices


def _steady(eng, steps, rng):
    """Keeps ~6 requests of mixed lengths in flight for `steps` steps."""
    for _ in range(steps):
        while len(eng.waiting) + len(eng.running) < 6:
            n = int(rng.randint(1, 40))
            eng.add_request(rng.randint(0, 256, n).tolist(),
                            SamplingParams(max_tokens=int(rng.randint(1, 20)), temperature=float(rng.choice([0, 0.8])),
                                           top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                                           ignore_eos=True))
        eng.step()


def test_pool_buffers_stable_and_donation_usable(dense1):
    eng = Engine(dense1, EngineConfig(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128))
    before = buffer_pointers(eng.runner.kv)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        _steady(eng, 100, np.random.RandomState(0))
    assert eng.stats.steps == 100
    assert buffer_pointers(eng.runner.kv) == before


def test_steady_workload_no_recompiles(dense1):
    eng = Engine(dense1, EngineConfig(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128))
    for n in eng.runner.buckets:  # warm-up: one step of every token bucket
        eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    warm = eng.runner.compilations
    assert warm == len(eng.runner.buckets)
    _steady(eng, 200, np.random.RandomState(1))
    assert eng.runner.compilations == warm


def test_small_pool_preempts_and_completes(dense1, reference):
    # 10 pages of 4 tokens: the 5 prompts (95 tokens + 60 new) cannot all fit at once.
    eng = Engine(dense1, EngineConfig(page_size=4, num_pages=16, max_seqs=5, max_tokens_per_step=32,
                                      max_model_len=64, pages_per_block=2))
    outs = eng.generate(prompts(), GREEDY, progress=False)
    assert eng.stats.preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert eng.allocator.num_free == 16


def test_abort_frees_pages(dense1):
    eng = Engine(dense1, EngineConfig(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=128))
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
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[keep].finish_reason == "length"
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_seeded_request_same_alone_and_in_batch(dense1):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    cfg = EngineConfig(page_size=8, max_seqs=6, max_tokens_per_step=64, max_model_len=128)
    alone = Engine(dense1, cfg).generate([prompts()[2]], p, progress=False)[0].token_ids
    others = [SamplingParams(max_tokens=7, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    batch = Engine(dense1, cfg).generate(prompts()[:2] + [prompts()[2]] + prompts()[3:], others[:2] + [p] + others[2:],
                                         progress=False)
    assert batch[2].token_ids == alone
    unseeded = Engine(dense1, cfg).generate([prompts()[2]] * 2, SamplingParams(max_tokens=10, ignore_eos=True),
                                            progress=False)
    assert len({tuple(o.token_ids) for o in unseeded}) == 2  # different requests, different draws


def test_bad_requests_are_rejected_and_engine_keeps_going(dense1):
    eng = Engine(dense1, EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=64))
    ok = eng.add_request([1, 2, 3], GREEDY)
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
    assert eng.requests[ok].finish_reason == "length" and len(eng.requests) == 1
