"""talaria_jax.calibration's staging and colocation measurements on real engines (what they leave behind;
their times are measured, not asserted), the slowdown fit, the step fits (a profile recovered from
its own points, ragged and with the runner's tiles), and the profile round trip through to_yaml."""
import dataclasses
import types

import jax
import numpy as np
import pytest

from talaria_jax import calibration
from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.hardware import load_hardware
from talaria_jax.weights.slot import HostWeights, WeightSlot, without_weights


@pytest.fixture(scope="module")
def slot_engine():
    """tiny-dense decoding out of a weight slot on one device, and tiny-moe's host weights to stage."""
    mesh = make_mesh(jax.devices()[:1])
    models = {n: init_model(load_model_config(n), mesh, seed=1) for n in ("tiny-dense", "tiny-moe")}
    hosts = {n: HostWeights.of(m) for n, m in models.items()}
    slot = WeightSlot.for_layouts(mesh, [h.layout for h in hosts.values()])
    eng = Engine(without_weights(models["tiny-dense"]), EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64,
                                                                      max_model_len=128, prefix_cache=True,
                                                                      warmup=False))
    eng.runner.use_slot(slot, hosts["tiny-dense"].layout)
    slot.load(hosts["tiny-dense"])
    return models["tiny-dense"], eng, slot, hosts["tiny-moe"]


def test_decode_step_times_keeps_staging_in_flight_and_leaves_the_engine_clean(slot_engine):
    model, eng, slot, other = slot_engine
    keep = calibration.KeepStaging(slot, other)
    idle, staging = calibration.decode_step_times(eng, batch=2, context=24, steps=4, keep=keep)
    assert len(idle) == len(staging) == 4 and min(idle + staging) > 0
    assert keep.copies >= 1  # issued before the first staging step (and again each time one arrived)
    # settled and cleaned up: no staging buffer, no request, no page held, nothing left in the prefix cache
    assert slot.staged is None and not eng.requests and eng.allocator.num_free == eng.allocator.num_pages
    assert eng.prefix_cache.num_pages == 0
    idle, staging = calibration.decode_step_times(eng, batch=2, context=24, steps=3)
    assert len(idle) == 3 and staging == []
    # the slot still holds tiny-dense: the engine decodes exactly as the model does
    prompt = list(range(1, 20))
    out = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), progress=False)
    assert out[0].token_ids == greedy_generate(model, [prompt], 5)[0]


def test_staging_slowdown_fit():
    assert calibration.staging_slowdown([]) == 1.0
    r = lambda idle, busy: {"step_idle_s": idle, "step_staging_s": busy}
    assert calibration.staging_slowdown([r(0.01, 0.02), r(0.1, 0.15)]) == pytest.approx(1.75)
    assert calibration.staging_slowdown([r(0.1, 0.09)]) == 1.0  # never below 1: a faster step is noise


def test_profile_round_trips_through_to_yaml(tmp_path):
    hw = dataclasses.replace(load_hardware("cpu"), staging_step_slowdown=1.8)
    p = tmp_path / "cpu2.yaml"
    p.write_text(calibration.to_yaml(hw, "a header\nof two lines"))
    assert "staging_step_slowdown: 1.8" in p.read_text()
    assert load_hardware(p) == dataclasses.replace(hw, name="cpu")


def test_nonneg_lstsq_keeps_every_coefficient_at_least_zero():
    a = np.c_[np.ones(4), [1.0, 2.0, 3.0, 4.0]]
    assert calibration._nonneg_lstsq(a, a @ [0.5, 2.0]) == pytest.approx([0.5, 2.0])
    # the unconstrained fit's intercept would be negative: it is 0 and the slope refitted alone
    y = np.array([1.0, 3.0, 5.0, 7.0])  # y = 2x - 1
    assert calibration._nonneg_lstsq(a, y) == pytest.approx([0.0, float(a[:, 1] @ y / (a[:, 1] @ a[:, 1]))])


_COPIES = dict(kv_bytes=1e6, kv_restore_s=1e-3, kv_offload_s=1e-3, weight_bytes=1e8, weight_load_s=0.05, d2d_s=0.01)


