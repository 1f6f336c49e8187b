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
The same script runs unchanged on a GPU: it reads the program compiled for the local backend.
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

_MODELS = flags.DEFINE_list("models", ["tiny-dense"], "Models: config names under configs/models, "
                            "smollm2-135m-instruct, llama-1b-shape.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "2048", "8192", "32768"],
                              "Tokens of each sequence's KV the step attends over, its own tokens included.")
_TP = flags.DEFINE_list("tp", ["1", "8"], "Tensor-parallel widths.")
_STEPS = flags.DEFINE_list("steps", ["decode", "mixed"], "Step kinds: decode, mixed (a prefill chunk beside decodes).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences in a step (the engine's max_seqs).")
_CHUNK = flags.DEFINE_integer("chunk", 128, "Prefill chunk of the mixed step, in tokens.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Layers of the real configs under configs/models (their widths kept).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype of every model (default: each model's as it loads on "
                             "this backend).")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["reference", "pallas", "auto"],
                               "The step's attention, as EngineConfig.attention.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

STEP_KINDS = ("decode", "mixed")
TINY = ("tiny-dense", "tiny-moe")  # test configs: audited as they are, --layers aside
COLLECTIVES = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
               "collective-permute": "CP"}
KERNEL_OPS = ("fusion", "custom-call")
# top-level instructions that launch nothing: structure, aliases, and the second half of async pairs
NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
           "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "async-start"}
LAYER_FUNCTION = "Block.__call__"  # the decoder's layer (talaria_jax/models/decoder.py): its collectives are per layer


# ---- the optimized HLO ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Instr:
    """One instruction of an HLO computation: its name, opcode, result type, operand names and whole line."""
    name: str
    opcode: str
    type: str
    operands: list[str]
    line: str


@dataclasses.dataclass
class Hlo:
    """An optimized HLO module's text, parsed: computations by name, the entry's name, and each stack
    frame's function name and parent (for the call stack of an instruction's metadata)."""
    computations: dict[str, list[Instr]]
    entry: str
    text: str
    frames: dict[int, tuple[str, int]]


_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\(")


def parse_hlo(text: str) -> Hlo:
    """`compiled.as_text()` parsed into computations of instructions, with its stack-frame tables."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and (m := _INSTR.match(line)):
            comps[cur].append(Instr(m.group(1), m.group(3), m.group(2), _operands(line[m.end():]), line))
    return Hlo(comps, entry, text, _stack_frames(text))


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's "(" to the matching ")"."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([^\s,(){}]+)", rest[:i])
    return []


_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}


def type_bytes(t: str) -> float:
    """Bytes of an HLO type ("f32[8,4]{1,0}", or a tuple of them); fp8 types count one byte an element."""
    total = 0.0
    for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", t):
        size = 1 if dtype.startswith("f8") else _DTYPE_BYTES.get(dtype, 4)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _section(text: str, title: str) -> dict[int, str]:
    """{id: rest of line} of one of the module's numbered tables (FileNames, StackFrames, ...)."""
    m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.M)
    return {int(i): v for i, v in (l.split(" ", 1) for l in m.group(1).splitlines())} if m else {}


def _stack_frames(text: str) -> dict[int, tuple[str, int]]:
    """{frame id: (function name, parent frame id, 0 at the root)} from the module's tables."""
    functions = {i: v.strip('"') for i, v in _section(text, "FunctionNames").items()}
    locations = {i: int(re.search(r"function_name_id=(\d+)", v).group(1))
                 for i, v in _section(text, "FileLocations").items()}
    frames = {}
    for i, v in _section(text, "StackFrames").items():
        loc, parent = (int(x) for x in re.findall(r"=(\d+)", v))
        frames[i] = (functions.get(locations.get(loc), ""), parent - 1)  # printed one past the parent's id
    return frames


