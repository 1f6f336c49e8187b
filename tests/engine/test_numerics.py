"""Numerics per backend: the default compute dtype (fp32 on CPU, bf16 on an accelerator for an fp32
source), and the bf16 path's tolerances against the fp32 reference, stated here and in docs/engine.md."""
import jax
import numpy as np

from talaria_jax.engine import Engine, EngineConfig, SamplingParams
from talaria_jax.models import init_model, load_model_config
from talaria_jax.models.config import default_compute_dtype, with_default_compute_dtype
from talaria_jax.models.model import forward
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import checkpoint, load_model

# bf16 weights, activations and KV against the fp32 reference, on the tiny random models: the largest
# logit difference over the logits' standard deviation (full-sequence forward), and the largest
# difference of the logprob of each token the bf16 engine generated greedily. fp32 accumulation,
# norms, softmax and logits keep them small.
BF16_LOGIT_TOL = 0.1  # measured 0.041
BF16_LOGPROB_TOL = 0.02  # measured 0.0058


def test_default_compute_dtype_per_platform():
    assert default_compute_dtype("float32", "cpu") == "float32"
    assert default_compute_dtype("float32", "gpu") == "bfloat16"
    assert default_compute_dtype("float32", "tpu") == "bfloat16"
    assert default_compute_dtype("bfloat16", "cpu") == "bfloat16"
    assert default_compute_dtype("float16", "gpu") == "float16"
    cfg = load_model("tiny-dense", make_mesh(jax.devices()[:1])).model.cfg  # random weights on this CPU
    assert (cfg.dtype, cfg.weight_dtype, cfg.kv_dtype) == ("float32",) * 3
    on_gpu = with_default_compute_dtype(cfg.replace(kv_dtype="fp8"), "gpu")  # weights and KV, storage kept
    assert (on_gpu.dtype, on_gpu.weight_dtype, on_gpu.kv_dtype) == ("bfloat16", "bfloat16", "fp8")
    assert with_default_compute_dtype(cfg, "cpu") == cfg


def test_bf16_against_the_fp32_reference(tmp_path):
    mesh = make_mesh(jax.devices()[:1])
    fp32 = init_model(load_model_config("tiny-dense"), mesh, seed=1)
    checkpoint.save(fp32, tmp_path / "m")
    bf16 = checkpoint.restore(tmp_path / "m", mesh, dtype="bfloat16")  # the same weights, rounded to bf16
    assert bf16.param_arrays()["blocks.0.attn.q_proj"].dtype == jax.numpy.bfloat16

    rng = np.random.RandomState(0)
    tokens = rng.randint(0, fp32.cfg.vocab_size, (3, 24))
    want, got = np.asarray(forward(fp32, tokens)), np.asarray(forward(bf16, tokens), np.float32)
    assert np.abs(got - want).max() / want.std() < BF16_LOGIT_TOL

    # the paged engine in bf16 (bf16 KV pool) scores the text it generates as the fp32 reference does
    eng = Engine(bf16, EngineConfig(warmup=False, max_seqs=4))
    assert eng.runner.kv.dtype == jax.numpy.bfloat16
    prompts = tokens[:, :8].tolist()
    for prompt, out in zip(prompts, eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                                          ignore_eos=True))):
        full = np.asarray(forward(fp32, np.asarray([prompt + out.token_ids])))[0]
        want = jax.nn.log_softmax(full, -1)[np.arange(7, 17), out.token_ids]
        assert np.abs(np.asarray(out.logprobs) - np.asarray(want)).max() < BF16_LOGPROB_TOL
