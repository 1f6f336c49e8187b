"""The persistent compilation cache: a second process building the same engine compiles nothing."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from talaria_jax.engine import compile_cache

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

# Builds a warmed-up engine over a one-layer model with the cache on ($TALARIA_COMPILATION_CACHE);
# prints the cache's hits and writes, and the programs warm-up built.
CHILD = """
import json, os, jax
from talaria_jax.engine import Engine, EngineConfig, enable_compilation_cache
from talaria_jax.models import init_model, load_model_config
counts = {"hits": 0, "writes": 0}
names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "writes"}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(names[e], counts[names[e]] + 1)
                                       if e in names else None)
folder = enable_compilation_cache()  # before the first compile
model = init_model(load_model_config("tiny-dense").replace(num_layers=1, hidden_size=64, ffn_size=128), seed=0)
eng = Engine(model, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=4, max_model_len=32))
print(json.dumps({"folder": str(folder), "programs": eng.runner.compilations + eng.host_tier.compilations, **counts}))
"""


def _run(env):
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_every_program_from_the_cache(tmp_path):
    folder = tmp_path / "xla"
    env = {**os.environ, compile_cache.ENV_VAR: str(folder), "JAX_PLATFORMS": "cpu"}
    first = _run(env)
    assert first["folder"] == str(folder.resolve())
    # 3 step buckets (1, 2, 4 tokens) and gather + scatter for 1, 2 and 4 pages, plus init and the pool
    assert first["programs"] == 3 + 2 * 3 and first["hits"] == 0
    entries = [p for p in folder.iterdir() if p.name.endswith("-cache")]
    assert first["writes"] >= first["programs"] and len(entries) == first["writes"]  # CPU programs are cached
    second = _run(env)
    assert (second["hits"], second["writes"]) == (first["writes"], 0)


def test_cache_folder_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    assert compile_cache.cache_dir() == tmp_path / ".cache/talaria_jax/xla"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.cache_dir() == tmp_path / "env"
    assert compile_cache.cache_dir(tmp_path / "arg") == tmp_path / "arg"
