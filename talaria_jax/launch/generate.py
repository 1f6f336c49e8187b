"""talaria-generate: generation with one model through the paged engine (`make demo`).

Defaults run on one CPU with no downloads (the embedded tiny-dense model, random weights, byte
tokenizer). `--checkpoint` takes an HF safetensors directory or an Orbax checkpoint directory.

  talaria-generate --model=tiny-dense --prompt="Hello, agent" --max_new_tokens=16 --tp=8
"""
from __future__ import annotations

import pathlib
import time

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", "tiny-dense", "Model config name under configs/models (random weights).")
_CKPT = flags.DEFINE_string("checkpoint", None, "HF safetensors dir or Orbax checkpoint dir; overrides --model.")
_PROMPT = flags.DEFINE_multi_string("prompt", ["The agent called the tool and"], "Prompt text (repeatable).")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt.", lower_bound=1)
_TP = flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (devices used).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights (no checkpoint) and of the engine's sampling.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype for --checkpoint (bf16 on GPU).")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # JAX's backend probing logs at INFO
    import jax

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.models import init_model, load_model_config
    from talaria_jax.sharding import make_mesh
    from talaria_jax.tokenizer import load_tokenizer
    from talaria_jax.weights import load_hf_checkpoint, restore

    if _TP.value > jax.device_count():
        raise app.UsageError(f"--tp={_TP.value} exceeds the {jax.device_count()} available devices")
    mesh = make_mesh(jax.devices()[: _TP.value])
    ckpt = pathlib.Path(_CKPT.value) if _CKPT.value else None
    if ckpt is None:
        model = init_model(load_model_config(_MODEL.value), mesh, seed=_SEED.value)
    elif (ckpt / "config.json").exists():
        model = load_hf_checkpoint(ckpt, mesh, dtype=_DTYPE.value)
    else:
        model = restore(ckpt, mesh)
    tok = load_tokenizer(ckpt, model.cfg.bos_token_id, model.cfg.eos_token_id)
    prompts = [tok.encode(p, add_bos=tok.bos_id is not None) for p in _PROMPT.value]
    engine = Engine(model, EngineConfig(max_seqs=len(prompts), max_tokens_per_step=max(256, len(prompts)),
                                        max_model_len=min(model.cfg.max_position, 2048), seed=_SEED.value),
                    tokenizer=tok)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=_NEW.value, temperature=_TEMP.value))
    dt = time.perf_counter() - t0
    print(f"model {model.cfg.name}: {model.cfg.param_count() / 1e6:.1f}M params on mesh {dict(mesh.shape)}")
    for text, out in zip(_PROMPT.value, outs):
        print(f"prompt: {text!r}\n  tokens: {out.token_ids}\n  text:   {out.text!r}  ({out.finish_reason})")
    s = engine.stats
    print(f"{sum(len(o.token_ids) for o in outs)} tokens in {dt:.2f}s over {s.steps} engine steps, "
          f"{engine.runner.compilations} compilations (included)")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