def _points(cost, shape, batches, decode_s):
    """Calibration points of tiny-dense priced by `cost` (decode steps by `decode_s(batch, context)`),
    and an instance that serves its shape."""
    points = [calibration.Point("tiny-dense", "decode", b, c, decode_s(b, c)) for b in batches for c in (256, 2048)]
    points += [calibration.Point("tiny-dense", "prefill", 1, n, cost.prefill_s(shape, n, past), past=past)
               for n in (16, 64, 256) for past in (0, 1024, 2048)]
    points += [calibration.Point("tiny-dense", "verify", b, 512, cost.verify_batch_s(shape, [(1 + d, 512)] * b), d)
               for b, d in ((1, 6), (4, 3), (8, 5))]
    inst = types.SimpleNamespace(arena=types.SimpleNamespace(mesh=types.SimpleNamespace(devices=np.zeros(1))),
                                 shapes=lambda: {"tiny-dense": shape}, capacity=2**30)
    return points, inst


def test_fit_recovers_a_profile_from_its_own_points():
    """Points priced by a known profile (one dense model, KV read at 40% of the weights' rate, prefill
    attention at 20% of the matmul rate, two replicas slowing each other 1.4x, a verified token 2 ms
    dearer than a prefill token) fit back to it: with one size of weights the overhead is 0."""
    from talaria_jax.sim.cost import CostModel
    from talaria_jax.sim.hardware import ModelShape

    cfg = load_model_config("tiny-dense")
    shape = ModelShape.from_config(cfg, "float32", 1, name="tiny-dense")
    truth = dataclasses.replace(load_hardware("cpu"), name="t", hbm_bw_gbps=11.0, kv_bw_efficiency=0.4,
                                step_overhead_us=0.0, colocated_step_slowdown=1.4, verify_token_overhead_us=2000.0,
                                attention_efficiency=0.2)
    cost = CostModel(truth)
    points, inst = _points(cost, shape, (1, 4, 8), lambda b, c: cost.decode_step_s(shape, b, b * c))
    hw = calibration.fit(points, _COPIES, inst, name="t", colocated=1.4)
    assert hw.hbm_bw_gbps == pytest.approx(11.0, rel=1e-3) and hw.kv_bw_efficiency == pytest.approx(0.4, rel=1e-3)
    assert hw.step_overhead_us == 0.0 and hw.colocated_step_slowdown == 1.4
    assert hw.verify_token_overhead_us == pytest.approx(2000.0, rel=0.05)  # verified tokens cost 2 ms more
    assert hw.attention_efficiency == pytest.approx(0.2, rel=0.01)
    for p, pred in calibration.predicted(hw, inst, points):
        assert p.kind == "prefill" or pred == pytest.approx(p.seconds, rel=1e-3)


@pytest.mark.parametrize("kv,walk,attention", [(0.4, 1.5, 0.2), (1.0, 100.0, 1.0)])
def test_fit_recovers_a_profile_priced_with_the_runners_tiles(kv, walk, attention):
    """The rollout calibration's fit, where the replay prices steps with the runner's tiles
    (`CostModel.tiles`): points priced so (chunks of 16 tokens run as tiles of one, decode batches
    padded to their bucket; the KV read once at 40% of the weights' rate, the tiles' walk at 1.5x,
    attention at 20% of the matmuls'; or each at its bound, where a free fit may put it past) fit
    back to the profile that priced them, every point within 0.1%."""
    from talaria_jax.engine.runner import TileRules
    from talaria_jax.sim.cost import CostModel
    from talaria_jax.sim.hardware import ModelShape

    cfg = load_model_config("tiny-dense")
    shape = ModelShape.from_config(cfg, "float32", 1, name="tiny-dense")
    tiles = TileRules(max_tokens_per_step=256, max_seqs=8, page_size=16)
    truth = dataclasses.replace(load_hardware("cpu_rollout"), name="t", hbm_bw_gbps=11.0, matmul_tflops=0.2,
                                kv_bw_efficiency=kv, tile_walk_efficiency=walk, step_overhead_us=0.0,
                                verify_token_overhead_us=2000.0, attention_efficiency=attention, compute_memory_overlap=0.0)
    cost = CostModel(truth, tiles)
    points, inst = _points(cost, shape, (1, 3, 8), lambda b, c: cost.prefill_batch_s(shape, [(1, c)] * b))
    hw = calibration.fit(points, _COPIES, inst, name="t", tiles=tiles)
    for field in ("hbm_bw_gbps", "matmul_tflops", "kv_bw_efficiency", "tile_walk_efficiency", "attention_efficiency",
                  "verify_token_overhead_us"):
        assert getattr(hw, field) == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert hw.step_overhead_us == 0.0 and hw.compute_memory_overlap == 0.0
    for p, pred in calibration.predicted(hw, inst, points, tiles):
        assert pred == pytest.approx(p.seconds, rel=1e-3)


