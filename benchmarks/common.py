"""The scaffolding the benchmark scripts share (`from benchmarks import common`): fair timing of two
sides (`interleave`, `Machine`, `set_threads`, `best_time`), the machine's load in a report
(`Machine.report`, `load_before_after`, `load_after`), output (`print_markdown_table` and
`markdown_header` for tables, `geomean` for ratios, `write_json` for a script's --out), the recorded
workloads under `DATA`, and the measuring functions that both a benchmark script and
benchmarks/device_check.py time with: `prefill_tok_s` (engine_prefill.py), `ttft` and `copy_times`
(host_restore.py), `switch_times` (model_switch.py). Nothing here defines flags of its own: a script
passes its flag values in.

Fair comparisons (`interleave`, `Machine`): a benchmark that prints ours against a reference times both
sides rep by rep in turns (ours, theirs, theirs, ours, ...) and keeps the best of each, runs both on
the same number of threads, and prints the load average before and after and the CPU time that
other processes took during the run, with a warning when the machine was busy: a 2-thread torch
run collapses when anything else uses the cores, and a one-sided best-of-N favours the side that
gets it."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Iterable

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data"  # recorded workloads the benchmarks replay
TRAJECTORIES = DATA / "agent_trajectories.json"  # talaria_jax.rollout.agent_env's, by record_trajectories.py
BUSY_CORES = 0.25  # other processes' average CPU use (cores) above which a run is reported as busy


def interleave(sides: dict[str, Callable[[], float]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Best (lowest) of `reps` timings of each side; each callable runs one rep and returns its seconds.
    The sides take turns rep by rep, the order reversed every other rep (A B, B A, ...), so a slow
    spell of the machine falls on both; `warmup` untimed calls of each first (they compile)."""
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    best = {n: float("inf") for n in names}
    for rep in range(reps):
        for n in (names if rep % 2 == 0 else names[::-1]):
            best[n] = min(best[n], sides[n]())
    return best


def _cpu_busy_s() -> float:
    """Seconds of CPU time all processes have used since boot (busy jiffies of /proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclasses.dataclass
class Machine:
    """The machine around a benchmark run: `Machine.start(threads)` before, `.stop()` after, `.report()`
    for the lines to print. `other_cores` is the average CPU use of other processes during the run
    (all busy CPU time minus this process's, over the wall time); /proc/stat is Linux-only, elsewhere
    it stays None."""
    cpus: int
    threads: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] | None = None
    other_cores: float | None = None
    _t0: tuple[float, float, float] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def start(cls, threads: int) -> "Machine":
        m = cls(os.cpu_count() or 1, threads, os.getloadavg())
        try:
            m._t0 = (time.perf_counter(), _cpu_busy_s(), _own_cpu_s())
        except OSError:
            pass
        return m

    def stop(self) -> "Machine":
        self.load_after = os.getloadavg()
        if self._t0 is not None:
            wall, busy, own = time.perf_counter() - self._t0[0], _cpu_busy_s() - self._t0[1], _own_cpu_s() - self._t0[2]
            self.other_cores = max(0.0, (busy - own) / wall)
        return self

    @property
    def busy(self) -> bool:
        return self.other_cores is not None and self.other_cores > BUSY_CORES

    def report(self) -> str:
        fmt = lambda la: " ".join(f"{x:.2f}" for x in la)
        line = f"threads: {self.threads} on each side ({self.cpus} cpus); load average before {fmt(self.load_before)}"
        if self.load_after is not None:
            line += f", after {fmt(self.load_after)}"
        if self.other_cores is not None:
            line += f"; other processes used {self.other_cores:.2f} cores during the run"
        if self.busy:
            line += (f"\nWARNING: the machine was busy (other processes used {self.other_cores:.2f} cores on average, "
                     f"more than {BUSY_CORES}): the ratios are not trustworthy; rerun on an idle machine")
        return line

    def as_json(self) -> dict:
        return dict(cpus=self.cpus, threads=self.threads, load_before=self.load_before, load_after=self.load_after,
                    other_cores=self.other_cores, busy=self.busy)


def load_before_after(before: float) -> str:
    """"load average B before, A after": the 1-minute load average `before` (read at the start of a run)
    and at the call."""
    return f"load average {before:.2f} before, {os.getloadavg()[0]:.2f} after"


def load_after() -> str:
    """The 1-minute load average at the call (the end of a run), with how to read it on the 2-core
    machine the figures come from."""
    return f"load average after: {os.getloadavg()[0]:.2f} (2 cores: above ~1 the timings are noisy)"


def set_threads(threads: int | None, torch_side: bool = True) -> int:
    """Puts both sides on the same `threads` cores (default: all): this process is pinned to the first
    `threads` CPUs, which sizes XLA:CPU's thread pool (it counts the CPUs it may run on when its client
    starts: call this before JAX runs anything), and torch gets as many intra-op threads. Returns the count."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    threads = min(threads or len(cpus), len(cpus))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus[:threads])
    if torch_side:
        import torch

        torch.set_num_threads(threads)
    return threads


