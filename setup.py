"""Two C++ extensions, built on install where a C++ compiler is found; without one the install goes on:
- the compiled suffix drafter (talaria_jax/engine/spec/_suffix_native.cpp); else the drafter runs in
  Python (the same drafts);
- the KV arena's unbacked zeros, an XLA FFI custom call (kvcache/_arena_native.cpp, against jaxlib's
  FFI headers); else a CPU arena is written with XLA's zeros and then released (kvcache/pool.py).
Everything else about the package is in pyproject.toml."""
import importlib.util
import os
import sys

from setuptools import Extension, setup

try:
    import pybind11
    includes = [pybind11.get_include()]
except ImportError:  # (pip installs it first: pyproject's build-system requires)
    includes = []

# Drafts must equal the Python drafter's bit for bit: no fused multiply-adds, no fast-math.
args = ["/O2", "/std:c++17", "/fp:precise"] if sys.platform == "win32" else ["-O2", "-g0", "-std=c++17", "-ffp-contract=off"]

jaxlib = importlib.util.find_spec("jaxlib")  # its headers only (jaxlib/include/xla/ffi/api): no import
ffi_includes = [os.path.join(os.path.dirname(jaxlib.origin), "include")] if jaxlib and jaxlib.origin else []

setup(ext_modules=[
    Extension("talaria_jax.engine.spec._suffix_native", ["talaria_jax/engine/spec/_suffix_native.cpp"],
              include_dirs=includes, language="c++", extra_compile_args=args, optional=True),
    Extension("talaria_jax.kvcache._arena_native", ["kvcache/_arena_native.cpp"],
              include_dirs=includes + ffi_includes, language="c++", extra_compile_args=args, optional=True),
])
