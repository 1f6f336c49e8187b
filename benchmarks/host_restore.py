"""A session's next turn: restore its prefix KV from host memory vs prefill the prefix again.

Same engine, same weights (a ~125M-parameter fp32 Llama, random init, loaded through talaria_jax's
HF loader; no torch needed). For each context length, one request of `context` tokens finishes
with keep_kv (its KV goes to host memory); then the next turn, `context` + `--new_tokens` tokens, is
served twice: once with `restore=` (pages copied back from host memory, only the new tokens
prefilled) and once from scratch (the whole prompt prefilled in chunks of `--chunk`). Each side is
timed from add_request to the first sampled token (time to first token), best of `--reps`.

  .venv/bin/python benchmarks/host_restore.py --out=/tmp/host_restore.json
"""
from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

import common

_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096"], "Prefix lengths (tokens).")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Tokens the next turn adds (the tool's observation).")
_CHUNK = flags.DEFINE_integer("chunk", 512, "Prefill chunk (token budget per step).")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions per side (best is reported).")
_HIDDEN = flags.DEFINE_integer("hidden", 768, "Model hidden size (768 with 12 layers: ~125M parameters).")
_LAYERS = flags.DEFINE_integer("layers", 12, "Model layers.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def ttft(eng, prompt, restore=None) -> float:
    from talaria_jax.engine import SamplingParams

    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), restore=restore)
    while eng.has_unfinished():
        if any(o.request_id == rid and o.token_ids for o in eng.step()):
            break
    return time.perf_counter() - t


def main(argv):
    del argv
    import jax

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.models import init_model
    from talaria_jax.models.config import ModelConfig
    from talaria_jax.sharding import make_mesh

    hf = common.hf_config(_HIDDEN.value, _LAYERS.value)
    contexts = [int(c) for c in _CONTEXTS.value]
    cfg = ModelConfig(name="bench-llama", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                      num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], ffn_size=hf["intermediate_size"],
                      norm_eps=hf["rms_norm_eps"], max_position=max(contexts) + _NEW.value + 64,
                      weight_dtype="float32", kv_dtype="float32", dtype="float32")
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=0)
    page = 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=2, max_tokens_per_step=_CHUNK.value,
                                     max_model_len=-(-(max(contexts) + _NEW.value + 8) // page) * page,
                                     warmup=False))  # best of 3 below: the first run compiles
    rng = np.random.RandomState(0)
    rows = []
    for ctx in contexts:
        first = rng.randint(0, cfg.vocab_size, ctx - 1).tolist()
        out = eng.generate([first], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), progress=False)
        rid = eng.add_request(first, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), keep_kv=True)
        while eng.has_unfinished():
            done = [o for o in eng.step() if o.request_id == rid and o.finished]
        kv = done[0].kv
        assert kv.num_tokens == ctx and done[0].token_ids == out[0].token_ids
        nxt = list(kv.token_ids) + done[0].token_ids[-1:] + rng.randint(0, cfg.vocab_size, _NEW.value - 1).tolist()
        ttft(eng, nxt, kv), ttft(eng, nxt)  # compile both paths
        restored = min(ttft(eng, nxt, kv) for _ in range(_REPS.value))
        scratch = min(ttft(eng, nxt) for _ in range(_REPS.value))
        rows.append(dict(context=ctx, new_tokens=_NEW.value, kv_mb=kv.nbytes / 1e6, restore_ttft_s=restored,
                         recompute_ttft_s=scratch, speedup=scratch / restored))
        print(f"  ctx {ctx:6d}: KV {kv.nbytes / 1e6:7.1f} MB  TTFT restore {restored * 1e3:8.1f} ms  "
              f"recompute {scratch * 1e3:8.1f} ms  recompute/restore {scratch / restored:5.1f}", flush=True)
    common.print_markdown_table(
        [("prefix tokens", "context", "d"), ("new tokens", "new_tokens", "d"), ("prefix KV (MB)", "kv_mb", ".1f"),
         ("TTFT, restore from host (s)", "restore_ttft_s", ".3f"), ("TTFT, recompute (s)", "recompute_ttft_s", ".3f"),
         ("recompute / restore", "speedup", ".1f")], rows)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(dict(memory_kind=eng.host_tier.memory_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
