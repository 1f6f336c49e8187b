"""Test harness: CPU with 8 simulated devices, fp32. Must run before JAX is imported anywhere."""
import os

# LLVM at -O0 (XLA's HLO passes still run; matmuls still call the CPU libraries): the suite's tiny
# models spend most of their time compiling, and this cut test_engine.py from 255 s to 159 s on 2 cores.
# Benchmarks never set it. Server processes the tests start inherit both flags.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent compilation cache for the whole run (a fresh folder): engines built again with the same
# shapes -- every Instance's per-model engines, each test's small engines -- load their programs
# instead of compiling them again. Tests of the cache itself run in child processes with their own.
import tempfile  # noqa: E402

from talaria_jax.engine.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(tempfile.mkdtemp(prefix="talaria-test-xla-"))
