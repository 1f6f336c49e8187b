"""Switching the model in a weight slot: staged vs loaded from pinned host memory vs an Orbax restore,
and what staging the next model costs the decode of the current one.

Two models of one config (a ~125M-parameter fp32 Llama with the defaults, random init, seeds 0 and
1). Both are copied to pinned host memory (`HostWeights.of`); the slot (`WeightSlot`) holds one at a
time, and the switches alternate between them. Times are best and median of `--reps` after one
untimed run of each path (the in-place copy compiles once per model size):
- activate_staged: the next model was staged (`stage`, a host-to-device copy issued while the current
  one serves) and has arrived; the switch is the device-to-device copy into the slot;
- load: host-to-device straight into the slot (nothing staged in advance);
- Orbax restore: `talaria_jax.weights.checkpoint.restore` of the model from a checkpoint in a temp
  folder into fresh device arrays (just written, so the files are likely in the OS page cache).
Each includes waiting until the copy is complete on the device. Also timed: the `stage()` call
itself (what the serving loop pays) and the staging copy from issue to arrival.

Decode: tokens/s of one engine serving model A from the slot, `--batch` sequences of `--context`
cached tokens, with nothing staging vs with model B's staging copy kept in flight throughout
(re-issued as soon as one arrives), and, for scale, an engine over model A's own parameters (no
slot). The three alternate `--reps` times; best is reported. The steps are timed by
`talaria_jax.calibration.decode_step_times` and `KeepStaging`, the same code with which
`talaria-calibrate` fits the simulator's `staging_step_slowdown` (there: the ratio of median steps).

  .venv/bin/python -m benchmarks.model_switch --out=/tmp/model_switch.json

On CPU every "device" is host memory, so host-to-device and device-to-device are both memory copies
and the staging copy competes with decode for the same cores and memory bandwidth; on a GPU the
staging copy runs on a copy engine over PCIe while decode reads HBM.
"""
from __future__ import annotations

import statistics
import tempfile

from absl import app, flags, logging

from benchmarks import common

_HIDDEN = flags.DEFINE_integer("hidden", 768, "Model hidden size (768 with 12 layers: ~125M parameters).")
_LAYERS = flags.DEFINE_integer("layers", 12, "Model layers.")
_BATCH = flags.DEFINE_integer("batch", 8, "Decode batch size.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Tokens already cached per sequence when decode is timed.")
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Timed decode steps per measurement.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each switch path and decode mode.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def decode_tok_s(times: list[float]) -> float:
    return _BATCH.value * len(times) / sum(times)


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs each save and restore at INFO, at length
    import jax

    from talaria_jax import calibration
    from talaria_jax.engine import Engine, EngineConfig
    from talaria_jax.models import init_model
    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import checkpoint
    from talaria_jax.weights.slot import HostWeights, WeightSlot, without_weights

    cfg = common.llama_config(_HIDDEN.value, _LAYERS.value)
    mesh = make_mesh(jax.devices()[:1])
    page = 16
    # calibration.decode_step_times decodes 3 warm-up steps + 2 x decode_steps (idle, then staging) + 1
    ecfg = EngineConfig(page_size=page, max_seqs=_BATCH.value, max_tokens_per_step=max(_BATCH.value, 16),
                        max_model_len=-(-(_CONTEXT.value + 2 * _STEPS.value + 8) // page) * page, warmup=False)
    a, b = (init_model(cfg, mesh, seed=s) for s in (0, 1))
    hosts = [HostWeights.of(m) for m in (a, b)]
    nbytes = hosts[0].layout.bytes_per_device
    slot = WeightSlot.for_layouts(mesh, [h.layout for h in hosts])
    print(f"model: {cfg.param_count() / 1e6:.0f}M params fp32, {nbytes / 1e6:.0f} MB per slot row; host memory "
          f"{hosts[0].data.sharding.memory_kind}; backend {jax.default_backend()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(b, tmp)
        b = without_weights(b)  # its device copy is not needed any more
        times = common.switch_times(slot, hosts, lambda: checkpoint.restore(tmp, mesh), _REPS.value)

    plain = Engine(a, ecfg)
    served = Engine(without_weights(a), ecfg)
    served.runner.use_slot(slot)
    slot.load(hosts[0])
    keep = calibration.KeepStaging(slot, hosts[1])  # model B's staging copy always in flight
    rates = {k: [] for k in ("plain", "slot_idle", "slot_staging")}
    idle_steps, staging_steps = [], []
    for _ in range(_REPS.value):
        plain_s, _ = calibration.decode_step_times(plain, _BATCH.value, _CONTEXT.value, _STEPS.value)
        idle_s, busy_s = calibration.decode_step_times(served, _BATCH.value, _CONTEXT.value, _STEPS.value, keep)
        for k, v in (("plain", plain_s), ("slot_idle", idle_s), ("slot_staging", busy_s)):
            rates[k].append(decode_tok_s(v))
        idle_steps += idle_s
        staging_steps += busy_s
    slowdown = statistics.median(staging_steps) / statistics.median(idle_steps)
    print(f"  staging kept in flight during decode: {keep.copies} copies of {nbytes / 1e6:.0f} MB in "
          f"{sum(staging_steps):.1f} s of timed steps; median step {slowdown:.2f}x idle (as talaria-calibrate "
          f"fits staging_step_slowdown)", flush=True)

    best = {k: min(v) for k, v in times.items()}
    switch_rows = [dict(path=p, best_ms=best[k] * 1e3, median_ms=statistics.median(times[k]) * 1e3,
                        gb_s=None if k == "stage_call" else nbytes / best[k] / 1e9,
                        vs_staged=best[k] / best["activate_staged"])
                   for p, k in (("activate_staged (D2D, staged in advance)", "activate_staged"),
                                ("load (H2D from pinned host)", "load"),
                                ("Orbax restore (disk, page cache)", "restore"),
                                ("stage() call (returns while copying)", "stage_call"),
                                ("staging copy, issue to arrival (H2D)", "stage_copy"))]
    common.print_markdown_table([("switch path", "path", "s"), ("best (ms)", "best_ms", ".1f"),
                                 ("median (ms)", "median_ms", ".1f"), ("GB/s", "gb_s", ".2f"),
                                 ("x activate_staged", "vs_staged", ".1f")], switch_rows)
    decode_rows = [dict(mode=m, tok_s=max(rates[k]), vs_idle=max(rates[k]) / max(rates["slot_idle"]))
                   for m, k in (("own parameters (no slot)", "plain"), ("slot, nothing staging", "slot_idle"),
                                ("slot, next model staging", "slot_staging"))]
    common.print_markdown_table([(f"decode, batch {_BATCH.value}, context {_CONTEXT.value}", "mode", "s"),
                                 ("tok/s (best)", "tok_s", ".1f"), ("x slot idle", "vs_idle", ".2f")], decode_rows)
    common.write_json(_OUT.value, dict(
        params=cfg.param_count(), bytes_per_device=nbytes, memory_kind=hosts[0].data.sharding.memory_kind,
        backend=jax.default_backend(), reps=_REPS.value, batch=_BATCH.value, context=_CONTEXT.value,
        decode_steps=_STEPS.value, switch_s=times, decode_tok_s=rates, staged_copies=keep.copies,
        staging_step_slowdown=slowdown, switch=switch_rows, decode=decode_rows))


if __name__ == "__main__":
    app.run(main)
