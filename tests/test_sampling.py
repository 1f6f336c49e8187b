"""Sampling inside the jitted step: filters, seeds and logprobs; streaming."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingBatch, SamplingParams, sample
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


def test_logprobs_are_model_log_softmax():
    cfg = load_model_config("tiny-dense")
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=4)
    eng = Engine(model, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
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


def test_stream_yields_tokens_in_order():
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=4)
    eng = Engine(model, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=32, max_model_len=64))
    other = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    chunks = list(eng.stream([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    assert sum(len(c.new_token_ids) for c in chunks) == 6
    assert [t for c in chunks for t in c.new_token_ids] == chunks[-1].token_ids
    assert chunks[-1].finish_reason == "length"
    assert eng.requests[other].finish_reason == "length"
