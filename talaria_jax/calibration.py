"""Calibrates the simulator's hardware profile on the real engine of this machine.

`measure_model` and `measure_copies` time one real instance (``talaria_jax.instance``): decode steps against batch and context,
prefill steps against prompt length, a weight switch loading from pinned host memory and one from the
staging area (device to device), and a session's KV offloaded to and restored from host memory.
`fit` turns those into a ``HardwareConfig`` whose cost model (``talaria_jax.sim.cost``) reproduces
them: a fixed cost per step (the intercept, where models of several sizes tell it from the weights'
read), weight and KV bytes over their bandwidths and FLOPs over a matmul rate, either overlapped
(the longer of the two, a GPU's roofline) or added (a CPU's cores do both), whichever fits the
points better, and copy rates for the links. Efficiencies are 1 but the KV reads' share of the
weights' rate and prefill attention's share of the matmul rate (from prefill steps after a
prefix-cache hit, `measure_engine`'s `pasts`): the rates measured are the effective ones. Where the
simulator prices a step as the engine's runner lays it out (`fit`'s `tiles`: the jnp reference's
query tiles), every point is fitted at once, compute and memory added, with the tiles' walk over
the keys they visit at its own rate (``tile_walk_efficiency``).
`measure_staging` times decode steps with another model's staging copy kept in flight against
steps with nothing staging; their ratio is ``staging_step_slowdown``
(``benchmarks/model_switch.py`` times the same thing with `decode_step_times`). `measure_engine`
times any ``Engine`` the same way (the rollout replicas' too), `measure_verify` steps that verify
suffix drafts (their time beyond their tokens' prefill cost, per token: ``verify_token_overhead_us``), and
`measure_colocated` steps of replicas on this host stepping at once against one alone, decode and
prefill shapes alike: ``colocated_step_slowdown``.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from typing import Sequence

import numpy as np

from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.instance import Instance
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import GB, GIB, HardwareConfig


@dataclasses.dataclass
class Point:
    model: str
    kind: str  # decode | prefill | verify
    batch: int
    tokens: int  # decode, verify: context per sequence; prefill: prompt tokens
    seconds: float
    drafted: float = 0.0  # verify: draft tokens per sequence and step (mean)
    past: int = 0  # prefill: tokens of context cached before the prompt's (a prefix-cache hit)


def _drain(eng) -> None:
    while eng.has_unfinished():
        eng.step()


def _load(inst: Instance, model: str) -> None:
    """`model`'s weights on `inst`'s devices now: into the slot, or its own arrays under a weight budget
    (`Instance.weights`); every model's already where the models stay resident."""
    if inst.weights is not None:
        inst.weights.load(model)
    elif inst.slot is not None:
        inst.slot.load(inst.served[model].host)
        inst.slot.array.block_until_ready()


def measure_model(inst: Instance, model: str, **kw) -> list[Point]:
    """Decode and prefill step times of `model` on `inst` (its weights loaded first); `measure_engine`'s
    keywords."""
    _load(inst, model)
    return measure_engine(inst.served[model].engine, model, **kw)


def measure_engine(eng, model: str, *, batches=(1, 4), contexts=(64, 512), prompts=(64, 256), pasts=(),
                   steps: int = 6) -> list[Point]:
    """Prefill step times of `eng` (an ``Engine``) for each prompt length in `prompts`, fresh and
    after each context of `pasts` found in its prefix cache, and decode step times (median of
    `steps`, `decode_step_times`) for each batch and context; `model` names the points."""
    rng = np.random.default_rng(0)
    out = []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for past in (0, *pasts):
        for n in prompts:  # one new prompt per step: the step is its prefill (after `past` cached tokens)
            times = []
            for _ in range(2):  # the first compiles
                before = rng.integers(0, eng.model.cfg.vocab_size, past + 1).tolist() if past else []
                if before:  # computed once, so that its pages are cached (the last token's are not)
                    eng.add_request(before, one)
                    _drain(eng)
                eng.add_request(before[:past] + rng.integers(0, eng.model.cfg.vocab_size, n).tolist(), one)
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
                _drain(eng)
            out.append(Point(model, "prefill", 1, n, times[-1], past=past))
    eng.clear_prefix_cache()  # the decode points allocate their contexts' pages outright
    for b in batches:
        for c in contexts:
            out.append(Point(model, "decode", b, c, float(np.median(decode_step_times(eng, b, c, steps)[0]))))
    eng.clear_prefix_cache()
    return out


