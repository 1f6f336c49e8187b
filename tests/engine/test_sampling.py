"""Sampling inside the jitted step: filters, seeds and logprobs; streaming."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingBatch, SamplingError, SamplingParams, filter_logits, order_keys, sample
from talaria_jax.models import init_model, load_model_config
from talaria_jax.models.model import forward
from talaria_jax.sharding import make_mesh


_sample = jax.jit(sample)


def run(logits, params, seed=7, step=0):
    b = SamplingBatch.empty(len(logits))
    for i in range(len(logits)):
        b.set_row(i, params, seed, step)
    return [np.asarray(x) for x in _sample(jnp.asarray(logits), b.temperature, b.top_k, b.top_p, b.seed, b.step)]


def test_filters_reduce_to_greedy():
    logits = np.random.RandomState(0).randn(64, 100).astype(np.float32) * 3
    greedy = logits.argmax(-1)
    assert (run(logits, SamplingParams(temperature=0.0))[0] == greedy).all()
    assert (run(logits, SamplingParams(temperature=1.0, top_k=1))[0] == greedy).all()
    assert (run(logits, SamplingParams(temperature=1.0, top_p=1e-6))[0] == greedy).all()
    assert not (run(logits, SamplingParams(temperature=1.0))[0] == greedy).all()


def test_top_k_and_top_p_support():
    logits = np.random.RandomState(1).randn(1, 50).astype(np.float32)
    top5 = set(np.argsort(-logits[0])[:5])
    draws = {int(run(logits, SamplingParams(temperature=2.0, top_k=5), seed=s)[0][0]) for s in range(200)}
    assert draws <= top5 and len(draws) > 2
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1])
    draws = {int(run(logits, SamplingParams(temperature=1.0, top_p=0.5), seed=s)[0][0]) for s in range(200)}
    assert draws <= nucleus


def sorted_reference(row: np.ndarray, k: int, top_p: float) -> tuple[np.ndarray, float]:
    """The top-k / top-p set of one row by a sort (float64 mass), and how near top_p the mass before
    any sorted value lies (a nearer one fp32 rounding can decide either way)."""
    order = np.argsort(-row, kind="stable")
    srt = row[order]
    k = min(k, len(row)) if k > 0 else len(row)
    p = np.exp(srt.astype(np.float64) - srt[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    kept = ((before < top_p) | (top_p >= 1.0)) & (np.arange(len(row)) < k)
    cutoff = max(srt[kept].min(), srt[k - 1])
    gap = np.abs(before[1:] - top_p).min(initial=np.inf) if top_p < 1.0 else np.inf  # before[0] is 0
    return row >= cutoff, gap


def test_filter_logits_keeps_the_sorted_reference_set():
    """The sort-free search keeps exactly the set a sort of the row keeps: top-k with ties, top-p,
    both, values at -inf (grammar masks), one-token vocabularies, rows of equal values and rows of
    neighbouring floats (where a search one bit short keeps one value too many)."""
    rng = np.random.RandomState(3)
    f = jax.jit(filter_logits)
    checked = 0
    for trial in range(120):
        v = int(rng.choice([1, 7, 100, 3000]))
        x = (rng.randn(8, v) * rng.choice([0.3, 3.0, 30.0])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x, 1)  # ties
        if trial % 4 == 0:
            x[:, : v // 2] = -np.inf
        if trial % 10 == 0:
            x[0] = 1.5  # a row of equal values
        if trial % 2 == 1:  # a row of neighbouring floats (one unit in the last place apart)
            x[1] = (np.float32(rng.randn()).view(np.int32) + rng.permutation(v).astype(np.int32)).view(np.float32)
        top_k = rng.choice([0, 1, 2, 5, 64, v], 8).astype(np.int32)
        top_p = rng.choice([1.0, 0.999, 0.95, 0.5, 0.1, 1e-6], 8).astype(np.float32)
        if trial % 5 == 0:
            top_k[:] = 0  # top-p alone: the top-k search does not run
        elif trial % 5 == 1:
            top_p[:] = 1.0  # top-k alone
        got = np.isfinite(np.asarray(f(x, top_k, top_p))) | np.isneginf(x)
        for r in range(8):
            want, gap = sorted_reference(x[r], int(top_k[r]), float(top_p[r]))
            if gap > 1e-5:
                checked += 1
                assert (got[r] == (want | np.isneginf(x[r]))).all(), (trial, r, v, top_k[r], top_p[r])
            assert got[r][np.argmax(x[r])]  # the top token always stays
    assert checked > 900, checked


def test_order_keys_sort_like_the_values():
    x = np.array([-np.inf, -3.5, -1.0, -1e-30, 0.0, 1e-30, 1.0, 2.5, np.inf], np.float32)
    keys = np.asarray(order_keys(jnp.asarray(x))).astype(np.int64)
    assert (np.diff(keys) > 0).all()
    assert np.asarray(order_keys(jnp.asarray(np.float32(-0.0)))) == keys[4]  # -0.0 == 0.0, as floats compare


def test_sampling_frequencies_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    counts = np.bincount([int(run(logits, SamplingParams(), seed=s)[0][0]) for s in range(600)], minlength=3)
    assert np.allclose(counts / 600, [0.5, 0.3, 0.2], atol=0.07)


def test_logprobs_are_model_log_softmax(small):
    model = small
    eng = Engine(model, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64, warmup=False))
    prompt = [5, 6, 7, 8, 9]
    out = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True),
                       progress=False)[0]
    seq = prompt + out.token_ids
    ref = np.asarray(jax.nn.log_softmax(forward(model, np.asarray([seq]))[0], -1))
    for i, tok in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + i]
        assert out.logprobs[i] == pytest.approx(row[tok], abs=1e-4)
        top = sorted(out.top_logprobs[i].items(), key=lambda kv: -kv[1])
        assert [t for t, _ in top] == list(np.argsort(-row)[:3])


@pytest.fixture(scope="module")
def small():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=4)


def test_interleaved_streams_each_get_every_token(small):
    eng = Engine(small, EngineConfig(page_size=8, max_seqs=3, max_tokens_per_step=32, max_model_len=64, warmup=False))
    other = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    a = eng.stream([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    b = eng.stream([7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    chunks = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name, it in list(live.items()):
            try:
                chunks[name].append(next(it))
            except StopIteration:
                del live[name]
    for name, n in (("a", 6), ("b", 4)):
        got = chunks[name]
        assert [t for c in got for t in c.new_token_ids] == got[-1].token_ids and len(got[-1].token_ids) == n
        assert got[-1].finish_reason == "length" and all(c.finish_reason is None for c in got[:-1])
    # `other` finished while the streams drove the engine: its progress waits for the next step()
    assert other not in eng.requests and eng.has_unfinished()
    (done,) = eng.step()
    assert done.request_id == other and done.finished and len(done.new_token_ids) == 3
    assert not eng.has_unfinished()


def test_stream_checks_input_at_call_and_close_aborts(small):
    eng = Engine(small, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64, warmup=False))
    with pytest.raises(SamplingError, match="max_tokens"):
        eng.stream([1], SamplingParams(max_tokens=0))  # raised here, not at the first next()
    it = eng.stream([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    next(it)
    it.close()
    assert not eng.has_unfinished() and eng.allocator.num_free == eng.allocator.num_pages
    assert eng.stats.aborted == 1
