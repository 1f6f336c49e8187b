"""Test harness: CPU with 8 simulated devices, fp32. Must run before JAX is imported anywhere."""
import os

# LLVM at -O0 (XLA's HLO passes still run; matmuls still call the CPU libraries): the suite's tiny
# models spend most of their time compiling, and this cut test_engine.py from 255 s to 159 s on 2 cores.
# Benchmarks never set it. Server processes the tests start inherit both flags.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
# XLA options of the engines whose tests decode SmolLM2 at length (EngineConfig.compiler_options): LLVM at
# -O2 for their steps alone, which halves a step (16 rows of 400 tokens: 0.57 s at -O0, 0.28 s at -O2)
# for about the same compile time (docs/testing.md).
OPTIMIZED = {"xla_backend_optimization_level": 2}
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent compilation cache for every run and every pytest-xdist worker (the tests' own, beside the
# servers' ~/.cache/talaria_jax/xla): engines built again with the same shapes -- every Instance's
# per-model engines, each test's small engines, another worker's, the last run's -- load their programs
# instead of compiling them again. Entries are keyed by the program, the flags and the JAX version, so a
# stale one is never used. TALARIA_TEST_COMPILATION_CACHE names another folder (a fresh one: a cold run).
# Tests of the cache itself run in child processes with their own.
from talaria_jax.engine.compile_cache import enable_compilation_cache  # noqa: E402

TEST_CACHE = os.environ.get("TALARIA_TEST_COMPILATION_CACHE") or "~/.cache/talaria_jax/test-xla"
enable_compilation_cache(TEST_CACHE)

# The files that take longest go to the pytest-xdist workers first (`make test` passes
# --no-loadscope-reorder, which otherwise orders files by their number of tests and so sends these few-test,
# long files last, where one of them alone can end the run). Seconds of test time each, from
# `pytest -n 2 --dist loadfile --durations=0` on a 2-core machine (docs/testing.md); the rest keep their order.
LONGEST_FIRST = ["test_gateway.py", "test_rollout.py", "test_engine.py", "test_agent_api.py",  # 270 150 131 106
                 "test_agent_frameworks.py", "test_named_models.py", "test_serve.py",  # 95 75 64
                 "test_device_check.py", "test_gguf_parity.py", "test_load_client.py", "test_tunix.py"]  # 59 46 42 36


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files and tests keep their order
