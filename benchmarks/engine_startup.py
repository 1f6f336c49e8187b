"""Start-up of an engine with the persistent compilation cache: cold process vs warm process.

Runs `--runs` fresh Python processes one after the other, each loading the same model (`--model`:
any name or path `load_model` takes) and building the same Engine
(warm-up on: every step shape and host-tier copy is compiled at construction) with
`enable_compilation_cache` pointing at one folder, emptied first. The first process compiles and
writes the cache; the later ones load the executables from it. Each prints the engine's
construction time, the process's wall time to a ready engine (imports included), and the cache's
hits and writes.

  .venv/bin/python -m benchmarks.engine_startup --cache_dir=/tmp/talaria_xla
  .venv/bin/python -m benchmarks.engine_startup --model=smollm2-135m-instruct
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny-dense", "Anything load_model takes: a config name (random weights), "
                             "a named model such as smollm2-135m-instruct, a .gguf, an HF or Orbax folder.")
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/talaria_jax_startup_cache", "Cache folder (emptied first).")
_RUNS = flags.DEFINE_integer("runs", 2, "Processes to run one after the other.")
_CHILD = flags.DEFINE_bool("child", False, "Internal: build the engine once and print a JSON line.")
_CONFIG = flags.DEFINE_string("engine_config", "{}", "EngineConfig fields as JSON (default: EngineConfig()).")


def child() -> dict:
    t0 = time.perf_counter()
    import jax

    from talaria_jax.engine import Engine, EngineConfig, enable_compilation_cache
    from talaria_jax.weights import load_model

    events = {"hits": 0, "writes": 0}
    names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "writes"}
    jax.monitoring.register_event_listener(
        lambda e, **kw: events.__setitem__(names[e], events[names[e]] + 1) if e in names else None)
    enable_compilation_cache(_CACHE.value)
    tm = time.perf_counter()
    model = load_model(_MODEL.value).model  # a GGUF is converted once, then read from the conversion cache
    t1 = time.perf_counter()
    eng = Engine(model, EngineConfig(**json.loads(_CONFIG.value)))
    t2 = time.perf_counter()
    return {"model_s": round(t1 - tm, 2), "engine_s": round(t2 - t1, 2), "process_s": round(t2 - t0, 2), "step_programs": eng.runner.compilations,
            "host_programs": eng.host_tier.compilations, **events}


def main(argv):
    del argv
    if _CHILD.value:
        print(json.dumps(child()))
        return
    cache = pathlib.Path(_CACHE.value)
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    for i in range(_RUNS.value):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", f"--model={_MODEL.value}", f"--cache_dir={cache}",
                              f"--engine_config={_CONFIG.value}"], env=env, check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["wall_s"] = round(time.perf_counter() - t, 2)
        r["cache_files"] = sum(1 for p in cache.rglob("*") if p.is_file())
        print(f"process {i + 1}: " + json.dumps(r), flush=True)


if __name__ == "__main__":
    app.run(main)
