"""Builds tiny random HF models (Llama with Llama-3 RoPE scaling, Qwen3, Qwen3-MoE, GLM-4.5-style MoE, gpt-oss) with a fixed
seed, saves each as safetensors + config.json and golden logits / greedy continuations for a fixed
prompt batch. Needs torch + transformers (`make hf`); run with `make golden`.

The tests load these checkpoints through talaria_jax's loader and match the goldens; when torch and
transformers are importable they also rebuild the HF model live (see `build_hf_model`).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

ASSETS = pathlib.Path(__file__).resolve().parent
NEW_TOKENS = 32
VOCAB = 512

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "hf-tiny-llama": dict(model_type="llama", rope_theta=10000.0,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=32)),
    "hf-tiny-qwen3": dict(model_type="qwen3", rope_theta=1000000.0),
    "hf-tiny-qwen3-moe": dict(model_type="qwen3_moe", rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[0]),
    # GLM-4.5: sigmoid router with a score-correction bias, a shared expert, a dense first layer,
    # half-rotary RoPE, q/k/v biases and qk-norm.
    "hf-tiny-glm4-moe": dict(model_type="glm4_moe", rope_theta=1000000.0, partial_rotary_factor=0.5,
                             attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding-window layers alternating with full ones, YaRN
    # RoPE, a biased router, fused gate/up experts with biases and the clamped SwiGLU. The window (4)
    # and YaRN's original context (32) are small so that the prompts reach past both.
    "hf-tiny-gpt-oss": dict(model_type="gpt_oss", intermediate_size=64, rope_theta=150000.0, attention_bias=True,
                            num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                            rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                              original_max_position_embeddings=32, truncate=False),
                            attn_implementation="eager"),
}


def prompts() -> list[list[int]]:
    """Three prompts of different lengths, fixed."""
    rng = np.random.RandomState(1234)
    return [rng.randint(3, VOCAB, size=n).tolist() for n in (5, 11, 16)]


def build_hf_model(name: str, seed: int = 0):
    """The HF model for `name`, random-initialised with a fixed seed (fp32, eval mode)."""
    import torch
    import transformers

    kw = dict(COMMON, **CONFIGS[name])
    cls_cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls_cfg, dtype=torch.float32)
    # HF initialises biases to 0 and norms to 1; perturb them so that parity exercises them too.
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("bias") or name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1)
            elif "norm" in name:
                t.normal_(1.0, 0.1)
            elif name.endswith("sinks"):  # large enough that a sink takes a real share of the softmax
                t.normal_(0.0, 1.0)
    return model.eval()


def hf_logits_and_greedy(model, batch: list[list[int]]) -> tuple[list[np.ndarray], list[list[int]]]:
    import torch

    logits, greedy = [], []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p])
            logits.append(model(ids).logits[0].float().numpy())
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    return logits, greedy


def main(names=tuple(CONFIGS)):
    batch = prompts()
    for name in names:
        model = build_hf_model(name)
        out = ASSETS / name
        out.mkdir(exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        for extra in ("generation_config.json",):
            (out / extra).unlink(missing_ok=True)
        logits, greedy = hf_logits_and_greedy(model, batch)
        np.savez_compressed(out / "golden.npz", **{f"logits_{i}": l for i, l in enumerate(logits)},
                            greedy=np.asarray(greedy, np.int32))
        (out / "prompts.json").write_text(json.dumps(batch))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, greedy[0][:8]={greedy[0][:8]}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:] or tuple(CONFIGS))