def synthetic_decode(engine, batch: int, context: int, steps: int, reps: int, warmup: int = 3) -> Callable[[], float]:
    """A rep for `interleave`: each call times `steps` decode steps of `batch` sequences whose first
    `context` tokens count as already cached (their pages are held, their KV contents are whatever the
    pool holds, only the last prompt token is computed), so only decode-shaped steps are timed; it
    returns their seconds. The sequences have room for `reps` + 1 calls after `warmup` untimed steps
    (which compile)."""
    from talaria_jax.calibration import start_synthetic_decode

    start_synthetic_decode(engine, batch, context, max_tokens=warmup + steps * (reps + 1) + 1)
    for _ in range(warmup):
        engine.step()

    def rep() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        dt = time.perf_counter() - t
        assert len(engine.running) == batch, "a sequence finished early"
        return dt

    return rep


def decode_with_synthetic_prefix(engine, batch: int, context: int, steps: int, warmup: int = 3) -> float:
    """Tokens/s of one `synthetic_decode` rep (one-sided: the device check, which has no reference)."""
    return batch * steps / synthetic_decode(engine, batch, context, steps, reps=0, warmup=warmup)()


def bench_models(model: str | None, hidden: int, layers: int, folder: str, max_position: int = 4096):
    """The model both sides of a benchmark run: `model` (a named model, a .gguf file or an HF folder),
    else a random fp32 Llama of `hidden` x `layers` saved as HF safetensors in `folder`. Returns (ours:
    a ShardedModel loaded by talaria_jax in fp32, the path transformers loads, parameter count). A `model`
    of another kind (a config name, an Orbax folder), or one that does not load, is a usage error naming
    --model."""
    import jax
    from absl import app

    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import load_model
    from talaria_jax.weights.named import resolve

    try:
        if model:
            kind, path = resolve(model)
            if kind not in ("gguf", "hf"):
                raise app.UsageError(f"--model={model}: the HF side needs a GGUF or an HF folder, not {kind}")
        else:
            path = pathlib.Path(folder)
            save_random_llama(path, dict(hf_config(hidden, layers), max_position_embeddings=max_position))
        ours = load_model(path, make_mesh(jax.devices()[:1]), dtype="float32", use_cache=False).model
    except ValueError as e:  # CheckpointError: a name or files that do not load
        raise app.UsageError(f"--model={model}: {e}") from None
    return ours, path, ours.cfg.param_count()


def load_hf(path):
    """transformers' model of `path` (an HF folder, or a .gguf file dequantized to fp32 as ours is)."""
    import torch
    import transformers

    kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent if kw else path), dtype=torch.float32,
                                                             **kw).eval()


def hf_config(hidden: int, layers: int) -> dict:
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256 or 256,
                num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


def llama_config(hidden: int, layers: int, max_position: int = 4096):
    """talaria_jax's fp32 ModelConfig ("bench-llama") of `hf_config(hidden, layers)`'s shapes, for a model
    initialised on our side only (host_restore.py, model_switch.py)."""
    from talaria_jax.models.config import ModelConfig

    hf = hf_config(hidden, layers)
    return ModelConfig(name="bench-llama", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                       num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], ffn_size=hf["intermediate_size"],
                       norm_eps=hf["rms_norm_eps"], max_position=max_position, weight_dtype="float32",
                       kv_dtype="float32", dtype="float32")


def llama_1b_shape():
    """The ~1.1B-parameter Llama-shaped ModelConfig of the GPU checks ("llama-1b-shape"): bf16 weights and
    KV, positions for a 32K prefix plus a chunk (device_check.py's decode model, step_audit.py)."""
    from talaria_jax.models.config import ModelConfig

    return ModelConfig(name="llama-1b-shape", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
                       num_kv_heads=8, head_dim=128, ffn_size=5632, dtype="bfloat16", weight_dtype="bfloat16",
                       kv_dtype="bfloat16", max_position=65536)


def save_random_llama(path: str, config: dict) -> int:
    """Saves a randomly initialised fp32 HF Llama with `config` as safetensors; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def print_markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Prints rows as a right-aligned markdown table; columns are (header, row key, format spec).
    A value that does not apply (None) prints as "-"."""
    print("\n| " + " | ".join(h for h, _, _ in columns) + " |")
    print("|" + "---:|" * len(columns))
    for r in rows:
        cells = ["-" if r[k] is None else format(r[k], f) for _, k, f in columns]
        print("| " + " | ".join(cells) + " |")