def in_layer(hlo: Hlo, instr: Instr) -> bool:
    """Whether the instruction's call stack passes through the decoder's layer (`LAYER_FUNCTION`)."""
    m = re.search(r"stack_frame_id=(\d+)", instr.line)
    frame, seen = int(m.group(1)) if m else 0, set()
    while frame in hlo.frames and frame not in seen:
        seen.add(frame)
        name, frame = hlo.frames[frame]
        if name == LAYER_FUNCTION:
            return True
    return False


def known_trips(instr: Instr) -> int | None:
    """A while loop's trip count where XLA records it (backend_config's known_trip_count), else None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.line)
    return int(m.group(1)) if m else None


def _called(instr: Instr, attr: str) -> list[str]:
    """The computations an instruction names in `attr` (calls=, body=, branch_computations={...})."""
    m = re.search(rf"{attr}=(\{{[^}}]*\}}|%[^\s,]+)", instr.line)
    return re.findall(r"%([^\s,{}]+)", m.group(1)) if m else []


SLICING = ("gather", "dynamic-slice")  # read only their result's elements of operand 0
IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # update operand 0 in place: touch only this operand's size


def _through_bitcasts(comp: list[Instr], name: str) -> list[tuple[Instr, int]]:
    """(user, operand index) of every use of `name` in `comp`, looking through bitcasts (free aliases)."""
    out = []
    for instr in comp:
        for i, operand in enumerate(instr.operands):
            if operand == name:
                out += _through_bitcasts(comp, instr.name) if instr.opcode == "bitcast" else [(instr, i)]
    return out


def _reads(comp: list[Instr], sizes: dict[str, float], param: str) -> float:
    """Bytes a fused computation reads of its parameter `param`: what gathers and dynamic slices take of
    it where those are its only users, nothing where it is updated in place, else all of it."""
    uses = _through_bitcasts(comp, param)
    if uses and all(u.opcode in SLICING and i == 0 for u, i in uses):
        return sum(type_bytes(u.type) for u, _ in uses)
    if uses and all(u.opcode in IN_PLACE and i == 0 for u, i in uses):
        return 0.0
    return sizes[param]


def moved_bytes(hlo: Hlo, instr: Instr, sizes: dict[str, float]) -> float:
    """Bytes one run of a top-level instruction reads and writes: its operands and result, except that a
    gather or dynamic slice reads only what it takes and an in-place update (scatter, dynamic update
    slice; a fusion whose root is one) writes only its update. `sizes`: bytes of the names in scope."""
    if instr.opcode == "fusion":
        fused = hlo.computations[_called(instr, "calls")[0]]
        params = {int(re.search(r"parameter\((\d+)\)", f.line).group(1)): f.name
                  for f in fused if f.opcode == "parameter"}
        inner = {f.name: type_bytes(f.type) for f in fused}
        read = sum(_reads(fused, inner, params[i]) for i in range(len(instr.operands)))
        root = next(f for f in fused if f.line.lstrip().startswith("ROOT"))
        while root.opcode == "bitcast":
            root = next(f for f in fused if f.name == root.operands[0])
        written = inner[root.operands[IN_PLACE[root.opcode]]] if root.opcode in IN_PLACE else type_bytes(instr.type)
        return read + written
    operands = [sizes.get(o, 0.0) for o in instr.operands]
    if instr.opcode in SLICING:
        return 2 * type_bytes(instr.type) + sum(operands[1:])
    if instr.opcode in IN_PLACE:
        return sum(operands[1:]) + operands[IN_PLACE[instr.opcode]]
    return sum(operands) + type_bytes(instr.type)


@dataclasses.dataclass
class Counts:
    """What a computation executes: `fixed` per run, plus `per_trip` times each trip of the loops whose
    trip count is known only at run time (the attention's page blocks). Keys: "kernels", "other",
    "bytes" (`moved_bytes` of the work counted), and ("AR", True) style (collective kind, in a layer) pairs."""
    fixed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_trip: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    runtime_loops: int = 0  # loops of unknown trip count (one per attention layer)

    def add(self, other: "Counts", times: int = 1) -> None:
        for _ in range(times):
            self.fixed.update(other.fixed)
            self.per_trip.update(other.per_trip)
        self.runtime_loops += times * other.runtime_loops

    def at(self, trips: int) -> collections.Counter:
        """The counts of a run whose runtime loops take `trips` trips each."""
        out = collections.Counter(self.fixed)
        for k, v in self.per_trip.items():
            out[k] += v * trips
        return out


def count(hlo: Hlo, comp: str) -> Counts:
    """The kernels, other ops and collectives `comp` executes (recursing into loops, conditionals and calls)."""
    c = Counts()
    sizes = {i.name: type_bytes(i.type) for i in hlo.computations[comp]}
    for instr in hlo.computations[comp]:
        op = instr.opcode
        if op not in NO_WORK and not op.endswith(("-done", "-update")):
            c.fixed["bytes"] += moved_bytes(hlo, instr, sizes)
        if op == "while":
            body = count(hlo, _called(instr, "body")[0])
            body.add(count(hlo, _called(instr, "condition")[0]))
            n = known_trips(instr)
            if n is not None:
                c.add(body, n)
            elif body.runtime_loops:
                raise ValueError(f"{instr.name}: a loop of unknown trip count inside another is not audited")
            else:
                c.per_trip.update(body.fixed)
                c.runtime_loops += 1
        elif op == "conditional":
            branches = [count(hlo, b) for b in _called(instr, "branch_computations")
                        or _called(instr, "true_computation") + _called(instr, "false_computation")]
            c.add(max(branches, key=lambda b: (b.fixed["kernels"], sum(b.per_trip.values()))))
        elif op in ("call", "async-start"):
            for callee in _called(instr, "calls") or _called(instr, "to_apply"):
                c.add(count(hlo, callee))
        elif op.endswith(("-done", "-update")):
            continue
        elif op.removesuffix("-start") in COLLECTIVES:
            c.fixed[(COLLECTIVES[op.removesuffix("-start")], in_layer(hlo, instr))] += 1
        elif op in KERNEL_OPS:
            c.fixed["kernels"] += 1
        elif op not in NO_WORK:
            c.fixed["other"] += 1
    return c


def largest_moves(hlo: Hlo, most: int = 8) -> list[dict]:
    """The `most` top-level instructions of the entry and of its loops' bodies (one trip) that move the
    most bytes (`moved_bytes`), with their op_name: where the step's traffic goes."""
    found = []
    for comp in [hlo.entry] + [_called(loop, "body")[0] for loop in entry_loops(hlo)[:1]]:
        sizes = {i.name: type_bytes(i.type) for i in hlo.computations[comp]}
        for instr in hlo.computations[comp]:
            if instr.opcode not in NO_WORK and not instr.opcode.endswith(("-done", "-update")):
                op_name = re.search(r'op_name="([^"]*)"', instr.line)
                found.append(dict(bytes=moved_bytes(hlo, instr, sizes), opcode=instr.opcode, name=instr.name,
                                  type=instr.type, loop_body=comp != hlo.entry,
                                  op_name=op_name.group(1) if op_name else ""))
    return sorted(found, key=lambda f: -f["bytes"])[:most]


def entry_loops(hlo: Hlo) -> list[Instr]:
    """The while loops of the entry computation (the attention's, one per layer, on the reference path)."""
    return [i for i in hlo.computations[hlo.entry] if i.opcode == "while"]


def body_bytes(hlo: Hlo, loop: Instr, client) -> float | None:
    """XLA's bytes accessed by one trip of `loop`: its body made the module's entry and cost-analysed.
    None where this jaxlib cannot parse or analyse the rewritten module."""
    from jax._src.lib import xla_client
    from jaxlib import _hlo

    body = _called(loop, "body")[0]
    lines = []
    for line in hlo.text.splitlines():
        if line.startswith("HloModule"):
            line = line.split(",")[0]  # drops the entry's layout and aliasing
        elif line.startswith("ENTRY "):
            line = line[len("ENTRY "):]
        elif line.startswith(f"%{body} "):
            line = "ENTRY " + line
        lines.append(line)
    try:
        module = _hlo.hlo_module_from_text("\n".join(lines))
        return float(xla_client._xla.hlo_module_cost_analysis(client, module)["bytes accessed"])
    except Exception:  # a private API: the audit goes on without the correction
        return None


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
    xla_bytes: float         # XLA's cost analysis of the whole step (each loop body once)
    loop_bytes: list[tuple[int | None, float | None]]  # (known trips or None, one trip's bytes) per entry loop
    weight_bytes: int        # per device
    kv_token_bytes: int      # per device: one token's K and V in one layer
    pool_bytes: int          # per device: the KV arena
    attention: str
    largest_moves: list[dict]  # `largest_moves` of the program


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
            cfg = dataclasses.replace(cfg, num_layers=layers, dtype=cfg.weight_dtype)
    else:
        raise app.UsageError(f"--models={name}: not a config under configs/models ({', '.join(available_models())}), "
                             f"smollm2-135m-instruct or llama-1b-shape")
    return cfg.replace(dtype=dtype) if dtype else with_default_compute_dtype(cfg, platform)


def abstract_runner(cfg, mesh, batch: int, max_model_len: int, attention: str):
    """A Runner as the engine builds it (EngineConfig's defaults, `batch` sequences, `max_model_len`),
    over abstract weights; with the abstract KV arena it steps over and its pool spec."""
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
                    query_tile=ec.query_tile, attention=attention_kind(attention, mesh, spec, cfg.attention_sinks))
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


