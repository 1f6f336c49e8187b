"""Quantized checkpoints: the bytes a model takes and what dequantizing inside the step costs on CPU.

1. Bytes at TP=8 for each served variant of configs/hardware/models.yaml: the simulator's figure
   (ModelConfig arithmetic) against the arrays a loaded model holds, built abstractly (shapes,
   dtypes and shardings, no allocation) on an 8-device TP mesh: in all, and on the busiest device
   (replicated pieces: norms, routers, fewer kv heads than ranks, scales whose blocks straddle shards).
2. CPU decode of one model stored quantized (dequantized per block inside the step) against the
   same weights dequantized once at load (`dequantized`), interleaved best of `--reps`: tokens/s and
   their ratio, with the bytes each holds.

  .venv/bin/python -m benchmarks.quant_checkpoints --out=/tmp/quant_checkpoints.json
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags, logging  # noqa: E402

from benchmarks import common  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny-moe", "Model config for the decode comparison.")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "Its hidden size (and expert FFN size) for the decode comparison.")
_BATCH = flags.DEFINE_integer("batch", 8, "Decode batch.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Cached tokens per sequence.")
_STEPS = flags.DEFINE_integer("steps", 16, "Decode steps per rep.")
_REPS = flags.DEFINE_integer("reps", 5, "Interleaved reps (best of).")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")


def _nbytes(leaves) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def bytes_rows() -> list[dict]:
    import jax
    import numpy as np
    import yaml

    from talaria_jax.config_io import from_dict
    from talaria_jax.models import load_model_config
    from talaria_jax.models.model import abstract_model
    from talaria_jax.models.quant import QuantConfig
    from talaria_jax.sharding import make_mesh
    from talaria_jax.sim.hardware import DEFAULT_MODELS_TABLE, load_models

    variants = yaml.safe_load(DEFAULT_MODELS_TABLE.read_text())["variants"]
    shapes = load_models()
    mesh = make_mesh(jax.devices()[:8], tp=8)
    rows = []
    for name, entry in variants.items():
        cfg = load_model_config(entry["config"])
        quant = from_dict(QuantConfig, entry["quant"]) if "quant" in entry else cfg.quant
        cfg = cfg.replace(dtype=entry["weight_dtype"], weight_dtype=entry["weight_dtype"], quant=quant)
        _, abstract, shardings = abstract_model(cfg, mesh)
        leaves = jax.tree.leaves(abstract)
        per_device = sum(int(np.prod(s.shard_shape(leaf.shape))) * leaf.dtype.itemsize
                         for leaf, s in zip(leaves, jax.tree.leaves(shardings)))
        scales = _nbytes(leaf for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)
                         if jax.tree_util.keystr(path).endswith("_scale'].value"))
        total = _nbytes(leaves)
        rows.append(dict(variant=name, sim_gb=shapes[name].weight_bytes / 1e9, loaded_gb=total / 1e9,
                         scales_gb=scales / 1e9, per_device_gb=per_device / 1e9,
                         over_even=per_device / (total / 8) - 1))
        print(f"{name}: {total / 1e9:.2f} GB", flush=True)
    return rows


def decode_rows() -> list[dict]:
    import dataclasses

    import jax

    from talaria_jax.engine import Engine, EngineConfig
    from talaria_jax.models import load_model_config
    from talaria_jax.models.model import dequantized, init_model
    from talaria_jax.models.quant import QuantConfig
    from talaria_jax.sharding import make_mesh

    mesh = make_mesh(jax.devices()[:1])
    base = load_model_config(_CONFIG.value)
    h = _HIDDEN.value
    base = base.replace(hidden_size=h, ffn_size=2 * h, head_dim=h // base.num_heads,
                        moe=base.moe and dataclasses.replace(base.moe, expert_ffn_size=h))
    cfg_kw = dict(max_seqs=_BATCH.value, max_model_len=_CONTEXT.value + _STEPS.value * (_REPS.value + 3) + 8,
                  max_tokens_per_step=_BATCH.value, warmup=False)
    rows = []
    for label, q in (("fp8 128x128 blocks", QuantConfig("fp8", (128, 128))),
                     ("fp8 per channel", QuantConfig("fp8", (1, 0))),
                     ("mxfp4 experts, attention fp32", QuantConfig("mxfp4", (1, 32), ("blocks.*.attn.*",)))):
        model = init_model(base.replace(quant=q), mesh)
        ref = dequantized(model)
        sides = {}
        held = {}
        for side, m in (("quantized", model), ("dequantized", ref)):
            eng = Engine(m, EngineConfig(**cfg_kw))
            sides[side] = common.synthetic_decode(eng, _BATCH.value, _CONTEXT.value, _STEPS.value, _REPS.value)
            held[side] = sum(a.nbytes for a in m.param_arrays().values())
        best = common.interleave(sides, _REPS.value, warmup=0)
        tok = {k: _BATCH.value * _STEPS.value / v for k, v in best.items()}
        rows.append(dict(layout=label, params_m=base.param_count() / 1e6, quantized_mb=held["quantized"] / 1e6,
                         dequantized_mb=held["dequantized"] / 1e6, quantized_tok_s=tok["quantized"],
                         dequantized_tok_s=tok["dequantized"], ratio=tok["quantized"] / tok["dequantized"]))
        print(f"{label}: {rows[-1]}", flush=True)
    return rows


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    machine = common.Machine.start(os.cpu_count() or 1)
    sizes = bytes_rows()
    decode = decode_rows()
    machine.stop()
    print(machine.report())
    common.print_markdown_table([("variant", "variant", "s"), ("simulator GB", "sim_gb", ".2f"),
                                 ("loaded arrays GB", "loaded_gb", ".2f"), ("of which scales GB", "scales_gb", ".3f"),
                                 ("per device GB (TP=8)", "per_device_gb", ".2f"),
                                 ("over an even split", "over_even", ".1%")], sizes)
    common.print_markdown_table([("layout", "layout", "s"), ("params (M)", "params_m", ".1f"),
                                 ("quantized MB", "quantized_mb", ".1f"), ("dequantized MB", "dequantized_mb", ".1f"),
                                 ("quantized tok/s", "quantized_tok_s", ".0f"),
                                 ("dequantized tok/s", "dequantized_tok_s", ".0f"),
                                 ("quantized / dequantized", "ratio", ".2f")], decode)
    common.write_json(_OUT.value, dict(bytes=sizes, decode=decode, batch=_BATCH.value, context=_CONTEXT.value,
                                       steps=_STEPS.value, reps=_REPS.value), machine)


if __name__ == "__main__":
    app.run(main)
