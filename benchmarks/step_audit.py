"""An audit of the engine's compiled step, read from the optimized program without running it.

For each model, tensor-parallel width (--tp) and step kind (--steps: `decode`, --batch sequences of
one token each; `mixed`, one prefill chunk of --chunk tokens beside --batch - 1 decode tokens), the
script builds the engine's `Runner` (talaria_jax/engine/runner.py) over abstract weights and an
abstract KV arena (`jax.ShapeDtypeStruct`: a 70B-wide config allocates nothing), lowers and compiles
its jitted step for the shapes the engine would use (token bucket, query tiles, page-table width
for the largest context), and reads from the compiled program, at each context of --contexts:

- kernels: the fusions and custom calls executed per step, a while loop's counted times its trip
  count and a conditional's largest branch once; `other ops` are the rest of the top-level work
  (copies, unfused dots, sorts, ...). The step's trip count is XLA's known trip count where the HLO
  records one; the attention's `fori_loop` over page blocks has a runtime bound (the step's
  `num_blocks`), so its trips are computed from the context as the runner computes them
  (`reference_blocks`), and the output says so;
- collectives by kind (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) per
  layer, those whose call stack passes through the decoder's `Block`, and in the rest of the step
  (embedding, logits, sampling);
- bytes accessed: XLA's cost analysis of the step (per device), which counts each loop body once,
  plus (trips - 1) bodies of each loop of the step's entry; and the bytes the program moves, counted
  from the HLO (`moved_bytes`: XLA's figure counts a gather's whole operand, here the KV arena);
  each against the minimum, the weights read once plus the live KV (batch x context x layers x 2 x
  kv heads x head_dim x bytes, per device);
- compile seconds, the executable's size (its serialization, or its text where it does not
  serialize) and the memory maps (/proc/self/maps) the compile added.

One program serves every context (the context is a runtime scalar of the step), so the program's
figures repeat on each row; the contexts past a model's max_position are left out, and said.

  .venv/bin/python -m benchmarks.step_audit --out=/tmp/step_audit.json
  .venv/bin/python -m benchmarks.step_audit --models=tiny-dense,smollm2-135m-instruct --tp=1,8
  .venv/bin/python -m benchmarks.step_audit --models=llama-3.1-70b --layers=2 --tp=8 --contexts=2048

Models: a config name under configs/models (the tiny test configs as they are; the real ones with
their widths and --layers layers), `smollm2-135m-instruct` (the embedded GGUF's config, read from its
header) and `llama-1b-shape` (the ~1.1B Llama of benchmarks/device_check.py). TP=8 on a CPU uses 8
simulated host devices; on an accelerator it needs 8 devices and is left out (and said) otherwise.
--ep splits each MoE layer's experts over a second mesh axis (ep x tp devices).
The same script runs unchanged on a GPU: it reads the program compiled for the local backend.

Without a GPU, two views of the GPU's program:
- --target=h100 or h200: XLA's GPU compiler run from the GPU's description (a deviceless compile:
  `make gpu-compiler` installs the CUDA plugin beside .venv, no driver or GPU needed). The step is the
  GPU's: the Pallas kernel compiled by Triton, one custom call a layer, so no loop depends on the
  context; its reads are counted as its walk of each tile's pages (`kernel_walk`), and
  `gathered_bytes` is what the step all-gathers.
- --lower_for=cuda: the step lowered for CUDA, not compiled (no plugin needed): StableHLO ops (an
  upper bound on kernels), Triton calls and while loops (those over fixed bounds, the sampler's
  top-k / top-p search, apart: the same trips at every context), a layer's from one more layer.

  .venv-gpu-compiler/bin/python -m benchmarks.step_audit --target=h200 --models=llama-1b-shape --tp=1,8
  .venv/bin/python -m benchmarks.step_audit --lower_for=cuda --models=llama-1b-shape --tp=1,8
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import time

from absl import app, flags

from benchmarks import common
from benchmarks.hlo_program import (COLLECTIVES, GPU_TARGETS, Counts, body_bytes, count, entry_loops, known_trips,
                                    largest_moves, parse_hlo, target_devices)

_MODELS = flags.DEFINE_list("models", ["tiny-dense"], "Models: config names under configs/models, "
                            "smollm2-135m-instruct, llama-1b-shape.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "2048", "8192", "32768"],
                              "Tokens of each sequence's KV the step attends over, its own tokens included.")
_TP = flags.DEFINE_list("tp", ["1", "8"], "Tensor-parallel widths.")
_EP = flags.DEFINE_integer("ep", 1, "Expert-parallel width: each TP width runs on a mesh of ep x tp devices (the "
                          "MoE layers' experts split over ep).")
_STEPS = flags.DEFINE_list("steps", ["decode", "mixed"], "Step kinds: decode, mixed (a prefill chunk beside decodes).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences in a step (the engine's max_seqs).")
_CHUNK = flags.DEFINE_integer("chunk", 128, "Prefill chunk of the mixed step, in tokens.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Layers of the real configs under configs/models (their widths kept).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype of every model (default: each model's as it loads on "
                             "this backend).")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["reference", "pallas", "auto"],
                               "The step's attention, as EngineConfig.attention.")
_TARGET = flags.DEFINE_enum("target", "", ["", "h100", "h200"], "Compile for this GPU without one (XLA's deviceless "
                             "GPU compile from the GPU's description; needs jax-cuda12-plugin installed, no GPU or "
                             "driver) instead of for this machine's backend.")
_LOWER_FOR = flags.DEFINE_enum("lower_for", "", ["", "cuda"], "Instead of compiling for this machine's backend, "
                                "lower the step for this platform and read its StableHLO (the GPU path's structure "
                                "on a machine without a GPU).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

STEP_KINDS = ("decode", "mixed")
TINY = ("tiny-dense", "tiny-moe")  # test configs: audited as they are, --layers aside


# ---- the step lowered for another platform (StableHLO) ---------------------------------------------------------

_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([^\s(]+)\(")
_OP = re.compile(r"^\s*(?:%[^=]+= )?\"?([a-z_]+\.[a-z_0-9]+|call)\"?[ (<{@]")
NO_LAUNCH = {"stablehlo.constant", "stablehlo.return", "func.return", "func.call", "stablehlo.get_tuple_element",
             "stablehlo.tuple", "stablehlo.optimization_barrier"}
TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel compiled by Triton
SHARDING_MARKS = ("@Sharding", "@SPMDFullToShardShape", "@SPMDShardToFullShape", "@xla.sdy.")


def fixed_trips(lines: list[str], i: int) -> int | None:
    """The trips of the while loop at lines[i] when its condition compares the counter with a constant
    of its own (a `fori_loop` over fixed bounds: the same work at every context), else None."""
    cond = []
    for line in lines[i + 1:]:
        if line.strip().startswith(("} do {", "stablehlo.return")):
            break
        cond.append(line)
    text = "\n".join(cond)
    consts = dict(re.findall(r"(%\S+) = stablehlo\.constant dense<(\d+)> : tensor<i(?:32|64)>", text))
    compare = re.search(r"stablehlo\.compare\s+LT, %iterArg\w*, (%\S+?),", text)
    return int(consts[compare.group(1)]) if compare and compare.group(1) in consts else None


def stablehlo_counts(text: str) -> collections.Counter:
    """What a lowered module's `main` runs, each private function counted as often as it is called:
    "ops", the operations that may launch work (an upper bound on kernels: a GPU compile fuses
    elementwise chains, and ops inside a reduction's or a loop's region are counted once); "triton",
    the Pallas kernels as Triton calls; "loops", while loops whose trips come from the step's inputs
    (their trips are not read here); "fixed_loops", those over fixed bounds (the sampler's top-k /
    top-p search: 32 trips at every context)."""
    own, calls, cur = {}, {}, None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        head = _FUNC.match(line)
        if head:
            cur = head.group(1)
            own[cur], calls[cur] = collections.Counter(), []
            continue
        m = _OP.match(line) if cur else None
        if not m:
            continue
        op = m.group(1)
        if op in ("func.call", "call"):
            calls[cur].append(re.search(r"call @([^\s(]+)\(", line).group(1))
        elif op.startswith("sdy.") or (op == "stablehlo.custom_call" and any(mark in line for mark in SHARDING_MARKS)):
            continue  # sharding annotations: no work
        elif op not in NO_LAUNCH:
            own[cur]["ops"] += 1
            if op == "stablehlo.while":
                own[cur]["fixed_loops" if fixed_trips(lines, i) is not None else "loops"] += 1
            own[cur]["triton"] += op == "stablehlo.custom_call" and TRITON in line

    def total(fn: str, seen: tuple = ()) -> collections.Counter:
        out = collections.Counter(own.get(fn, {}))
        for callee in calls.get(fn, []):
            if callee not in seen:
                out.update(total(callee, seen + (fn,)))
        return out

    return total("main")


def lowered_step(cfg, mesh, tp: int, kind: str, batch: int, chunk: int, max_model_len: int, attention: str,
                 platform: str) -> dict:
    """The `kind` step of `cfg` lowered for `platform` (not compiled): its counts (`stablehlo_counts`)
    and those of one layer, from the same step lowered with one layer more."""
    counts = []
    for layers in (cfg.num_layers, cfg.num_layers + 1):
        c = cfg if layers == cfg.num_layers else with_layers(cfg, layers)
        runner, kv, spec = abstract_runner(c, mesh, batch, max_model_len, attention, gpu=platform in ("cuda", "rocm"))
        t0 = time.perf_counter()
        lowered = runner.lower(step_batch(runner, kind, batch, chunk), kv=kv, platforms=(platform,))
        lower_s = time.perf_counter() - t0
        counts.append(stablehlo_counts(lowered.as_text()))
    per_layer = counts[1] - counts[0]
    return dict(attention=runner.attention, lower_s=lower_s, per_layer=per_layer,
                rest={k: counts[0][k] - cfg.num_layers * per_layer[k] for k in ("ops", "triton", "loops")},
                total=counts[0])


def lowered_row(cfg, lo: dict, kind: str, tp: int, context: int, platform: str) -> dict:
    """One context's row of a lowered step: the same program at every context, so the same counts; a
    step with no while loop over its inputs' bounds runs no work a number of times that depends on
    the context."""
    return dict(model=cfg.name, platform=platform, step=kind, tp=tp, context=context, layers=cfg.num_layers,
                attention=lo["attention"], ops=lo["total"]["ops"], loops=lo["total"]["loops"],
                triton=lo["total"]["triton"], ops_per_layer=lo["per_layer"]["ops"],
                triton_per_layer=lo["per_layer"]["triton"], loops_per_layer=lo["per_layer"]["loops"],
                ops_rest=lo["rest"]["ops"], flat=lo["total"]["loops"] == 0, fixed_loops=lo["total"]["fixed_loops"],
                lower_s=lo["lower_s"])


LOWERED_COLUMNS = [("step", "step", ""), ("TP", "tp", "d"), ("context", "context", "d"), ("attention", "attention", ""),
                   ("ops", "ops", "d"), ("ops/layer", "ops_per_layer", "d"), ("ops, rest", "ops_rest", "d"),
                   ("Triton calls/layer", "triton_per_layer", "d"), ("while loops", "loops", "d"),
                   ("fixed-trip loops", "fixed_loops", "d"), ("flat", "flat", ""), ("lower s", "lower_s", ".1f")]


# ---- the step ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Program:
    """One compiled step: its shapes, the compile's cost, what the HLO executes, and what per-step
    bytes and minimum depend on."""
    step: str
    tp: int
    tile: int                # query tile of the step (1: decode's tiles of one token)
    compile_s: float
    lower_s: float
    exe_bytes: int
    exe_kind: str            # "serialized" or "as_text"
    maps_added: int | None
    counts: Counts
    xla_bytes: float | None  # XLA's cost analysis of the whole step (each loop body once); None: not given
    loop_bytes: list[tuple[int | None, float | None]]  # (known trips or None, one trip's bytes) per entry loop
    weight_bytes: int        # per device
    kv_token_bytes: int      # per device: one token's K and V in one layer, of the kv heads its query heads use
    walk_token_bytes: int    # per device: what the Pallas kernel reads of one token in one layer (once per head group)
    pool_bytes: int          # per device: the KV arena
    attention: str
    largest_moves: list[dict]  # `largest_moves` of the program


def with_layers(cfg, layers: int):
    """`cfg` with `layers` layers, its per-layer sliding windows repeated in their pattern."""
    w = cfg.sliding_windows
    return dataclasses.replace(cfg, num_layers=layers,
                               sliding_windows=tuple(w[i % len(w)] for i in range(layers)) if w else w)


def audit_config(name: str, layers: int, dtype: str, platform: str):
    """The ModelConfig audited for `name` (see the module docstring), in `dtype` or the compute dtype it
    loads in on `platform`. A name that is none of them is a usage error naming --models."""
    from talaria_jax.models.config import available_models, load_model_config, with_default_compute_dtype

    if name == "smollm2-135m-instruct":
        from talaria_jax.weights.gguf import config_from_gguf
        from talaria_jax.weights.named import named_model_path

        cfg = config_from_gguf(named_model_path(name), name=name)
    elif name == "llama-1b-shape":  # benchmarks/device_check.py's decode model
        cfg = common.llama_1b_shape()
    elif name in available_models():
        cfg = load_model_config(name)
        if name not in TINY:  # real widths, few layers, computing in the dtype its checkpoint stores
            cfg = dataclasses.replace(with_layers(cfg, layers), dtype=cfg.weight_dtype)
    else:
        raise app.UsageError(f"--models={name}: not a config under configs/models ({', '.join(available_models())}), "
                             f"smollm2-135m-instruct or llama-1b-shape")
    return cfg.replace(dtype=dtype) if dtype else with_default_compute_dtype(cfg, platform)


def abstract_runner(cfg, mesh, batch: int, max_model_len: int, attention: str, gpu: bool | None = None):
    """A Runner as the engine builds it (EngineConfig's defaults, `batch` sequences, `max_model_len`),
    over abstract weights, its attention chosen as on GPUs where `gpu` (None: as on `mesh`'s devices);
    with the abstract KV arena it steps over and its pool spec."""
    import jax
    import numpy as np

    from talaria_jax.engine.engine import EngineConfig
    from talaria_jax.engine.runner import Runner, attention_kind
    from talaria_jax.kvcache.pool import arena_sharding, kv_dtype, page_words, pool_spec
    from talaria_jax.models.model import ShardedModel, abstract_model

    ec = EngineConfig()
    graphdef, state, shardings = abstract_model(cfg, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    pages = -(-max_model_len // ec.page_size)
    spec = pool_spec(cfg, ec.page_size, mesh, num_pages=batch * pages)  # the engine's default pool
    kv = jax.ShapeDtypeStruct((mesh.devices.size, spec.num_pages, page_words(spec, mesh)), np.dtype(kv_dtype(cfg)),
                              sharding=arena_sharding(mesh))
    model = ShardedModel(cfg, mesh, graphdef, params)
    runner = Runner(model, None, spec, max_seqs=batch, max_pages_per_seq=pages,
                    max_tokens_per_step=max(ec.max_tokens_per_step, batch), pages_per_block=ec.pages_per_block,
                    query_tile=ec.query_tile, attention=attention_kind(attention, mesh, spec, gpu))
    return runner, kv, spec


def step_batch(runner, kind: str, batch: int, chunk: int):
    """The host batch of a `kind` step (only its shapes and token grouping matter): decode, `batch`
    sequences of one token; mixed, one chunk of `chunk` tokens then `batch` - 1 decode tokens."""
    import numpy as np

    sizes = [1] * batch if kind == "decode" else [chunk] + [1] * (batch - 1)
    b = runner.empty_batch(sum(sizes))
    b.seq[:sum(sizes)] = np.repeat(np.arange(len(sizes)), sizes)
    return b


def per_device_bytes(tree) -> int:
    """Bytes of each device's shard of every abstract array in `tree`."""
    import jax

    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def serialized_size(compiled) -> tuple[int, str]:
    """(bytes, "serialized") of the executable's serialization, or (bytes, "as_text") of its HLO text
    where the backend does not serialize."""
    try:
        from jax.experimental.serialize_executable import serialize

        return len(serialize(compiled)[0]), "serialized"
    except Exception:  # backends without executable serialization
        return len(compiled.as_text()), "as_text"


def kv_heads_read(cfg, mesh) -> tuple[int, int]:
    """(kv heads one device's query heads use, head groups the Pallas kernel runs there): a device holds
    num_heads / tp query heads where tp divides them (else all), a kv head serves num_heads /
    num_kv_heads of them, and the kernel reads a page once per group of gcd(local heads, that ratio)
    heads (engine/kernels/ragged_paged_attention.py); device 0's, as every device's in these models."""
    tp = mesh.shape.get("tp", 1)
    local = cfg.num_heads // tp if cfg.num_heads % tp == 0 else cfg.num_heads
    ratio = cfg.num_heads // cfg.num_kv_heads
    return len({head // ratio for head in range(local)}), local // math.gcd(local, ratio)


def compile_step(cfg, mesh, tp: int, kind: str, batch: int, chunk: int, max_model_len: int, attention: str) -> Program:
    """Lowers and compiles the `kind` step of `cfg` on `mesh` and reads what the audit reports from it."""
    import jax

    from talaria_jax.engine.memory_maps import map_count

    runner, kv, spec = abstract_runner(cfg, mesh, batch, max_model_len, attention)
    b = step_batch(runner, kind, batch, chunk)
    t0 = time.perf_counter()
    lowered = runner.lower(b, kv=kv)
    t1 = time.perf_counter()
    maps = map_count()
    with jax.set_mesh(mesh):
        compiled = lowered.compile()
    t2 = time.perf_counter()
    maps_after = map_count()
    hlo = parse_hlo(compiled.as_text())
    client = jax.devices()[0].client
    cost = compiled.cost_analysis()  # None from a deviceless GPU compile
    exe_bytes, exe_kind = serialized_size(compiled)
    read, groups = kv_heads_read(cfg, mesh)
    token_bytes = 2 * spec.head_dim * jax.numpy.dtype(spec.dtype).itemsize
    return Program(
        step=kind, tp=tp, tile=runner.tiling(b)[0].shape[1], compile_s=t2 - t1, lower_s=t1 - t0, exe_bytes=exe_bytes,
        exe_kind=exe_kind, maps_added=None if maps is None else maps_after - maps, counts=count(hlo, hlo.entry),
        xla_bytes=float(cost["bytes accessed"]) if cost else None,
        loop_bytes=[(known_trips(loop), body_bytes(hlo, loop, client)) for loop in entry_loops(hlo)],
        weight_bytes=per_device_bytes(runner.model.state),
        kv_token_bytes=read * token_bytes, walk_token_bytes=groups * token_bytes,
        pool_bytes=per_device_bytes(kv), attention=runner.attention, largest_moves=largest_moves(hlo))


def kernel_walk(cfg, kind: str, context: int, batch: int, chunk: int) -> int:
    """Key tokens the Pallas kernel reads over all layers in a `kind` step at `context`: each query tile
    reads its sequence's pages up to the page of its last position (from its window's first page on a
    sliding-window layer), once per head group (engine/kernels/ragged_paged_attention.py). Decode: `batch`
    tiles of one token at position context - 1; mixed: the chunk's tiles of EngineConfig.query_tile
    ending at context - 1, and `batch` - 1 decode tiles."""
    from talaria_jax.engine.engine import EngineConfig

    ec = EngineConfig()
    ps, q = ec.page_size, ec.query_tile
    tiles = [(context - 1, context - 1)] * (batch if kind == "decode" else batch - 1)
    if kind == "mixed":
        start = context - chunk
        tiles += [(start + i, min(start + i + q, context) - 1) for i in range(0, chunk, q)]
    total = 0
    for layer in range(cfg.num_layers):
        w = cfg.window(layer)
        total += sum((last // ps + 1 - (max(first - w + 1, 0) // ps if w else 0)) * ps for first, last in tiles)
    return total


def attention_trips(context: int, tile: int) -> int:
    """Trips of the reference attention's page-block loop for sequences of `context` tokens, as the
    runner computes them (EngineConfig's page_size and pages_per_block, `reference_blocks`)."""
    from talaria_jax.engine.engine import EngineConfig
    from talaria_jax.engine.runner import reference_blocks

    ec = EngineConfig()
    blocks = -(-(-(-context // ec.page_size)) // ec.pages_per_block)
    return reference_blocks(tile, blocks, ec.pages_per_block)[0]


def collective_text(counts: collections.Counter, layer: bool, per: int = 1) -> str:
    """"2 AR, 1 AG": the collectives in the layers (`layer`, divided by `per` layers) or outside them."""
    parts = []
    for kind in COLLECTIVES.values():
        n = counts[(kind, layer)] / per
        if n:
            parts.append(f"{n:g} {kind}")
    return ", ".join(parts) or "0"


def context_row(cfg, p: Program, context: int, batch: int, chunk: int) -> dict:
    """The audit of program `p` at one context: kernels, collectives, bytes against the minimum."""
    trips = attention_trips(context, p.tile) if p.counts.runtime_loops else 0
    counts = p.counts.at(trips)
    extra = 0.0
    for known, one in p.loop_bytes:
        if one is None:
            extra = None
            break
        extra += ((known if known is not None else trips) - 1) * one
    # every sequence of the step attends over `context` tokens, a sliding-window layer over its window
    kv_min = p.kv_token_bytes * batch * sum(min(context, cfg.window(layer) or context)
                                            for layer in range(cfg.num_layers))
    minimum = p.weight_bytes + kv_min
    accessed = None if extra is None or p.xla_bytes is None else p.xla_bytes + extra
    walk = kernel_walk(cfg, p.step, context, batch, chunk) * p.walk_token_bytes if counts["attention_kernels"] else 0
    counts["bytes"] += walk
    return dict(
        model=cfg.name, step=p.step, tp=p.tp, context=context, batch=batch, chunk=chunk if p.step == "mixed" else None,
        attention=p.attention, tile=p.tile, trips=trips, runtime_loops=p.counts.runtime_loops,
        kernels=counts["kernels"], kernels_per_trip=p.counts.per_trip["kernels"], other_ops=counts["other"],
        collectives_per_layer=collective_text(counts, True, cfg.num_layers),
        collectives_rest=collective_text(counts, False),
        collectives={f"{k[0]}_{'layers' if k[1] else 'rest'}": v for k, v in counts.items() if isinstance(k, tuple)},
        gathered_bytes=counts["gathered"], gathered_mb=counts["gathered"] / 1e6,
        bytes_accessed=accessed, xla_bytes_accessed=p.xla_bytes, kernel_walk_bytes=walk,
        loop_trip_bytes=[b for _, b in p.loop_bytes],
        min_bytes=minimum, min_weight_bytes=p.weight_bytes, min_kv_bytes=kv_min, pool_bytes=p.pool_bytes,
        ratio=None if accessed is None else accessed / minimum, moved_bytes=counts["bytes"],
        moved_ratio=counts["bytes"] / minimum, compile_s=p.compile_s, lower_s=p.lower_s,
        exe_mb=p.exe_bytes / 1e6, exe_kind=p.exe_kind, maps_added=p.maps_added, largest_moves=p.largest_moves,
        gb_accessed=None if accessed is None else accessed / 1e9, gb_moved=counts["bytes"] / 1e9, gb_min=minimum / 1e9)


COLUMNS = [("step", "step", ""), ("TP", "tp", "d"), ("context", "context", "d"), ("trips", "trips", "d"),
           ("kernels", "kernels", "d"), ("kernels/trip", "kernels_per_trip", "d"), ("other ops", "other_ops", "d"),
           ("collectives/layer", "collectives_per_layer", ""), ("collectives, rest", "collectives_rest", ""),
           ("GB minimum", "gb_min", ".3f"), ("GB accessed (XLA)", "gb_accessed", ".1f"), ("XLA / min", "ratio", ".0f"),
           ("GB moved", "gb_moved", ".3f"), ("moved / min", "moved_ratio", ".2f"),
           ("all-gathered MB", "gathered_mb", ".1f"),
           ("compile s", "compile_s", ".1f"), ("exe MB", "exe_mb", ".1f"), ("maps added", "maps_added", "d")]


def int_list(flag, values: list[str]) -> list[int]:
    """`values` as positive integers; anything else is a usage error naming the flag."""
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise app.UsageError(f"--{flag.name}={','.join(values)}: give positive integers")
    return out


def check_flags() -> tuple[list[int], list[int], list[str]]:
    """(contexts, tp widths, step kinds) from the flags; a bad value is a usage error naming its flag."""
    from talaria_jax.engine.engine import EngineConfig

    contexts, tps = int_list(_CONTEXTS, _CONTEXTS.value), int_list(_TP, _TP.value)
    steps = _STEPS.value
    if not steps or set(steps) - set(STEP_KINDS):
        raise app.UsageError(f"--steps={','.join(steps)}: give some of {', '.join(STEP_KINDS)}")
    for flag in (_BATCH, _CHUNK, _LAYERS, _EP):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name}={flag.value}: give a positive integer")
    budget = max(EngineConfig().max_tokens_per_step, _BATCH.value)
    if "mixed" in steps and _CHUNK.value + _BATCH.value - 1 > budget:
        raise app.UsageError(f"--chunk={_CHUNK.value}: the mixed step's {_CHUNK.value} + {_BATCH.value - 1} tokens "
                             f"exceed the engine's step budget of {budget} (EngineConfig.max_tokens_per_step)")
    return contexts, tps, steps


def audit_model(name: str, contexts: list[int], tps: list[int], steps: list[str], platform: str,
                notes: list[str], devices: list) -> list[dict]:
    """The rows of one model: each TP width and step kind compiled once on `devices`, read at each context."""
    from talaria_jax.sharding import make_mesh

    cfg = audit_config(name, _LAYERS.value, _DTYPE.value, platform)
    fit = [c for c in contexts if c <= cfg.max_position]
    if len(fit) < len(contexts):
        notes.append(f"{cfg.name}: contexts {[c for c in contexts if c not in fit]} left out: past its max_position "
                     f"{cfg.max_position} (the engine refuses a max_model_len past it)")
    rows = []
    ep = _EP.value
    for tp in tps:
        if tp * ep > len(devices):
            notes.append(f"{cfg.name}: TP={tp} x EP={ep} left out: {len(devices)} {platform} device(s)")
            continue
        mesh = make_mesh(devices[:tp * ep], tp=tp, ep=ep)
        for kind in steps:
            ctxs = [c for c in fit if kind == "decode" or c >= _CHUNK.value]
            if len(ctxs) < len(fit) and tp == tps[0]:
                notes.append(f"{cfg.name}: mixed step at contexts {sorted(set(fit) - set(ctxs))} left out: shorter "
                             f"than --chunk={_CHUNK.value}")
            if not ctxs:
                continue
            if _LOWER_FOR.value:
                lo = lowered_step(cfg, mesh, tp, kind, _BATCH.value, _CHUNK.value, max(ctxs), _ATTENTION.value,
                                  _LOWER_FOR.value)
                rows += [lowered_row(cfg, lo, kind, tp, c, _LOWER_FOR.value) for c in ctxs]
                continue
            t0 = time.perf_counter()
            p = compile_step(cfg, mesh, tp, kind, _BATCH.value, _CHUNK.value, max(ctxs), _ATTENTION.value)
            print(f"  {cfg.name} TP={tp} {kind}: compiled in {p.compile_s:.1f} s ({time.perf_counter() - t0:.1f} s "
                  f"with lowering and reading)", flush=True)
            rows += [context_row(cfg, p, c, _BATCH.value, _CHUNK.value) for c in ctxs]
    return rows


def main(argv):
    del argv
    if _TARGET.value:  # before jax loads: the host's CPU backend only, the GPU's devices come from its description
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    contexts, tps, steps = check_flags()
    target, lowered_for = _TARGET.value, _LOWER_FOR.value
    if target and lowered_for:
        raise app.UsageError(f"--target={target} --lower_for={lowered_for}: give one (--target compiles for that "
                             "GPU; --lower_for only lowers)")
    devices_needed = max(tps) * _EP.value
    if devices_needed > 1 and not target:
        from talaria_jax.sharding import simulate_cpu_devices

        simulate_cpu_devices(devices_needed)  # CPU host devices; an accelerator backend keeps its own
    import jax

    machine = common.Machine.start(threads=os.cpu_count() or 1)
    devices = target_devices(target, devices_needed) if target else jax.devices()
    platform = "gpu" if target else jax.default_backend()
    where = f"compiled for {GPU_TARGETS[target]['name']}, no GPU" if target else (
        f"lowered for {lowered_for}" if lowered_for else platform)
    notes, results = [], {}
    for name in _MODELS.value:
        rows = audit_model(name, contexts, tps, steps, lowered_for or platform, notes, devices)
        results[name] = rows
        if rows:
            print(f"\n### {rows[0]['model']} ({where}, "
                  f"{f'EP={_EP.value}, ' if _EP.value > 1 else ''}attention "
                  f"{rows[0]['attention']}, batch {_BATCH.value}"
                  f"{f', chunk {_CHUNK.value}' if 'mixed' in steps else ''})")
            common.print_markdown_table(LOWERED_COLUMNS if lowered_for else COLUMNS, rows)
    machine.stop()
    if lowered_for:
        notes.append(f"lowered for {lowered_for}, not compiled: ops bound the kernels from above (a GPU compile fuses "
                     "elementwise chains); one program serves every context, so a step with no while loop over its "
                     "inputs' bounds (flat) runs the same kernels at every context; collectives are placed by the "
                     "compile, so they are read from the compiled view")
    if any(r.get("runtime_loops") for rows in results.values() for r in rows):
        notes.append("trips: the attention loop's bound is a runtime scalar (no known trip count in the HLO); its "
                     "trips are computed from the context, EngineConfig.page_size and pages_per_block")
    exe_kinds = {r["exe_kind"] for rows in results.values() for r in rows if "exe_kind" in r}
    if exe_kinds:
        notes.append(f"exe MB: the size of the executable's {' / '.join(sorted(exe_kinds))} form")
    if target:
        notes.append(f"compiled by XLA's GPU compiler for {GPU_TARGETS[target]['name']} from its description (no GPU): "
                     "GB moved counts the attention kernel's reads as its walk of each tile's pages "
                     "(kernel_walk); XLA gives no cost analysis without a device")
    print("\n" + "\n".join(notes))
    print(machine.report())
    common.write_json(_OUT.value, dict(backend=platform, target=target or None, lowered_for=lowered_for or None,
                                       ep=_EP.value,
                                       jax_version=jax.__version__, notes=notes, batch=_BATCH.value,
                                       chunk=_CHUNK.value, layers=_LAYERS.value, models=results), machine)


if __name__ == "__main__":
    app.run(main)