def compile_step(cfg, mesh, tp: int, kind: str, batch: int, chunk: int, max_model_len: int, attention: str) -> Program:
    """Lowers and compiles the `kind` step of `cfg` on `mesh` and reads what the audit reports from it."""
    import jax

    from talaria_jax.engine.memory_maps import map_count
    from talaria_jax.kvcache.pool import kv_shards

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
    exe_bytes, exe_kind = serialized_size(compiled)
    kv_heads = spec.kv_heads // kv_shards(spec, mesh)
    return Program(
        step=kind, tp=tp, tile=runner.tiling(b)[0].shape[1], compile_s=t2 - t1, lower_s=t1 - t0, exe_bytes=exe_bytes,
        exe_kind=exe_kind, maps_added=None if maps is None else maps_after - maps, counts=count(hlo, hlo.entry),
        xla_bytes=float(compiled.cost_analysis()["bytes accessed"]),
        loop_bytes=[(known_trips(loop), body_bytes(hlo, loop, client)) for loop in entry_loops(hlo)],
        weight_bytes=per_device_bytes(runner.model.state),
        kv_token_bytes=2 * kv_heads * spec.head_dim * jax.numpy.dtype(spec.dtype).itemsize,
        pool_bytes=per_device_bytes(kv), attention=runner.attention, largest_moves=largest_moves(hlo))


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
    accessed = None if extra is None else p.xla_bytes + extra
    return dict(
        model=cfg.name, step=p.step, tp=p.tp, context=context, batch=batch, chunk=chunk if p.step == "mixed" else None,
        attention=p.attention, tile=p.tile, trips=trips, runtime_loops=p.counts.runtime_loops,
        kernels=counts["kernels"], kernels_per_trip=p.counts.per_trip["kernels"], other_ops=counts["other"],
        collectives_per_layer=collective_text(counts, True, cfg.num_layers),
        collectives_rest=collective_text(counts, False),
        collectives={f"{k[0]}_{'layers' if k[1] else 'rest'}": v for k, v in counts.items() if isinstance(k, tuple)},
        bytes_accessed=accessed, xla_bytes_accessed=p.xla_bytes, loop_trip_bytes=[b for _, b in p.loop_bytes],
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
    for flag in (_BATCH, _CHUNK, _LAYERS):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name}={flag.value}: give a positive integer")
    budget = max(EngineConfig().max_tokens_per_step, _BATCH.value)
    if "mixed" in steps and _CHUNK.value + _BATCH.value - 1 > budget:
        raise app.UsageError(f"--chunk={_CHUNK.value}: the mixed step's {_CHUNK.value} + {_BATCH.value - 1} tokens "
                             f"exceed the engine's step budget of {budget} (EngineConfig.max_tokens_per_step)")
    return contexts, tps, steps