def measure_verify(eng, model: str, *, batches=(1, 4, 8), context: int = 1024, steps: int = 6) -> list[Point]:
    """Times of `eng`'s steps that verify drafts (an ``Engine`` whose speculation policy is "always"):
    `batch` sequences whose prompts repeat a 16-token phrase, so that the suffix drafter drafts their
    continuations, the median of `steps` verifying steps after their prefill, with the draft tokens
    each sequence brought. Raises RuntimeError when the engine cannot be made to verify."""
    if eng.drafter is None or eng.config.speculation.policy != "always":
        raise RuntimeError("measure_verify: the engine needs speculation with policy 'always'")
    rng = np.random.default_rng(2)
    out = []
    for b in batches:
        for _ in range(b):
            phrase = rng.integers(0, eng.model.cfg.vocab_size, 16).tolist()
            eng.add_request((phrase * (context // 16 + 1))[:context],
                            SamplingParams(max_tokens=min(context, eng.config.max_model_len - context),
                                           temperature=0.0, ignore_eos=True))  # none ends while timed
        while any(r.num_computed < len(r.prompt) for r in list(eng.running) + list(eng.waiting)):
            eng.step()
        times, drafted = [], []
        for _ in range(4 * steps):
            if len(times) == steps or len(eng.running) != b:
                break
            spec, tokens = eng.stats.spec_steps, eng.stats.draft_tokens
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            if eng.stats.spec_steps > spec:
                times.append(dt)
                drafted.append((eng.stats.draft_tokens - tokens) / b)
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.clear_prefix_cache()
        if len(times) < 2:
            raise RuntimeError(f"measure_verify: {len(times)} verifying steps at batch {b}")
        out.append(Point(model, "verify", b, context, float(np.median(times[1:])), float(np.mean(drafted[1:]))))
    return out


COLOCATED_SHAPES = (("decode", 2, 2048), ("decode", 4, 1024), ("decode", 8, 512), ("prefill", 1, 256))


def prefill_step_times(eng, tokens: int, steps: int, warmup: int = 1, seed: int = 0) -> list[float]:
    """Seconds of each of `steps` steps of `eng` that each prefill one fresh prompt of `tokens` random
    tokens (at most the engine's ``max_tokens_per_step``: one step), after `warmup` untimed (the first
    compiles); the engine is left with no request and an empty prefix cache."""
    if tokens > eng.config.max_tokens_per_step:
        raise ValueError(f"prefill_step_times: tokens={tokens} exceeds max_tokens_per_step="
                         f"{eng.config.max_tokens_per_step} (one step a prompt)")
    rng = np.random.default_rng(seed)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(warmup + steps):
        eng.add_request(rng.integers(0, eng.model.cfg.vocab_size, tokens).tolist(), one)
        t = time.perf_counter()
        eng.step()
        if i >= warmup:
            out.append(time.perf_counter() - t)
        _drain(eng)
        eng.clear_prefix_cache()
    return out


def _shape_step_times(eng, shape: tuple[str, int, int], steps: int, seed: int) -> list[float]:
    kind, batch, tokens = shape
    if kind == "decode":
        return decode_step_times(eng, batch, tokens, steps, seed=seed)[0]
    return prefill_step_times(eng, tokens, steps, seed=seed)


def measure_colocated(engines: Sequence, *, shapes: Sequence[tuple[str, int, int]] = COLOCATED_SHAPES,
                      steps: int = 6, reps: int = 3) -> dict:
    """How much slower a replica steps while the other replicas of this host step at once.

    For each shape of `shapes` (``("decode", batch, context)``: `decode_step_times`'s steps;
    ``("prefill", 1, tokens)``: `prefill_step_times`'), `reps` times: `steps` steps of `engines[0]`
    alone, then `steps` steps of every engine of `engines` (replicas on this host, each on its own
    devices) at once, each in its own thread; each rep's ratio is the median step together over the
    median step alone just before it, so the machine's drift between reps cancels. Returns
    ``shapes``: per shape, its ``kind``, ``batch``, ``tokens``, ``step_alone_s`` and
    ``step_together_s`` (medians over its reps) and ``slowdown`` (the median of its reps' ratios);
    ``slowdown``: the median of every rep's ratio of every shape (``colocated_step_slowdown``)."""
    for shape in shapes:
        if shape[0] not in ("decode", "prefill") or (shape[0] == "prefill" and shape[1] != 1):
            raise ValueError(f"measure_colocated: shape {tuple(shape)} is neither ('decode', batch, context) nor "
                             f"('prefill', 1, tokens)")
    per_shape, ratios = [], []
    for shape in shapes:
        for eng in engines:  # compiled before anything is timed
            _shape_step_times(eng, shape, 1, seed=0)
        alone, together, mine = [], [], []
        for r in range(reps):
            a = _shape_step_times(engines[0], shape, steps, seed=r)
            got: list[list[float]] = [[] for _ in engines]
            errors: list[BaseException] = []

            def run(i: int) -> None:
                try:
                    got[i] = _shape_step_times(engines[i], shape, steps, seed=r)
                except BaseException as e:  # raised below, on the calling thread
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            g = [x for times in got for x in times]
            alone += a
            together += g
            mine.append(float(np.median(g) / np.median(a)))
        ratios += mine
        per_shape.append({"kind": shape[0], "batch": shape[1], "tokens": shape[2],
                          "step_alone_s": float(np.median(alone)), "step_together_s": float(np.median(together)),
                          "slowdown": float(np.median(mine))})
    return {"shapes": per_shape, "slowdown": float(np.median(ratios))}


def measure_copies(inst: Instance, model: str, tokens: int = 512, reps: int = 3) -> dict[str, float]:
    """Seconds of: a weight load from pinned host memory, a staged switch (the slot's device-to-device
    copy; a model in its own arrays under a weight budget: taking the arrived copy), and a `tokens`-token
    KV offload and restore; with the bytes each moved."""
    s = inst.served[model]
    eng, slot, weights = s.engine, inst.slot, inst.weights
    if slot is None and weights is None:
        raise ValueError("measure_copies: the instance's models stay resident (no weights to copy)")
    nbytes = weights.nbytes(model) if weights is not None else s.host.layout.bytes_per_device * slot.mesh.devices.size
    res: dict[str, float] = {"weight_bytes": float(nbytes)}
    load, d2d = [], []
    for _ in range(reps):
        if weights is not None:
            weights.evict_all()
            t = time.perf_counter()
            weights.load(model)
            load.append(time.perf_counter() - t)
            weights.evict_all()
            weights.stage(model, keep=None)
            weights.wait_staged()
            t = time.perf_counter()
            weights.load(model)
            d2d.append(time.perf_counter() - t)
            continue
        t = time.perf_counter()
        slot.load(s.host)
        slot.array.block_until_ready()
        load.append(time.perf_counter() - t)
        slot.stage(s.host)
        slot.wait_staged()
        t = time.perf_counter()
        slot.activate_staged()
        slot.array.block_until_ready()
        d2d.append(time.perf_counter() - t)
    res["weight_load_s"], res["d2d_s"] = min(load), max(min(d2d), 1e-6)
    rng = np.random.default_rng(1)
    eng.add_request(rng.integers(0, eng.model.cfg.vocab_size, tokens).tolist(),  # runs on after its prefill
                    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    req = next(iter(eng.requests.values()))
    while req.num_computed < tokens:
        eng.step()
    off, on = [], []
    for _ in range(reps):
        t = time.perf_counter()
        kv = eng.host_tier.offload(eng.runner.kv, req.seq.pages, req.prompt[:tokens])
        kv.data.block_until_ready()
        off.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.runner.kv = eng.host_tier.restore(eng.runner.kv, kv, req.seq.pages[:kv.num_pages])
        eng.runner.kv.block_until_ready()
        on.append(time.perf_counter() - t)
        eng.host_tier.release(kv)
    _drain(eng)
    eng.clear_prefix_cache()
    res["kv_bytes"] = float(kv.nbytes)
    res["kv_offload_s"], res["kv_restore_s"] = min(off), min(on)
    return res


class KeepStaging:
    """Called before each step, keeps a staging copy of `host` in flight in `slot` (a ``WeightSlot``, or
    `StagingBeside` a weight budget's active model): it issues ``slot.stage(host)`` whenever nothing is
    staging or the last copy has arrived. Between an arrival and the next call nothing is in flight, so
    a step slowed by the copy is slightly under-counted. `copies` counts the copies issued; `settle`
    waits for the one in flight and frees the staging buffer."""

    def __init__(self, slot, host):
        self.slot, self.host, self.copies = slot, host, 0

    def __call__(self) -> None:
        if self.slot.staged is None or self.slot.staged_ready():
            self.slot.stage(self.host)
            self.copies += 1

    def settle(self) -> None:
        self.slot.wait_staged()
        self.slot.drop_staged()


class StagingBeside:
    """A weight budget's staging (``DeviceWeights``) in a ``WeightSlot``'s terms, for `KeepStaging`:
    `stage(model)` copies `model` to the devices beside `active` (a fresh copy each time)."""

    def __init__(self, weights, active: str):
        self.weights, self.active = weights, active

    @property
    def staged(self) -> str | None:
        return self.weights.staging

    def staged_ready(self) -> bool:
        return self.weights.staged_ready()

    def stage(self, model: str) -> None:
        self.weights.drop_staged()
        self.weights.evict(model)  # a copy on the devices already would leave nothing to stage
        if not self.weights.stage(model, keep=self.active) or self.weights.staging != model:
            raise ValueError(f"calibration: {model} does not fit the weight budget beside {self.active}")

    def wait_staged(self) -> None:
        self.weights.wait_staged()

    def drop_staged(self) -> None:
        self.weights.drop_staged()


def start_synthetic_decode(eng, batch: int, context: int, max_tokens: int, seed: int = 0) -> None:
    """Puts `batch` sequences of random tokens straight into `eng`'s running batch, their first `context`
    tokens counting as cached (pages held, contents whatever the pool holds), so only the last prompt
    token is computed and every later step is decode-shaped: decode timed at any context, no prefill."""
    from talaria_jax.engine.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    for _ in range(batch):
        rid = eng.add_request(rng.integers(0, eng.model.cfg.vocab_size, context).tolist(),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        req = eng.requests[rid]
        req.seq.grow(eng.allocator, context)
        req.num_computed = context - 1
        eng.waiting.remove(req)
        eng.running.append(req)


def decode_step_times(eng, batch: int, context: int, steps: int, keep: KeepStaging | None = None,
                      warmup: int = 3, seed: int = 0) -> tuple[list[float], list[float]]:
    """Seconds of each of `steps` decode steps of `eng` with nothing staging and, when `keep` is
    given, of `steps` more with its staging copy kept in flight (``keep()`` runs before each of
    them, inside the timed step: a serving loop pays it too; the copy has arrived and its buffer is
    freed when this returns). The batch: `batch` sequences of random tokens whose first `context`
    count as cached (pages held, contents whatever the pool holds: only the last prompt token is
    computed, so every timed step is decode-shaped), `warmup` untimed steps first (the first
    compiles). The sequences are aborted at the end, so the engine can be timed again."""
    start_synthetic_decode(eng, batch, context, max_tokens=warmup + 2 * steps + 1, seed=seed)
    try:
        for _ in range(warmup):
            eng.step()
        if len(eng.running) != batch:
            raise RuntimeError(f"calibration: {len(eng.running)} of {batch} sequences decoding (raise max_seqs)")

        def timed(before) -> list[float]:
            out = []
            for _ in range(steps):
                t = time.perf_counter()
                before()
                eng.step()
                out.append(time.perf_counter() - t)
            return out

        idle = timed(lambda: None)
        staging = [] if keep is None else timed(keep)
    finally:
        if keep is not None:
            keep.settle()
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.clear_prefix_cache()  # the synthetic prefixes' pages must not be matched later
    return idle, staging


def measure_staging(inst: Instance, model: str, staged: str, *, batch: int = 4, context: int = 256, steps: int = 6,
                    reps: int = 3) -> dict[str, float]:
    """Median decode step seconds of `model` on `inst` (loaded into the slot) with nothing staging
    (`step_idle_s`) and with a staging copy of `staged` kept in flight (`step_staging_s`), over
    `reps` alternations of `steps` steps each (`decode_step_times`); `slowdown` is their ratio."""
    if model == staged:
        raise ValueError(f"measure_staging: the staged model must differ from the active one ({model!r})")
    s = inst.served[model]
    _load(inst, model)
    keep = KeepStaging(inst.slot, inst.served[staged].host) if inst.weights is None else \
        KeepStaging(StagingBeside(inst.weights, model), staged)
    idle, staging = [], []
    for r in range(reps):
        i, b = decode_step_times(s.engine, batch, context, steps, keep, seed=r)
        idle += i
        staging += b
    s.engine.clear_prefix_cache()
    res = {"step_idle_s": float(np.median(idle)), "step_staging_s": float(np.median(staging)),
           "staging_copies": float(keep.copies)}
    res["slowdown"] = res["step_staging_s"] / res["step_idle_s"]
    return res


def staging_slowdown(measured: Sequence[dict[str, float]]) -> float:
    """``staging_step_slowdown`` from `measure_staging` results: the mean of their step-time ratios,
    at least 1 (a copy that seems to speed a step up is noise); 1 when nothing was measured."""
    if not measured:
        return 1.0
    return max(1.0, float(np.mean([m["step_staging_s"] / m["step_idle_s"] for m in measured])))


def fit(points: list[Point], copies: dict[str, float], inst: Instance, name: str = "cpu",
        staging: Sequence[dict[str, float]] = (), colocated: float = 1.0, tiles=None) -> HardwareConfig:
    """The profile whose cost model best reproduces `points` and `copies` (least squares, see module
    doc), with ``staging_step_slowdown`` from the `measure_staging` results `staging` and
    ``colocated_step_slowdown`` `colocated` (`measure_colocated`'s, at least 1). tiles: the measured
    engine's step layout (`engine.runner.TileRules`) where its simulator prices steps by it
    (`CostModel.tiles`: the rollout replay's; `_fit_tiled`), else None."""
    n = inst.arena.mesh.devices.size
    shapes = inst.shapes()
    # unit rates: the probe's decode seconds x n x GB are the bytes a step reads
    probe = HardwareConfig(name=name, num_gpus=n, hbm_gib_per_gpu=1.0, memory_utilization=1.0, hbm_bw_gbps=1.0,
                           hbm_bw_efficiency=1.0, matmul_tflops=1.0, prefill_efficiency=1.0, nvlink_gbps=1e4,
                           allreduce_latency_us=0.0, step_overhead_us=0.0, pcie_h2d_gbps=1.0, pcie_d2h_gbps=1.0,
                           weight_load_efficiency=1.0, d2d_gbps=1.0, host_memory_gb=1.0, host_reserve_gb=0.0)
    best = _fit_tiled(points, shapes, probe, tiles) if tiles is not None else _fit_ragged(points, shapes, probe, inst)
    kv_h2d = copies["kv_bytes"] / copies["kv_restore_s"]
    weight_h2d = copies["weight_bytes"] / copies["weight_load_s"]
    h2d = max(kv_h2d, weight_h2d)
    capacity = inst.capacity / n
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return dataclasses.replace(
        best, hbm_gib_per_gpu=max(1.0, capacity / GIB), pcie_h2d_gbps=h2d / n / GB,
        pcie_d2h_gbps=copies["kv_bytes"] / copies["kv_offload_s"] / n / GB,
        weight_load_efficiency=weight_h2d / h2d,
        d2d_gbps=min(1e5, max(1.0, 2 * copies["weight_bytes"] / copies["d2d_s"] / n / GB)),
        host_memory_gb=mem, host_reserve_gb=mem / 4, staging_step_slowdown=staging_slowdown(staging),
        colocated_step_slowdown=max(1.0, colocated))


def _fit_ragged(points: list[Point], shapes: dict, probe: HardwareConfig, inst: Instance) -> HardwareConfig:
    """`fit`'s step rates where the simulator prices each sequence's attention reading its own context
    (no tiles): decode points fit the weights' and the KV's read rates (and a fixed cost, where models
    of several sizes tell it apart), prefill points the matmul rate, both overlapped (a GPU's roofline)
    or added (a CPU's cores), whichever fits better; prefill after a cached context the attention's
    rate; verifying steps their overhead per token."""
    cost, n = CostModel(probe), probe.num_gpus
    verify = [p for p in points if p.kind == "verify"]
    after = [p for p in points if p.kind == "prefill" and p.past]
    points = [p for p in points if p.kind != "verify" and not p.past]

    def work(p: Point) -> tuple[float, float, float]:
        """A point's step beside its weights: KV bytes read (and written), FLOPs, of those attention's
        at ``attention_efficiency`` (`CostModel.step_work`; a decode step's as `decode_step_s` prices it)."""
        m = shapes[p.model]
        if p.kind == "decode":
            return p.batch * p.tokens * m.kv_bytes_per_token, cost.decode_flops(m, p.batch, p.batch * p.tokens), 0.0
        _, kv, _, flops, attention = cost.step_work(m, [(p.tokens, p.past)])
        return kv, flops, attention

    # per point: weight bytes read, KV bytes read (and written), FLOPs, the attention's part of those
    w = np.array([cost.decode_step_s(shapes[p.model], p.batch if p.kind == "decode" else 1, 0) * n * GB
                  for p in points])
    kv, flops, attention = (np.array(c) for c in zip(*map(work, points)))
    t = np.array([p.seconds for p in points])
    decode = np.array([p.kind == "decode" for p in points])
    # with one size of weights (one dense model) a step's fixed cost cannot be told from their read: 0
    sizes = np.ones(len(points)) if np.ptp(w) > 0.01 * w.mean() else np.zeros(len(points))

    def profile(overhead: float, inv_w: float, inv_kv: float, inv_flops: float, overlap: float) -> HardwareConfig:
        return dataclasses.replace(
            probe, hbm_bw_gbps=1.0 / max(inv_w, 1e-15) / n / GB, matmul_tflops=1.0 / max(inv_flops, 1e-30) / n / 1e12,
            step_overhead_us=overhead * 1e6, kv_bw_efficiency=min(1.0, max(0.01, inv_w / inv_kv)) if inv_kv > inv_w
            else 1.0, compute_memory_overlap=overlap)

    def base(efficiency: float) -> HardwareConfig:
        f = flops + attention * (1.0 / efficiency - 1.0)
        # overlapped (a GPU's roofline): decode is memory bound, t = overhead + weights / rate + KV / (rate x
        # kv efficiency); prefill compute bound, t - overhead = FLOPs / matmul rate
        a, inv_w, inv_kv = _nonneg_lstsq(np.c_[sizes, w, kv][decode], t[decode])
        left = np.maximum(t[~decode] - a, 1e-6)
        inv_flops = float(f[~decode] @ left / (f[~decode] @ f[~decode])) if (~decode).any() else 1e-30
        fits = [profile(a, inv_w, inv_kv, inv_flops, 1.0)]
        # added (a CPU's cores both read and compute): t = overhead + weights / rate + KV / (...) + FLOPs / matmul rate
        fits.append(profile(*_nonneg_lstsq(np.c_[sizes, w, kv, f], t), 0.0))
        fits = [dataclasses.replace(hw, attention_efficiency=efficiency) for hw in fits]
        errors = [sum((pred / p.seconds - 1) ** 2 for p, pred in predicted(hw, inst, points)) for hw in fits]
        return fits[int(np.argmin(errors))]

    best = base(1.0)
    # prefill after a cached context: the seconds beyond the fit's are its attention's, at a lower rate than the
    # matmuls'; that rate and the base fit (whose fresh prompts attend too) settle together
    after_attention = np.array([work(p)[2] for p in after])
    for _ in range(20 if after_attention.any() else 0):
        left = np.array([p.seconds - pred for p, pred in predicted(best, inst, after)])
        per_flop = float(after_attention @ left / (after_attention @ after_attention))  # seconds per FLOP beyond
        rate = best.num_gpus * best.matmul_tflops * 1e12 * best.prefill_efficiency
        inverse = 1.0 / best.attention_efficiency + per_flop * rate
        efficiency = 1.0 if inverse <= 1.0 else max(0.001, 1.0 / inverse)
        if abs(efficiency / best.attention_efficiency - 1.0) < 1e-4:
            break
        best = base(efficiency)
    if verify:  # what verifying steps take beyond their chunks' prefill cost, per token (least squares)
        left = np.array([p.seconds - pred for p, pred in predicted(best, inst, verify)])
        tokens = np.array([p.batch * (1 + round(p.drafted)) for p in verify])
        best = dataclasses.replace(best, verify_token_overhead_us=max(0.0, float(tokens @ left / (tokens @ tokens))) * 1e6)
    return best


def _fit_tiled(points: list[Point], shapes: dict, probe: HardwareConfig, tiles) -> HardwareConfig:
    """`fit`'s step rates where the simulator prices a step with the runner's tiles: every point is a
    step `CostModel.prefill_batch_s` prices (plus `verify_overhead_s` for a verifying one), linear in
    the profile's inverse rates (the weights' read, the KV's, the tiles' walk, the matmuls', the
    attention's, a verified token's overhead, and a fixed cost where models of several sizes tell it
    from the weights' read), compute and memory times added (a CPU's cores do both). One least squares
    over all points at once, on relative errors (a 50 ms step weighs as much as a 1.5 s one), every
    rate's coefficient >= 0."""
    cost, n = CostModel(probe, tiles), probe.num_gpus
    rows = []
    for p in points:
        chunks = _chunks(p)
        m = shapes[p.model]
        _, kv, walked, flops, attention = cost.step_work(m, chunks)
        verified = sum(c for c, _ in chunks) if p.kind == "verify" else 0
        rows.append([m.weight_bytes, kv, walked, flops - attention, attention, verified])
    a, t = np.array(rows, dtype=float), np.array([p.seconds for p in points])
    # with one size of weights (one dense model) a step's fixed cost cannot be told from their read: 0
    sizes = np.ones(len(points)) if np.ptp(a[:, 0]) > 0.01 * a[:, 0].mean() else np.zeros(len(points))
    # the KV's read and the tiles' walk run at an efficiency of the weights' read rate (column 0), the
    # attention at one of the matmuls' (3), each at most `bound`: a term the fit puts faster is refitted
    # at its bound, its column folded into its base's
    base, bound, fixed = {1: 0, 2: 0, 4: 3}, {1: 1.0, 2: 100.0, 4: 1.0}, set()
    while True:
        x = a.copy()
        for c in fixed:
            x[:, base[c]] += a[:, c] / bound[c]
            x[:, c] = 0.0
        coef = _nonneg_lstsq(np.c_[sizes, x] / t[:, None], np.ones(len(t)))
        overhead, inv, verified = coef[0], coef[1:6], coef[6]
        if inv[0] <= 0 or inv[3] <= 0:
            raise ValueError(f"calibration: the fit leaves no time for the {'weights read' if inv[0] <= 0 else 'matmuls'}"
                             f" of its {len(points)} points; time more batches and contexts")
        faster = {c for c in base if c not in fixed and inv[c] < inv[base[c]] / bound[c]}
        if not faster:
            break
        fixed |= faster

    def efficiency(c: int, low: float) -> float:
        return bound[c] if c in fixed else max(low, inv[base[c]] / inv[c])

    return dataclasses.replace(
        probe, step_overhead_us=overhead * 1e6, hbm_bw_gbps=1.0 / inv[0] / n / GB, kv_bw_efficiency=efficiency(1, 0.01),
        tile_walk_efficiency=efficiency(2, 0.01), matmul_tflops=1.0 / inv[3] / n / 1e12,
        attention_efficiency=efficiency(4, 0.001), compute_memory_overlap=0.0, verify_token_overhead_us=verified * 1e6)


def _chunks(p: Point) -> list[tuple[int, int]]:
    """A point's step as (new tokens, cached tokens) per sequence."""
    if p.kind == "decode":
        return [(1, p.tokens)] * p.batch
    if p.kind == "verify":
        return [(1 + round(p.drafted), p.tokens)] * p.batch
    return [(p.tokens, p.past)]


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares `a x ~ y` with every coefficient >= 0: the best unconstrained fit over the
    subsets of `a`'s (few) columns whose fit has no negative coefficient, the others 0."""
    best, out = np.inf, [0.0] * a.shape[1]
    for keep in itertools.product((False, True), repeat=a.shape[1]):
        cols = [i for i, k in enumerate(keep) if k]
        if not cols:
            continue
        c = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        err = float(np.sum((a[:, cols] @ c - y) ** 2))
        if (c >= 0).all() and err < best:
            best, out = err, [0.0] * a.shape[1]
            for i, v in zip(cols, c):
                out[i] = float(v)
    return out


def predicted(hw: HardwareConfig, inst: Instance, points: list[Point], tiles=None) -> list[tuple[Point, float]]:
    """Each point next to the fitted cost model's seconds for it (with `tiles`, as `fit`'s)."""
    cost, shapes = CostModel(hw, tiles), inst.shapes()

    def seconds(p: Point) -> float:
        m = shapes[p.model]
        if p.kind == "decode" and tiles is None:
            return cost.decode_step_s(m, p.batch, p.batch * p.tokens)
        if p.kind == "verify":
            return cost.verify_batch_s(m, _chunks(p))
        return cost.prefill_batch_s(m, _chunks(p))

    return [(p, seconds(p)) for p in points]


def to_yaml(hw: HardwareConfig, header: str) -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for f in dataclasses.fields(hw):
        v = getattr(hw, f.name)
        lines.append(f"{f.name}: {v if isinstance(v, (int, str)) else float(f'{v:.6g}')}")
    return "\n".join(lines) + "\n"
