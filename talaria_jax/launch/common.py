"""What the launchers share: the model on the first `tp` devices, with the persistent compilation cache."""
from __future__ import annotations

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