def test_a_weight_budget_instance_is_measured_through_its_own_copies():
    """Under a weight budget the load is a host-to-device copy of the model's own arrays, a staged switch
    takes the arrived copy, and a staging copy beside the active model is kept in flight, then freed."""
    from talaria_jax.instance import Instance, SessionTokens, shapes_of
    from talaria_jax.sim.toys import TOY_HW
    from talaria_jax.weights.budget import held_bytes

    mesh = make_mesh(jax.devices()[:1])
    models = {n: init_model(load_model_config(n), mesh, seed=1) for n in ("tiny-dense", "tiny-moe")}
    inst = Instance("i0", models, dataclasses.replace(TOY_HW, num_gpus=1), shapes_of(models, 1),
                    engine_config=EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=128,
                                               num_pages=32, warmup=False),
                    tokens=SessionTokens(), resident=True, weight_budget_bytes=sum(map(held_bytes, models.values())))
    copies = calibration.measure_copies(inst, "tiny-moe", tokens=24, reps=1)
    assert copies["weight_bytes"] == held_bytes(models["tiny-moe"]) and copies["weight_load_s"] > 0
    assert 0 < copies["d2d_s"] < copies["weight_load_s"]  # no copy left to make
    calibration.measure_model(inst, "tiny-dense", batches=(1,), contexts=(16,), prompts=(16,), steps=1)
    w = inst.weights
    keep = calibration.KeepStaging(calibration.StagingBeside(w, "tiny-dense"), "tiny-moe")
    assert w.on_device("tiny-moe")  # (measure_copies left it there): staging makes a fresh copy anyway
    keep()
    assert w.staging == "tiny-moe" and not w.on_device("tiny-moe") and keep.copies == 1
    idle, staging = calibration.decode_step_times(inst.served["tiny-dense"].engine, batch=2, context=16, steps=3,
                                                  keep=keep)
    assert len(staging) == 3 and keep.copies >= 1 and w.staging is None and w.on_device("tiny-dense")


def test_colocated_slowdown_pairs_each_rep_per_shape_and_leaves_the_engines_clean():
    """measure_colocated on two tiny replicas: one result per shape (decode and prefill), the overall
    slowdown among theirs, the engines left as they were, and a shape it cannot time refused up front."""
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    cfg = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=128, prefix_cache=True,
                       warmup=False)
    engines = [Engine(init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[r:r + 1]), seed=1), cfg)
               for r in range(2)]
    shapes = (("decode", 2, 24), ("prefill", 1, 32))
    r = calibration.measure_colocated(engines, shapes=shapes, steps=2, reps=3)
    assert [(c["kind"], c["batch"], c["tokens"]) for c in r["shapes"]] == list(shapes)
    assert all(c["step_alone_s"] > 0 and c["step_together_s"] > 0 and c["slowdown"] > 0 for c in r["shapes"])
    assert min(c["slowdown"] for c in r["shapes"]) <= r["slowdown"] <= max(c["slowdown"] for c in r["shapes"])
    for eng in engines:  # nothing left behind: the engines serve exactly as the model does
        assert not eng.requests and eng.allocator.num_free == eng.allocator.num_pages
        assert eng.prefix_cache.num_pages == 0
        prompt = list(range(1, 20))
        out = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), progress=False)
        assert out[0].token_ids == greedy_generate(model, [prompt], 4)[0]
    with pytest.raises(ValueError, match="max_tokens_per_step=32"):
        calibration.prefill_step_times(engines[0], 33, steps=1)
    with pytest.raises(ValueError, match="'verify'"):
        calibration.measure_colocated(engines, shapes=(("verify", 2, 24),), steps=1, reps=1)
