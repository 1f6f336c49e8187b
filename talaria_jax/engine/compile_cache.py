"""JAX's persistent compilation cache, set up for the engine: compiled step, gather and scatter
programs are written to a folder and read back by the next process that builds the same engine, so
its warm-up loads executables instead of compiling them (tracing and lowering still run)."""
from __future__ import annotations

import os
import pathlib

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "TALARIA_COMPILATION_CACHE"
DEFAULT_DIR = "~/.cache/talaria_jax/xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> pathlib.Path:
    """Caches every compiled program (CPU ones included) in `path`, else $TALARIA_COMPILATION_CACHE,
    else ~/.cache/talaria_jax/xla; returns the folder (created if missing).

    Call it once at start-up, before building a model or an engine: programs compiled before the
    call are not written to the cache. JAX's default thresholds (1 s of compile time, a size set by
    the filesystem) would skip most CPU programs, so both are lowered to cache everything. The
    folder is trusted code: share it only with users you trust (an entry is an executable)."""
    folder = cache_dir(path)
    folder.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, str(folder)):
        compilation_cache.reset_cache()  # JAX opens its cache folder once; let it open the new one
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, and no override
    logging.info("persistent compilation cache at %s", folder)
    return folder


def cache_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder `enable_compilation_cache(path)` uses: `path`, else $TALARIA_COMPILATION_CACHE, else
    ~/.cache/talaria_jax/xla (absolute)."""
    return pathlib.Path(path or os.environ.get(ENV_VAR) or DEFAULT_DIR).expanduser().resolve()


# JAX's duration events for the three stages of making a program: tracing, lowering to MLIR and the
# backend compile (a persistent-cache load included). They run one after another, never nested.
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})
_compile = {"s": 0.0, "listening": False}  # seconds spent making programs since `compile_seconds` first ran


def _on_duration(event: str, seconds: float, **_kw) -> None:
    if event in _COMPILE_EVENTS:
        _compile["s"] += seconds


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling programs (persistent-cache
    loads included) since this function first ran: its difference over a stretch of work is the part
    of that work a warm server would not do."""
    if not _compile["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _compile["listening"] = True
    return _compile["s"]