def markdown_header(headers: list[str]) -> str:
    """The first two lines of a markdown table of `headers` (left-aligned columns), for a script that
    prints its rows one by one as they are measured."""
    return "| " + " | ".join(headers) + " |\n" + "|---" * len(headers) + "|"


def geomean(values: Iterable[float]) -> float:
    """The geometric mean of positive `values` (of ratios: ours over theirs)."""
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def write_json(path: str | None, payload: dict, machine: Machine | None = None) -> None:
    """Writes `payload` to `path` (a script's --out; nothing when it is None or empty) as indented JSON,
    with `machine.as_json()` under "machine" where a `machine` is given."""
    if not path:
        return
    if machine is not None:
        payload = dict(payload, machine=machine.as_json())
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def best_time(fn, reps: int) -> float:
    """Best-of-`reps` seconds of `fn()` (blocked until its result is ready), after one untimed call."""
    return interleave({"fn": functools.partial(timed, fn)}, reps)["fn"]


def prefill_rep(model, ctx: int, chunk: int, tile: int, pages_per_block: int = 4) -> Callable[[], float]:
    """A rep for `interleave`: each call times the one engine step that prefills `chunk` tokens over
    `ctx` cached ones (a synthetic prefix: its pages are held and count as computed), with query tiles
    of `tile` and `EngineConfig.pages_per_block`, and returns its seconds (the first call compiles)."""
    from talaria_jax.engine import Engine, EngineConfig, SamplingParams

    page = 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=1, max_tokens_per_step=chunk, query_tile=tile,
                                     pages_per_block=pages_per_block,
                                     max_model_len=-(-(ctx + chunk + 8) // page) * page, warmup=False))
    rng = np.random.RandomState(0)

    def rep() -> float:
        rid = eng.add_request(rng.randint(0, model.cfg.vocab_size, ctx + chunk).tolist(),
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        req = eng.requests[rid]
        req.seq.grow(eng.allocator, ctx)
        req.num_computed = ctx
        eng.waiting.remove(req)
        eng.running.append(req)
        t = time.perf_counter()
        out = eng.step()
        dt = time.perf_counter() - t
        assert len(out) == 1 and out[0].finished, "the chunk did not fit one step"
        return dt

    return rep


def prefill_tok_s(model, ctx: int, chunk: int, tile: int, reps: int, pages_per_block: int = 4) -> float:
    """Tokens/s of `prefill_rep`, best of `reps` after an untimed first run (one-sided: the device check)."""
    return chunk / interleave({"ours": prefill_rep(model, ctx, chunk, tile, pages_per_block)}, reps)["ours"]


def ttft(eng, prompt, restore=None) -> float:
    """Seconds from add_request of `prompt` (with `restore=`: its prefix KV restored from the host tier)
    to its first sampled token."""
    from talaria_jax.engine import SamplingParams

    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), restore=restore)
    while eng.has_unfinished():
        if any(o.request_id == rid and o.token_ids for o in eng.step()):
            break
    return time.perf_counter() - t


def copy_times(eng, kv, reps: int) -> dict:
    """Seconds of the tier's restore of `kv` into free pages and of its offload from them, and of a bare
    device_put of an array of the same shape between the same shardings, each way: best of `reps`,
    the four in turns (`interleave`)."""
    import jax

    tier = eng.host_tier
    pages = eng.allocator.allocate(kv.num_pages)  # free now (the engine is idle): held while timing

    def restore():
        eng.runner.kv = tier.restore(eng.runner.kv, kv, pages)
        return eng.runner.kv

    host = jax.device_put(np.ones(kv.data.shape, kv.data.dtype), tier.host_sharding)
    dev = jax.device_put(host, tier.transfer_sharding)
    try:
        return interleave({k: functools.partial(timed, fn) for k, fn in dict(
            restore_s=restore, h2d_s=lambda: jax.device_put(host, tier.transfer_sharding),
            offload_s=lambda: tier.offload(eng.runner.kv, pages, kv.token_ids).data,
            d2h_s=lambda: jax.device_put(dev, tier.host_sharding)).items()}, reps)
    finally:
        eng.allocator.free(pages)


