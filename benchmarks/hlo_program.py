"""The optimized program XLA compiles for a step, read as text: its instructions, the kernels and
collectives it runs (loops counted per trip), the bytes each kernel moves; and the GPUs a program can
be compiled for without one (XLA's deviceless GPU compile from a description of the device). Used by
benchmarks/step_audit.py and benchmarks/scan_layers.py."""
from __future__ import annotations

import collections
import dataclasses
import math
import re

from absl import app

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


def tuple_halves(t: str) -> tuple[str, str]:
    """The two top-level elements of a pair type "(A, B)" (each a type or a tuple of them)."""
    depth = 0
    for i, ch in enumerate(t):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 1:
            return t[1:i], t[i + 1:-1]
    return t, t


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


KERNEL_NAME = "ragged_paged_attention_m"  # the Pallas kernel's name (engine/kernels/ragged_paged_attention.py)


def attention_kernel(instr: Instr) -> bool:
    """Whether `instr` is the Pallas attention kernel compiled (a custom call named for it)."""
    return instr.opcode == "custom-call" and KERNEL_NAME in instr.line


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
    if attention_kernel(instr):  # the arena is read where the kernel walks: counted per context (`kernel_walk`)
        operands.remove(max(operands))
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
            if op.removesuffix("-start") == "all-gather":  # its results (an async start's type: (operands, results))
                c.fixed["gathered"] += type_bytes(tuple_halves(instr.type)[1] if op.endswith("-start") else instr.type)
        elif op in KERNEL_OPS:
            c.fixed["kernels"] += 1
            c.fixed["attention_kernels"] += attention_kernel(instr)
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


# The GPUs `--target` compiles for, as XLA's GpuTargetConfigProto describes a device (text format): the
# figures of NVIDIA's datasheets (docs/references.md) and the sm_90 limits of the CUDA programming guide.
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=80 * 10**9, bandwidth=3_350 * 10**9),
    "h200": dict(name="NVIDIA H200", memory=141 * 10**9, bandwidth=4_800 * 10**9),
}


def gpu_target_config(target: str) -> str:
    """The GpuTargetConfigProto text of `target` (GPU_TARGETS): a Hopper GPU of 132 SMs."""
    t = GPU_TARGETS[target]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  memory_bandwidth: {t["bandwidth"]}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {t["memory"]}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 }}
device_description_str: "{t["name"]}"
"""


def target_devices(target: str, n: int) -> list:
    """`n` devices of GPU `target` for a deviceless compile (jax.experimental.topologies); a usage error
    naming --target where this jaxlib has no CUDA plugin."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(target, "cuda", target_config=gpu_target_config(target),
                                            topology=f"1x1x{n}")
    except Exception as e:  # no CUDA PJRT plugin: the compile for a GPU needs it, not a GPU
        import jax

        raise app.UsageError(f"--target={target}: XLA's GPU compiler is not installed ({type(e).__name__}: "
                             f"{str(e)[:120]}); pip install jax-cuda12-plugin=={jax.__version__} (no GPU needed; "
                             f"docs/benchmarks/step_audit.md shows a separate environment for it)") from None
    return list(topo.devices)
