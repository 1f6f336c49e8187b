"""Sampling inside the jitted step: filters, seeds and logprobs; streaming."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingBatch, SamplingError, SamplingParams, sample
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
