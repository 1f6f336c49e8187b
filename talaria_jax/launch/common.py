"""What the launchers share: the model on the first `tp` devices, with the persistent compilation cache."""
from __future__ import annotations

import ctypes
import math
import os
import pathlib
import re
import sys

from absl import app


def load_on_devices(model: str, tp: int, *, dtype: str | None, compilation_cache: str | None, **load_kw):
    """`load_model(model)` on a mesh of the first `tp` devices, after turning on the compilation cache
    (`compilation_cache`: a folder, None for the default, 'off'); a bad --tp or checkpoint is a usage
    error naming it."""
    import jax

    from talaria_jax.engine import enable_compilation_cache
    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import CheckpointError, load_model

    if compilation_cache != "off":
        enable_compilation_cache(compilation_cache)
    if tp > jax.device_count():
        raise app.UsageError(f"--tp={tp} exceeds the {jax.device_count()} available devices")
    mesh = make_mesh(jax.devices()[:tp])
    try:
        return load_model(model, mesh, dtype=dtype, **load_kw)
    except CheckpointError as e:
        raise app.UsageError(str(e)) from None


def spec_config(max_spec_tokens: int):
    """The engines' speculation for a launcher's --speculate (0: none)."""
    from talaria_jax.engine.spec.suffix import SpecConfig

    return SpecConfig(max_spec_tokens=max_spec_tokens) if max_spec_tokens else None


def instance_apps(config, *, compilation_cache: str | None, instances: int = 1) -> list:
    """`serve.local_cluster.instance_apps(config)` (a `serve.config.InstanceConfig`) for a launcher:
    the compilation cache on, and a bad model, profile or device count a usage error naming it."""
    from talaria_jax.engine import enable_compilation_cache
    from talaria_jax.engine.memory_maps import MapLimitError
    from talaria_jax.serve import local_cluster
    from talaria_jax.weights import CheckpointError

    if compilation_cache != "off":
        enable_compilation_cache(compilation_cache)
    try:
        apps = local_cluster.instance_apps(config, instances)
    except (CheckpointError, ValueError) as e:  # (ConfigError is a ValueError)
        raise app.UsageError(str(e)) from None
    except MapLimitError as e:  # a limit of this machine, not a usage error: its one-line message, no traceback
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")
    release_freed_memory()
    return apps


def release_freed_memory() -> None:
    """Hands the C heap's freed pages back to the system (glibc's `malloc_trim`; nothing elsewhere):
    loading a model and compiling its step programs leave a few hundred MB freed but held."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def chat_template_text(path: str | None) -> str | None:
    """--chat_template: the Jinja text of the file at `path` (None: None); a file that cannot be read
    is a usage error naming it."""
    if not path:
        return None
    try:
        return pathlib.Path(path).read_text()
    except OSError as e:
        raise app.UsageError(f"--chat_template: cannot read {path}: {e.strerror}") from None


HOST_KV_SHARE = 0.2  # --host_kv_bytes=auto: this share of the host memory available at start


def available_host_bytes() -> int | None:
    """Host memory this process can still have: MemAvailable, or less where a cgroup (a container's
    memory.max) allows less; None where neither can be read."""
    avail = []
    try:
        with open("/proc/meminfo") as f:
            avail += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                avail.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return max(0, min(avail)) if avail else None


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def host_kv_bytes(value: str, instances: int = 1) -> int | None:
    """--host_kv_bytes: a size ('8G', '512M', '1073741824', '0': no host KV copies), 'auto' (a
    `HOST_KV_SHARE` of `available_host_bytes()` split over `instances`) or 'unbounded' (None)."""
    v = value.strip().lower()
    if v == "unbounded":
        return None
    if v == "auto":
        avail = available_host_bytes()
        return None if avail is None else int(avail * HOST_KV_SHARE) // instances
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?)i?b?", v)
    if m is None:
        raise app.UsageError(f"--host_kv_bytes={value!r}: give a size (8G, 512M, bytes), 'auto' or 'unbounded'")
    n = float(m[1]) * _UNITS[m[2]]
    if not math.isfinite(n) or n < 0:
        raise app.UsageError(f"--host_kv_bytes={value!r}: a size must be >= 0")
    return int(n)
