"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`, so this imports as `common`)."""
from __future__ import annotations

import time



def decode_with_synthetic_prefix(engine, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Tokens/s of `steps` decode steps for `batch` sequences whose first `context` tokens count as
    already cached: their pages are held, their KV contents are whatever the pool holds, and only the
    last prompt token is computed. So only decode-shaped steps are timed (prefill is not measured)."""
    from talaria_jax.calibrate import start_synthetic_decode

    start_synthetic_decode(engine, batch, context, max_tokens=steps + warmup + 1)
    for _ in range(warmup):  # compile + warm-up
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    assert all(len(r.output) == steps + warmup for r in engine.running), "a sequence finished early"
    return batch * steps / dt


def hf_config(hidden: int, layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256 or 256,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def save_random_llama(path: str, config: dict) -> int:
    """Saves a randomly initialised fp32 HF Llama with `config` as safetensors; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def print_markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Prints rows as a right-aligned markdown table; columns are (header, row key, format spec).
    A value that does not apply (None) prints as "-"."""
    print("\n| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + "---:|" * len(columns))
    for r in rows:
        cells = ["-" if r[k] is None else format(r[k], f) for _, k, f in columns]
        print("| " + " | ".join(cells) + " |")


def best_time(fn, reps: int) -> float:
    """Best-of-`reps` seconds of `fn()` (blocked until its result is ready), after one untimed call."""
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best