def timed(fn) -> float:
    """Seconds of `fn()` until its result is ready."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def step_profile(model, batches: list[int], ctx: int, steps: int = 20) -> list[dict]:
    """Where one decode step's time goes: `Engine.step` (scheduling, the runner, output bookkeeping),
    `runner.step` alone on the same batch (host tiling, input transfer, the jitted step, the sampled
    tokens back), `runner.tiling` alone, and the jitted step alone on inputs already on the device,
    dispatched back to back (device time, or dispatch time where that is longer); `batch` sequences
    `ctx` tokens deep (a synthetic prefix). device_check.py and engine_decode.py --step_profile run it."""
    import jax

    from talaria_jax.calibration import start_synthetic_decode
    from talaria_jax.engine import Engine, EngineConfig

    rows = []
    for batch in batches:
        eng = Engine(model, EngineConfig(page_size=16, max_seqs=batch, max_tokens_per_step=max(batch, 16),
                                         max_model_len=-(-(ctx + 5 * steps + 16) // 16) * 16, warmup=False))
        r = eng.runner
        start_synthetic_decode(eng, batch, ctx, max_tokens=5 * steps + 8)
        seen = []
        run = r.step
        r.step = lambda b: seen.append(b) or run(b)
        for _ in range(3):
            eng.step()
        ms = lambda fn: best_time(fn, 3) * 1e3 / steps
        engine_ms = ms(lambda: [eng.step() for _ in range(steps)])  # 4 x steps: an untimed call, best of 3
        assert len(eng.running) == batch, "a sequence finished while the engine steps were timed"
        b = seen[-1]
        runner_ms = ms(lambda: [run(b) for _ in range(steps)])
        tiling_ms = ms(lambda: [r.tiling(b) for _ in range(steps)])
        inputs = jax.device_put(r.inputs(b))

        def device_steps():
            out = None
            for _ in range(steps):  # the programs the engine runs: layer programs on CPUs, else one
                if r.by_layers:
                    r.kv, out = r._by_layers(r._params(), r.kv, inputs)
                else:
                    r.kv, *out = r._step(r.model.graphdef, r.model.state, r.kv, inputs, layout=r.layout)
            jax.block_until_ready(out)

        with jax.set_mesh(r.model.mesh):
            device_steps()
            device_ms = ms(device_steps)
        rows.append({"batch": batch, "context": ctx, "engine_step_ms": engine_ms, "runner_step_ms": runner_ms,
                     "tiling_ms": tiling_ms, "device_ms": device_ms, "engine_python_ms": engine_ms - runner_ms,
                     "runner_host_ms": runner_ms - device_ms})
    return rows


def switch_times(slot, hosts, restore, reps: int) -> dict[str, list[float]]:
    """Seconds per switch of a WeightSlot by each path, alternating the models of `hosts` (HostWeights):
    the stage() call, the staging copy from issue to arrival, activate_staged, load, and `restore()`
    (a function returning a Model, e.g. an Orbax restore). One untimed run of each first."""
    import jax

    out = {k: [] for k in ("stage_call", "stage_copy", "activate_staged", "load", "restore")}
    for i in range(reps + 1):
        host = hosts[i % len(hosts)]
        t = time.perf_counter()
        slot.stage(host)
        issued = time.perf_counter()
        slot.wait_staged()
        arrived = time.perf_counter()
        slot.activate_staged()
        slot.array.block_until_ready()
        switched = time.perf_counter()
        slot.load(hosts[(i + 1) % len(hosts)])
        slot.array.block_until_ready()
        loaded = time.perf_counter()
        jax.block_until_ready(restore().state)
        restored = time.perf_counter()
        if i:  # the first run compiles the in-place copy for each model size
            for k, dt in zip(out, (issued - t, arrived - t, switched - arrived, loaded - switched, restored - loaded)):
                out[k].append(dt)
    return out


# a JSON schema of a list of 20-40 records: the constrained side of structured_decode.py, one of
# grammar_libraries.py's schemas
RECORDS_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 20, "maxItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "year": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "year", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
DEMO_DEFAULTS = dict(sessions=12, calls=4, max_tokens=32, start_gap_s=0.25)  # of the demo's flags, in demo_flags


def demo_flags():
    """`talaria_jax.launch.demo`, whose flags (--sessions, --calls, --policies, ...) a script of the demo's
    agent sessions takes, with the smaller defaults of DEMO_DEFAULTS (serve_load.py,
    inferred_sessions.py); call it at import, before absl parses the command line."""
    from absl import flags

    from talaria_jax.launch import demo

    for name, default in DEMO_DEFAULTS.items():
        flags.FLAGS.set_default(name, default)
    return demo


def demo_script(demo) -> list:
    """The demo's scripted agent sessions as its flags (`demo_flags`) ask."""
    from talaria_jax.serve.local_cluster import demo_sessions

    return demo_sessions(demo._SESSIONS.value, demo._CALLS.value, max_tokens=demo._MAX_TOKENS.value,
                         tool_gap_s=demo._TOOL_GAP.value, seed=demo._SEED.value)


def rss_bytes(pid: int) -> int:
    """VmRSS of process `pid` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (Linux /proc; [] once it is gone)."""
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and its children, recursively."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out
