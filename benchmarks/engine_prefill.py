"""Prefill of a session's next turn: `--chunk` new tokens on top of a cached context, ours vs HF.

An agent session's call prefills its new tokens (the tool's observation) over a long cached prefix.
One run, same weights on three sides: a ~125M-parameter fp32 Llama (random init, saved as HF
safetensors and loaded through talaria_jax's loader).
- ours: the paged engine as configured by default. A step that is one sequence's chunk runs as one
  query tile of the whole step (`TileRules.whole_step_tile`), so each page block of the context is
  read once for all the chunk's tokens and the attention's matmuls are big; a step mixing several
  sequences uses tiles of `--query_tile` tokens of one sequence;
- ours, tiles of 1: the same engine gathering the context once per query token (the layout before
  query tiles; what a decode step still uses);
- HF transformers: one forward of the chunk over a DynamicCache holding `context` random tokens.
Both of ours start from a synthetic prefix (its pages are held and count as computed) and time the
one step that prefills the chunk and samples the next token. The three sides take turns rep by rep
on the same cores (`--threads`), best of `--reps` each, with the machine's load printed before and
after (benchmarks/common.py: `interleave`, `Machine`).

  .venv/bin/python -m benchmarks.engine_prefill --out=/tmp/engine_prefill.json
  .venv/bin/python -m benchmarks.engine_prefill --model=smollm2-135m-instruct   # the embedded real model
"""
from __future__ import annotations

import tempfile
import time

from absl import app, flags

from benchmarks import common

_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096"], "Cached context lengths (tokens).")
_CHUNK = flags.DEFINE_integer("chunk", 512, "New tokens prefilled on top of the context.")
_TILE = flags.DEFINE_integer("query_tile", 16, "EngineConfig.query_tile of our first side (used by steps that mix sequences).")
_PPB = flags.DEFINE_integer("pages_per_block", 4, "EngineConfig.pages_per_block (16-token pages) of both our sides.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed reps per side and point, in turns with the other sides' (best is reported).")
_THREADS = flags.DEFINE_integer("threads", None, "Cores for every side (default: all): this process is pinned to "
                                "them (XLA:CPU sizes its pool by them) and torch uses as many threads.")
_HIDDEN = flags.DEFINE_integer("hidden", 768, "Model hidden size (768 with 12 layers: ~125M parameters).")
_LAYERS = flags.DEFINE_integer("layers", 12, "Model layers.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_MODEL = flags.DEFINE_string("model", None, "Named model, .gguf file or HF folder to load on both sides "
                             "(default: a random ~125M Llama of --hidden/--layers).")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "Do not run the HF side (when torch is not installed).")


def hf_rep(model, ctx: int, chunk: int):
    """A rep (seconds) of transformers forwarding `chunk` tokens over a DynamicCache of `ctx` random
    tokens (the cache is filled outside the clock) and taking the last token's argmax."""
    import torch
    from transformers import DynamicCache

    cfg = model.config
    g = torch.Generator().manual_seed(0)
    shape = (1, cfg.num_key_value_heads, ctx, cfg.head_dim)
    kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(0, cfg.vocab_size, (1, chunk), generator=g)
    pos = torch.arange(ctx, ctx + chunk)[None]

    def rep() -> float:
        cache = DynamicCache(config=cfg)
        for layer, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), layer)
        t = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, position_ids=pos, use_cache=True).logits
            logits[0, -1].argmax()
        return time.perf_counter() - t

    return rep


def main(argv):
    del argv
    threads = common.set_threads(_THREADS.value, torch_side=not _SKIP_HF.value)
    machine = common.Machine.start(threads)
    contexts = [int(c) for c in _CONTEXTS.value]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, path, n_params = common.bench_models(_MODEL.value, _HIDDEN.value, _LAYERS.value, tmp,
                                                    max_position=max(4096, max(contexts) + _CHUNK.value + 64))
        if max(contexts) + _CHUNK.value > model.cfg.max_position:
            raise app.UsageError(f"--contexts: {max(contexts)} + --chunk {_CHUNK.value} exceeds the model's "
                                 f"max_position {model.cfg.max_position}")
        hf_model = None if _SKIP_HF.value else common.load_hf(path)
        print(f"model: {n_params / 1e6:.0f}M params fp32; chunk {_CHUNK.value} tokens; best of {_REPS.value} reps per "
              f"side, interleaved")
        print(machine.report(), flush=True)
        for ctx in contexts:
            sides = {"tiled": common.prefill_rep(model, ctx, _CHUNK.value, _TILE.value, _PPB.value),
                     "tile1": common.prefill_rep(model, ctx, _CHUNK.value, 1, _PPB.value)}
            if hf_model is not None:
                sides["hf"] = hf_rep(hf_model, ctx, _CHUNK.value)
            best = {k: _CHUNK.value / v for k, v in common.interleave(sides, _REPS.value).items()}
            tiled, per_token, theirs = best["tiled"], best["tile1"], best.get("hf")
            rows.append(dict(context=ctx, chunk=_CHUNK.value, ours_tok_s=tiled, ours_tile1_tok_s=per_token,
                             hf_tok_s=theirs, tiled_over_tile1=tiled / per_token,
                             ours_over_hf=tiled / theirs if theirs else None))
            r = rows[-1]
            print(f"  ctx {ctx:6d}: ours {tiled:8.1f} tok/s  tiles of 1 {per_token:8.1f}  hf {theirs or float('nan'):8.1f}  "
                  f"ours/tile1 {r['tiled_over_tile1']:5.2f}  ours/hf {r['ours_over_hf'] or float('nan'):5.2f}", flush=True)
    machine.stop()
    common.print_markdown_table(
        [("context", "context", "d"), ("chunk", "chunk", "d"), ("ours tok/s", "ours_tok_s", ".0f"),
         ("ours tok/s (tiles of 1)", "ours_tile1_tok_s", ".0f"), ("HF tok/s", "hf_tok_s", ".0f"),
         ("ours / tiles of 1", "tiled_over_tile1", ".2f"), ("ours / HF", "ours_over_hf", ".2f")], rows)
    print(machine.report())
    common.write_json(_OUT.value, dict(model=_MODEL.value or "random-llama", params=n_params, query_tile=_TILE.value,
                                       reps=_REPS.value, rows=rows), machine)


if __name__ == "__main__":
    app.run(main)
