"""The simulator's model shapes are ModelConfig arithmetic (configs/models/), not a second table."""
import subprocess
import sys

import pytest

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.models.config import load_model_config
from talaria_jax.models.quant import QuantConfig
from talaria_jax.sim.hardware import ConfigError, ModelShape, load_hardware, load_models
from talaria_jax.sim.instance import SimInstance
from talaria_jax.sim.traces import read_jsonl

KIB = 1024
SHAPES = load_models()
BLOCK_FP8 = QuantConfig("fp8", (128, 128))
VARIANTS = {  # variant: (config, weight precision, quantized layout), as configs/hardware/models.yaml
    "qwen3-235b-a22b": ("qwen3-235b-a22b", "bfloat16", None),
    "qwen3-235b-a22b-fp8": ("qwen3-235b-a22b", "bfloat16", BLOCK_FP8),
    "glm-4.5-fp8": ("glm-4.5", "bfloat16", BLOCK_FP8), "glm-4.5-air-fp8": ("glm-4.5-air", "bfloat16", BLOCK_FP8),
    "llama-3.1-405b-fp8": ("llama-3.1-405b", "bfloat16", QuantConfig("fp8", (1, 0)))}


def test_every_trace_model_has_a_shape():
    for trace in (CONFIG_DIR / "traces").glob("*.jsonl"):
        assert {c.model for c in read_jsonl(trace)} <= set(SHAPES), trace.name


def test_qwen3_bf16_is_config_arithmetic():
    cfg, q = load_model_config("qwen3-235b-a22b"), SHAPES["qwen3-235b-a22b"]
    assert cfg.weight_dtype == "bfloat16" and q.weight_bytes == cfg.weight_bytes()
    # 2 x 94 layers x 8 kv heads (4 replicated to the 8 ranks) x 128 x 2 B = 376 KiB
    assert q.kv_bytes_per_token == 385024 == 2 * cfg.kv_bytes_per_token() == 376 * KIB
    assert q.tp == 8 and q.full_attn_layers == q.layers == 94 and q.attn_dim == 64 * 128


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_equal_config_arithmetic(variant):
    name, dtype, quant = VARIANTS[variant]
    cfg = load_model_config(name).replace(weight_dtype=dtype, quant=quant)
    s = SHAPES[variant]
    assert s.weight_bytes == cfg.weight_bytes()
    assert s.active_params_b * 1e9 == pytest.approx(cfg.active_param_count(), rel=1e-12)
    assert (s.layers, s.hidden, s.attn_dim) == (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert s.expert_fraction == cfg.routed_expert_bytes() / cfg.weight_bytes()
    if cfg.moe is not None:
        assert (s.num_experts, s.top_k) == (cfg.moe.num_experts, cfg.moe.top_k)


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "glm-4.5", "glm-4.5-air", "gpt-oss-120b"])
def test_routed_expert_count_agrees_with_config_counts(name):
    # total - active = the untied embedding table + the (E - k) experts a token does not touch
    cfg = load_model_config(name)
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    untied = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    assert cfg.param_count() - cfg.active_param_count() == untied + cfg.routed_expert_params() * (e - k) // e


def test_kv_heads_replicate_up_to_tp():
    cfg = load_model_config("qwen3-235b-a22b")  # 4 kv heads: 188 KiB logical
    per_tp = {tp: ModelShape.from_config(cfg, "bfloat16", tp).kv_bytes_per_token for tp in (1, 2, 4, 8, 16)}
    assert per_tp == {1: 188 * KIB, 2: 188 * KIB, 4: 188 * KIB, 8: 376 * KIB, 16: 752 * KIB}
    glm = load_model_config("glm-4.5")  # 8 kv heads: no replication at TP=8
    assert ModelShape.from_config(glm, "bfloat16", 8, quant=BLOCK_FP8).kv_bytes_per_token == glm.kv_bytes_per_token() \
        == 368 * KIB