def audit_model(name: str, contexts: list[int], tps: list[int], steps: list[str], platform: str,
                notes: list[str]) -> list[dict]:
    """The rows of one model: each TP width and step kind compiled once, read at each context."""
    import jax

    from talaria_jax.sharding import make_mesh

    cfg = audit_config(name, _LAYERS.value, _DTYPE.value, platform)
    fit = [c for c in contexts if c <= cfg.max_position]
    if len(fit) < len(contexts):
        notes.append(f"{cfg.name}: contexts {[c for c in contexts if c not in fit]} left out: past its max_position "
                     f"{cfg.max_position} (the engine refuses a max_model_len past it)")
    rows = []
    for tp in tps:
        if tp > len(jax.devices()):
            notes.append(f"{cfg.name}: TP={tp} left out: {len(jax.devices())} {platform} device(s)")
            continue
        mesh = make_mesh(jax.devices()[:tp])
        for kind in steps:
            ctxs = [c for c in fit if kind == "decode" or c >= _CHUNK.value]
            if len(ctxs) < len(fit) and tp == tps[0]:
                notes.append(f"{cfg.name}: mixed step at contexts {sorted(set(fit) - set(ctxs))} left out: shorter "
                             f"than --chunk={_CHUNK.value}")
            if not ctxs:
                continue
            t0 = time.perf_counter()
            p = compile_step(cfg, mesh, tp, kind, _BATCH.value, _CHUNK.value, max(ctxs), _ATTENTION.value)
            print(f"  {cfg.name} TP={tp} {kind}: compiled in {p.compile_s:.1f} s ({time.perf_counter() - t0:.1f} s "
                  f"with lowering and reading)", flush=True)
            rows += [context_row(cfg, p, c, _BATCH.value, _CHUNK.value) for c in ctxs]
    return rows


