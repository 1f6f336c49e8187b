"""The compiled suffix drafter (talaria_jax/engine/spec/_suffix_native.cpp), built on install where a C++
compiler is found; without one the install goes on and the drafter runs in Python (the same drafts).
Everything else about the package is in pyproject.toml."""
import sys

from setuptools import Extension, setup

try:
    import pybind11
    includes = [pybind11.get_include()]
except ImportError:  # (pip installs it first: pyproject's build-system requires)
    includes = []

# Drafts must equal the Python drafter's bit for bit: no fused multiply-adds, no fast-math.
args = ["/O2", "/std:c++17", "/fp:precise"] if sys.platform == "win32" else ["-O2", "-g0", "-std=c++17", "-ffp-contract=off"]

setup(ext_modules=[Extension("talaria_jax.engine.spec._suffix_native", ["talaria_jax/engine/spec/_suffix_native.cpp"],
                             include_dirs=includes, language="c++", extra_compile_args=args, optional=True)])
