"""talaria-convert: a GGUF file, an HF checkpoint folder or a named model to an Orbax checkpoint that
`talaria-generate --model=DIR` and `load_model(DIR)` read (tokenizer included).

  talaria-convert --model=smollm2-135m-instruct --out=/tmp/smollm2-orbax
  talaria-convert --model=path/to/hf_checkpoint --out=/tmp/ckpt --dtype=bfloat16
"""
from __future__ import annotations

import pathlib
import time

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Named model, .gguf file or HF checkpoint folder.")
_OUT = flags.DEFINE_string("out", None, "Output folder (must not exist, or be empty).", required=True)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Stored dtype; default keeps the checkpoint's (float32 for quantized GGUF).")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.weights import CheckpointError, load_model, save

    out = pathlib.Path(_OUT.value).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise app.UsageError(f"--out={out} exists and is not an empty folder")
    t0 = time.perf_counter()
    try:
        lm = load_model(_MODEL.value, dtype=_DTYPE.value, use_cache=False)
    except CheckpointError as e:
        raise app.UsageError(str(e)) from None
    save(lm.model, out, tokenizer=lm.tokenizer)
    print(f"{lm.source} -> {out}: {lm.cfg.name}, {lm.cfg.param_count() / 1e6:.1f}M params, {lm.cfg.dtype}, "
          f"{time.perf_counter() - t0:.1f} s")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