def main(argv):
    del argv
    contexts, tps, steps = check_flags()
    if max(tps) > 1:
        from talaria_jax.sharding import simulate_cpu_devices

        simulate_cpu_devices(max(tps))  # CPU host devices; an accelerator backend keeps its own
    import jax

    machine = common.Machine.start(threads=os.cpu_count() or 1)
    platform = jax.default_backend()
    notes, results = [], {}
    for name in _MODELS.value:
        rows = audit_model(name, contexts, tps, steps, platform, notes)
        results[name] = rows
        if rows:
            print(f"\n### {rows[0]['model']} ({platform}, attention {rows[0]['attention']}, batch {_BATCH.value}"
                  f"{f', chunk {_CHUNK.value}' if 'mixed' in steps else ''})")
            common.print_markdown_table(COLUMNS, rows)
    machine.stop()
    if any(r["runtime_loops"] for rows in results.values() for r in rows):
        notes.append("trips: the attention loop's bound is a runtime scalar (no known trip count in the HLO); its "
                     "trips are computed from the context, EngineConfig.page_size and pages_per_block")
    exe_kinds = {r["exe_kind"] for rows in results.values() for r in rows}
    notes.append(f"exe MB: the size of the executable's {' / '.join(sorted(exe_kinds))} form")
    print("\n" + "\n".join(notes))
    print(machine.report())
    common.write_json(_OUT.value, dict(backend=platform, jax_version=jax.__version__, notes=notes, batch=_BATCH.value,
                                       chunk=_CHUNK.value, layers=_LAYERS.value, models=results), machine)


if __name__ == "__main__":
    app.run(main)