def test_fp8_variants_count_bf16_rest_and_scales():
    # Qwen3-235B-A22B-FP8: fp8 attention and experts with one float32 scale per 128 x 128 block; bf16
    # embeddings, LM head, routers and norms (the released checkpoint's tensors)
    cfg = load_model_config("qwen3-235b-a22b")
    q = SHAPES["qwen3-235b-a22b-fp8"]
    linear = sum(o * i * n for _, o, i, n in cfg.linear_weights())
    scales = sum(n * -(-o // 128) * -(-i // 128) for _, o, i, n in cfg.linear_weights())
    assert q.weight_bytes == (cfg.param_count() - linear) * 2 + linear + 4 * scales
    assert 236e9 < q.weight_bytes < 237e9 and scales * 4 / q.weight_bytes < 3e-4  # 57 MB of scales


def test_gpt_oss_experts_mxfp4_rest_bf16():
    cfg, g = load_model_config("gpt-oss-120b"), SHAPES["gpt-oss-120b"]
    # the experts' matrices at 4.25 bits (e2m1 values + an 8-bit exponent per 32); their biases bf16
    routed = sum(o * i * n for p, o, i, n in cfg.linear_weights() if ".ffn." in p)
    assert routed == cfg.routed_expert_params() - 36 * 128 * (3 * 2880)
    assert g.weight_bytes == int((cfg.param_count() - routed) * 2 + routed * 0.53125)
    assert g.weight_bytes == pytest.approx(61 * 2**30, rel=0.01)  # docs/references.md: 61 GiB
    assert g.expert_fraction == pytest.approx(routed * 0.53125 / g.weight_bytes)  # the matrices a token reads
    # 18 of 36 layers attend to everything; KV counts those only (docs/references.md: 36 KiB)
    assert (g.layers, g.full_attn_layers, g.kv_bytes_per_token) == (36, 18, 36 * KIB)


def _table(tmp_path, body):
    p = tmp_path / "models.yaml"
    p.write_text("tensor_parallel: 8\nvariants:\n" + body)
    return p


def test_bad_variant_names_variant_and_field(tmp_path):
    with pytest.raises(ConfigError, match=r"variants\.q-nope: field 'config'='nope': no model config 'nope'"):
        load_models(_table(tmp_path, "  q-nope: {config: nope, weight_dtype: fp8}\n"))
    with pytest.raises(ConfigError, match=r"variants\.q-fp4: .*field 'weight_dtype'='fp4': precision 'fp4' not in \["):
        load_models(_table(tmp_path, "  q-fp4: {config: qwen3-235b-a22b, weight_dtype: fp4}\n"))
    with pytest.raises(ConfigError, match=r"variants\.q: .*quant\.method 'int3' not in \['fp8', 'mxfp4'\]"):
        load_models(_table(tmp_path, "  q: {config: qwen3-235b-a22b, weight_dtype: bfloat16, quant: {method: int3}}\n"))
    with pytest.raises(ConfigError, match=r"variants\.q: .*mxfp4 scales one row's 32 inputs"):
        load_models(_table(tmp_path, "  q: {config: qwen3-235b-a22b, weight_dtype: bfloat16, quant: {method: mxfp4}}\n"))
    with pytest.raises(ConfigError, match=r"variants\.q: missing field 'weight_dtype'"):
        load_models(_table(tmp_path, "  q: {config: qwen3-235b-a22b}\n"))
    with pytest.raises(ConfigError, match=r"variants\.q: unknown field\(s\) \['weights_gb'\]"):
        load_models(_table(tmp_path, "  q: {config: qwen3-235b-a22b, weight_dtype: fp8, weights_gb: 235}\n"))
    p = tmp_path / "old.yaml"
    p.write_text("models:\n  q: {weights_gb: 1}\n")
    with pytest.raises(ConfigError, match="top-level field 'variants'"):
        load_models(p)


def test_shape_tp_must_match_hardware():
    hw = load_hardware("h200x8")
    with pytest.raises(ValueError, match=r"'qwen3-235b-a22b' is for TP=4 .* num_gpus=8"):
        SimInstance("i0", hw, load_models(tp=4), ["qwen3-235b-a22b"], host_kv=True, staging=True,
                    drop_kv_on_switch=False)


def test_loading_shapes_imports_no_jax():
    # talaria_jax.models loads its JAX decoder lazily; the simulator reads only the pure config module
    code = ("import sys; from talaria_jax.sim import load_models; load_models(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax') or m.startswith('talaria_jax.engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
