"""Model configs: published parameter counts and KV bytes per token (docs/references.md), and errors."""
import pytest

from talaria_jax.config_io import ConfigError, from_dict
from talaria_jax.models.config import ModelConfig, available_models, load_model_config

KIB = 1024
# KV bytes per token in bf16, docs/references.md table.
PUBLISHED_KV = {"qwen3-235b-a22b": 188 * KIB, "glm-4.5-air": 184 * KIB, "gpt-oss-120b": 36 * KIB,
                "llama-3.1-405b": 504 * KIB, "glm-4.5": 368 * KIB}
REAL = ["qwen3-235b-a22b", "glm-4.5", "glm-4.5-air", "gpt-oss-120b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen3-8b"]


def test_all_configs_present():
    assert set(REAL + ["tiny-dense", "tiny-moe"]) <= set(available_models())


@pytest.mark.parametrize("name", REAL)
def test_param_count_matches_published(name):
    cfg = load_model_config(name)
    assert abs(cfg.param_count() / cfg.published_params - 1) < 0.02, (cfg.param_count(), cfg.published_params)
    if cfg.published_active_params:
        # "Active" conventions differ by vendor (embeddings in or out); 10% covers them.
        assert abs(cfg.active_param_count() / cfg.published_active_params - 1) < 0.10


@pytest.mark.parametrize("name,kv", sorted(PUBLISHED_KV.items()))
def test_kv_bytes_per_token_matches_published(name, kv):
    assert load_model_config(name).kv_bytes_per_token() == kv


def test_gpt_oss_full_attention_kv_is_double():
    assert load_model_config("gpt-oss-120b").kv_bytes_per_token(full_attention=True) == 72 * KIB


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_tiny_models_are_tiny_fp32(name):
    cfg = load_model_config(name)
    assert cfg.param_count() <= 20e6 and cfg.dtype == "float32"


def test_unknown_and_bad_fields_are_named():
    base = dict(name="x", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                ffn_size=8)
    with pytest.raises(ConfigError, match="hidden_sise"):
        from_dict(ModelConfig, dict(base, hidden_sise=3))
    with pytest.raises(ConfigError, match="num_heads.*num_kv_heads"):
        from_dict(ModelConfig, dict(base, num_heads=3, num_kv_heads=2))
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        from_dict(ModelConfig, {k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ConfigError, match="top_k"):
        from_dict(ModelConfig, dict(base, moe=dict(num_experts=2, top_k=3, expert_ffn_size=4)))
    with pytest.raises(ConfigError, match="no model config 'nope'"):
        load_model_config("nope")
