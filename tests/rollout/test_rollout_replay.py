"""A rollout step replayed on simulated replicas (rollout/replay.py) with the real placement objects,
suffix drafter and speculation policy: tokens are conserved under every policy, no trajectory ends
before its own work allows, cache-aware placement reuses a trajectory's KV, and drafts are accepted
exactly as far as they match what comes next."""
import dataclasses

import numpy as np
import pytest

from talaria_jax.engine.runner import TileRules
from talaria_jax.engine.spec import SpecConfig
from talaria_jax.engine.spec.suffix import Draft
from talaria_jax.rollout.placement import PlacementRequest
from talaria_jax.rollout.replay import (ReplicaShape, TrajectoryRecord, TurnRecord, accepted_tokens, read_jsonl,
                                        records_of, replay_step, synthetic_step, write_jsonl)
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import load_hardware, load_models

HW = load_hardware("h200x8")
MODEL = load_models(tp=8)["qwen3-235b-a22b-fp8"]
SHAPE = ReplicaShape(HW, MODEL, max_seqs=16, max_tokens_per_step=1024)
SPEC = SpecConfig(max_spec_tokens=8)


def step(**kw):
    return synthetic_step(4, 4, **{"turns": (2, 3), "prompt_tokens": 256, "output_tokens": 48,
                                   "observation_tokens": 64, "tool_s": 0.5, "seed": 3, **kw})


@pytest.mark.parametrize("placement,spec", [("round_robin", None), ("sticky_least_loaded", None),
                                            ("cache_aware", None),
                                            ("cache_aware", SPEC)])
def test_every_token_is_generated_once_and_no_trajectory_ends_early(placement, spec):
    trajs = step()
    res = replay_step(trajs, SHAPE, 3, placement, spec)
    assert res.output_tokens == sum(t.output_tokens for t in trajs)
    # a turn's tokens take a step each at least (fewer with accepted drafts), each step at least a
    # 1-token step's cost, and the tool's time passes between turns
    one = CostModel(HW).prefill_batch_s(MODEL, [(1, 0)])
    for t in trajs:
        steps = t.output_tokens - (res.accepted if spec else 0)
        assert res.step_s >= max(steps, len(t.turns)) * one + sum(x.tool_s for x in t.turns[:-1])
    assert sum(res.busy_s) <= 3 * res.step_s + 1e-9
    for lane in res.timeline:  # a replica runs one step at a time
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(lane, lane[1:]))
    assert replay_step(trajs, SHAPE, 3, placement, spec).step_s == res.step_s  # deterministic


def test_the_compiled_drafter_replays_the_step_the_python_one_does():
    from talaria_jax.engine.spec import suffix

    if suffix.native is None:
        pytest.skip(f"the compiled suffix drafter is not built: {suffix.NATIVE_ERROR}")
    trajs = step(repetition=0.8)
    py, native = (replay_step(trajs, SHAPE, 3, "cache_aware", SPEC, drafter=d) for d in ("python", "native"))
    assert native.accepted > 0 and (native.accepted, native.drafted, native.step_s) == (py.accepted, py.drafted,
                                                                                         py.step_s)


def test_cache_aware_placement_keeps_a_trajectory_where_its_kv_is():
    trajs = step()
    # a turn at home prefills its new tokens and the part page of the context before them at most
    at_home = sum(len(x.prompt) for t in trajs for x in t.turns) + sum(len(t.turns) - 1 for t in trajs) * SHAPE.page_size
    rr = replay_step(trajs, SHAPE, 4, "round_robin")
    ca = replay_step(trajs, SHAPE, 4, "cache_aware")
    assert ca.prefill_tokens <= at_home < rr.prefill_tokens  # round-robin recomputes contexts elsewhere


def test_drafts_pay_when_the_text_repeats_and_stop_when_it_does_not():
    repeated, random = step(repetition=1.0), step(repetition=0.0)
    plain = replay_step(repeated, SHAPE, 2, "cache_aware")
    spec = replay_step(repeated, SHAPE, 2, "cache_aware", SPEC)
    assert spec.accepted > 0.3 * spec.output_tokens and spec.step_s < 0.8 * plain.step_s
    plain = replay_step(random, SHAPE, 2, "cache_aware")
    spec = replay_step(random, SHAPE, 2, "cache_aware", SPEC)
    # random text: drafts rarely match, and the policy's acceptance estimate stops them
    assert spec.accepted < 0.05 * spec.output_tokens and spec.verify_steps < 0.2 * spec.steps
    assert spec.step_s < 1.05 * plain.step_s


def test_a_draft_is_accepted_along_its_matching_path():
    # root -> 5 -> 6, and a second root branch 7 -> 8 (depth-first, most likely first)
    d = Draft(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, -1, 2], np.int32), np.ones(4, np.float32))
    assert accepted_tokens(d, [5, 6, 1]) == 2
    assert accepted_tokens(d, [7, 8]) == 2
    assert accepted_tokens(d, [7, 1]) == 1
    assert accepted_tokens(d, [6, 5]) == 0
    assert accepted_tokens(d, [5]) == 1


def test_trajectory_files_round_trip_and_bad_input_is_named(tmp_path):
    trajs = step()
    write_jsonl(trajs, tmp_path / "t.jsonl")
    assert read_jsonl(tmp_path / "t.jsonl") == trajs
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "turns": [{"prompt": [1], "output": [2]}]}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trajectory"):
        read_jsonl(tmp_path / "bad.jsonl")
    long = TrajectoryRecord("long", "g", (TurnRecord(tuple(range(100)), (1, 2)),))
    with pytest.raises(ValueError, match="trajectory long: 102 tokens exceed a replica's KV"):
        replay_step([long], ReplicaShape(HW, MODEL, kv_tokens=64), 1)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        replay_step(trajs, SHAPE, 0)
    with pytest.raises(ValueError, match=r"ReplicaShape.tiles.max_seqs=8 differs from max_seqs=16"):
        ReplicaShape(HW, MODEL, max_seqs=16, max_tokens_per_step=1024, tiles=TileRules(1024, 8, 16))


def test_a_replica_on_the_reference_attention_is_priced_as_its_runner_lays_steps_out():
    """With its runner's tiles (`ReplicaShape.tiles`) a replica's steps pad their tokens and walk the
    longest sequence's pages in every tile: the same tokens, a longer step than a ragged kernel's."""
    from talaria_jax.models import load_model_config
    from talaria_jax.sim.hardware import ModelShape

    trajs = step()
    shape = ReplicaShape(load_hardware("cpu_rollout"), ModelShape.from_config(load_model_config("tiny-dense"), "float32", 1),
                         max_seqs=16, max_tokens_per_step=1024)
    ragged = replay_step(trajs, shape, 2, "cache_aware")
    tiled = replay_step(trajs, dataclasses.replace(shape, tiles=TileRules(1024, 16, 16)), 2, "cache_aware")
    assert (tiled.output_tokens, tiled.prefill_tokens) == (ragged.output_tokens, ragged.prefill_tokens)
    assert tiled.step_s > 1.05 * ragged.step_s


def test_the_launcher_prints_every_configuration_and_names_a_bad_flag(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "talaria_jax.launch.rollout_replay", "--replicas=2", "--prompts=2", "--samples=2",
           "--turns=1,2", "--prompt_tokens=64", "--output_tokens=24", "--observation_tokens=16"]
    run = subprocess.run(cmd + [f"--plot={tmp_path / 'timeline.png'}"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split(" | ")[0].strip("| ") for line in run.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["baseline", "sticky_least_loaded", "placement_only", "spec_only", "war"]
    assert "| baseline | " in run.stdout and "| 1.00x |" in run.stdout
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    bad = subprocess.run(cmd + ["--configs=war,nope"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--configs: unknown ['nope']" in bad.stderr
    sweep = subprocess.run(cmd + ["--sweep=1,3", f"--sweep_plot={tmp_path / 'sweep.png'}"], capture_output=True,
                           text=True, timeout=300)
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    rows = [line.split(" | ") for line in sweep.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip("| ") for r in rows[1:]] == ["1", "3"] and rows[2][1] == "6"  # 3 a replica, in groups of 2
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    agentic = [sys.executable, "-m", "talaria_jax.launch.rollout_replay", "--replicas=2", "--prompts=1", "--samples=2",
               "--workload=agentic", "--tool_scale=0", "--configs=baseline,war"]
    run = subprocess.run(agentic + ["--kv_tokens=60000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head, *rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert head[5:8] == ["hit rate", "recomputed", "preempted"] and [r[0].strip("| ") for r in rows] == ["baseline", "war"]
    # round-robin sends every other turn of a trajectory to the replica without its context
    assert int(rows[0][6]) > 10 * int(rows[1][6]) and float(rows[0][5][:-1]) < float(rows[1][5][:-1])
    small = subprocess.run(agentic + ["--kv_tokens=1000"], capture_output=True, text=True, timeout=300)
    assert small.returncode != 0 and "tokens exceed a replica's KV (62 pages of 16 tokens)" in small.stderr
    assert "Traceback" not in small.stderr


def test_a_rollout_services_trajectories_become_records():
    from talaria_jax.rollout.replica import Completion
    from talaria_jax.rollout.service import Trajectory

    def traj(prompt, parts):  # parts: ("model", ids) or ("env", ids), in order
        t = Trajectory(list(prompt))
        for kind, ids in parts:
            t.token_ids += ids
            t.mask += [int(kind == "model")] * len(ids)
            if kind == "model":
                t.turns.append(Completion("r", list(ids), [0.0] * len(ids), "stop"))
        return t

    a = traj([1, 2], [("model", [3, 4]), ("env", [5]), ("model", [6]), ("model", [7, 8])])  # no env tokens between
    b = traj([1, 2], [("model", [9]), ("env", [10, 11]), ("model", []), ("env", [12]), ("model", [13])])
    recs = records_of([[a, b]], tool_s=0.5)
    assert [r.id for r in recs] == ["p0s0", "p0s1"] and {r.group for r in recs} == {"p0"}
    assert [(x.prompt, x.output) for x in recs[0].turns] == [((1, 2), (3, 4)), ((5,), (6,)), ((), (7, 8))]
    # a turn with no output is left out: its environment tokens and the next one's go to the next turn
    assert [(x.prompt, x.output) for x in recs[1].turns] == [((1, 2), (9,)), ((10, 11, 12), (13,))]
    assert all(x.tool_s == 0.5 for r in recs for x in r.turns)
    for r, t in zip(recs, (a, b)):  # nothing lost or reordered
        assert sum((x.prompt + x.output for x in r.turns), ()) == tuple(t.prompt + t.token_ids)
    assert replay_step(recs, SHAPE, 2).output_tokens == 7


def test_replicas_of_one_host_share_its_compute():
    """Replicas on one host (a CPU's cores) slow each other by the profile's colocated_step_slowdown
    while they step at once, and not while one steps alone; GPU replicas (1 per host) never do."""
    import dataclasses

    shared = ReplicaShape(dataclasses.replace(HW, colocated_step_slowdown=1.5), MODEL, max_seqs=16,
                          max_tokens_per_step=1024)
    turn = lambda n, seed: TrajectoryRecord(f"t{seed}", f"t{seed}", (TurnRecord(tuple(range(seed, seed + 64)),
                                                                                 tuple(range(n))),))
    twins = [turn(40, 0), turn(40, 1)]
    alone = replay_step(twins, shared, 2, "round_robin")  # one replica per host: no sharing
    assert alone.step_s == replay_step(twins, SHAPE, 2, "round_robin").step_s
    together = replay_step(twins, shared, 2, "round_robin", replicas_per_host=2)
    assert together.step_s == pytest.approx(1.5 * alone.step_s)  # in lockstep: every step shared
    assert together.steps == alone.steps and together.busy_s == pytest.approx([1.5 * b for b in alone.busy_s])
    assert replay_step(twins[:1], shared, 2, "round_robin", replicas_per_host=2).step_s == pytest.approx(
        replay_step(twins[:1], SHAPE, 2, "round_robin").step_s)  # the other replica idle: full speed
    # a short and a long one: shared while both run, the long one's rest at full speed
    mixed = [turn(20, 0), turn(40, 1)]
    one = replay_step(mixed, shared, 2, "round_robin")
    two = replay_step(mixed, shared, 2, "round_robin", replicas_per_host=2)
    assert one.step_s * 1.2 < two.step_s < one.step_s * 1.3  # about (20 x 1.5 + 20) / 40 = 1.25
    with pytest.raises(ValueError, match="replicas_per_host must be >= 1"):
        replay_step(twins, SHAPE, 2, replicas_per_host=0)


def test_cache_aware_places_a_group_where_its_prompt_is_placed_as_the_service_does():
    """The service tells the placement each prompt where it places it (its KV will be there), so a
    group's siblings arriving together follow the first one, before any of them has run."""
    prompt = tuple(range(100, 356))
    group = [TrajectoryRecord(f"s{i}", "g", (TurnRecord(prompt, tuple(range(i, i + 24))),)) for i in range(4)]
    res = replay_step(group, SHAPE, 2, "cache_aware")
    assert res.timeline[0] and not res.timeline[1]  # all four on replica 0
    rr = replay_step(group, SHAPE, 2, "round_robin")
    assert rr.timeline[0] and rr.timeline[1]


def long_turns(n_traj: int, turns: int, seed: int = 0) -> list[TrajectoryRecord]:
    """Trajectories whose context grows by 200 tokens a turn from a 256-token prompt."""
    rng = np.random.default_rng(seed)
    ids = lambda n: tuple(rng.integers(0, 32000, n).tolist())
    return [TrajectoryRecord(f"t{i}", f"t{i}", tuple(TurnRecord(ids(256) if k == 0 else ids(160), ids(40), 0.2)
                                                     for k in range(turns))) for i in range(n_traj)]


def accounted(res) -> None:
    """Every admitted context token was found on the device, restored, or prefilled; once each."""
    assert res.query_tokens == res.cached_tokens + res.restored_tokens + res.prefill_tokens


def test_kv_pressure_evicts_cached_blocks_and_preempts_and_nothing_is_lost():
    """A replica whose KV holds less than its trajectories' contexts: cached blocks give way, the
    most recently admitted turn is preempted by recompute when pages run out, and every output token
    is still generated once; the tokens computed again are counted."""
    trajs = long_turns(6, 8)
    ample = replay_step(trajs, SHAPE, 2, "sticky_least_loaded")
    accounted(ample)
    assert ample.preemptions == 0 and ample.restored_tokens == 0
    assert ample.recomputed_tokens <= sum(len(t.turns) for t in trajs) * SHAPE.page_size  # a partial page a turn
    tight = ReplicaShape(HW, MODEL, max_seqs=16, max_tokens_per_step=1024, kv_tokens=2 * 1900)
    res = replay_step(trajs, tight, 2, "sticky_least_loaded")
    accounted(res)
    assert res.output_tokens == ample.output_tokens == sum(t.output_tokens for t in trajs)
    assert res.preemptions > 0 and res.recomputed_tokens > 5 * ample.recomputed_tokens
    assert res.prefill_tokens > ample.prefill_tokens and res.step_s > ample.step_s
    assert res.hit_rate < ample.hit_rate


def test_the_host_tier_restores_evicted_blocks_where_that_is_cheaper_than_recomputing_them():
    import dataclasses

    trajs = long_turns(6, 8)
    kv = dict(max_seqs=16, max_tokens_per_step=1024, kv_tokens=2 * 1900)
    none = replay_step(trajs, ReplicaShape(HW, MODEL, **kv), 2, "sticky_least_loaded")
    host = replay_step(trajs, ReplicaShape(HW, MODEL, **kv, host_kv_tokens=10**6), 2, "sticky_least_loaded")
    accounted(host)
    assert host.output_tokens == none.output_tokens
    assert host.restored_tokens > 0 and host.recomputed_tokens < none.recomputed_tokens
    assert host.prefill_tokens < none.prefill_tokens
    # a host link so slow that a copy costs more than the prefill: nothing is restored
    slow = ReplicaShape(dataclasses.replace(HW, pcie_h2d_gbps=1e-6), MODEL, **kv, host_kv_tokens=10**6)
    assert replay_step(trajs, slow, 2, "sticky_least_loaded").restored_tokens == 0


def test_cache_aware_placement_follows_where_the_blocks_are_after_eviction():
    """Blocks a replica evicts are dropped from the placement's index, so a later turn whose context
    is gone weighs load alone."""
    from talaria_jax.rollout.placement import CacheAware, PrefixIndex, ReplicaLoad

    ca = CacheAware(2, 4, 100)
    ctx = list(range(16))
    ca.computed(0, ctx)
    req = PlacementRequest(tuple(ctx + [1, 2, 3, 4]))
    loads = [ReplicaLoad(2, 4), ReplicaLoad(1, 4)]
    assert ca.choose(req, loads) == 0
    ca.evicted(0, PrefixIndex(4, 1).keys(ctx)[1:])  # all but the first block gone
    assert ca.choose(req, loads) == 1


def test_block_keys_grow_as_one_sequence_and_an_index_evicts_a_prefix_from_its_end():
    from talaria_jax.rollout.placement import BlockKeys, PrefixIndex

    toks = list(range(1, 40))
    grown = BlockKeys(4)
    for a, b in ((0, 3), (3, 9), (9, 9), (9, 39)):
        grown.extend(toks[a:b])
    idx = PrefixIndex(4, 100)
    assert grown.keys == idx.keys(toks) and len(grown.keys) == 9
    idx.insert(toks)
    other = BlockKeys(4, [7] * 8).keys
    idx.insert((), other)
    # of one prefix, the last blocks go first (a lookup leaves it whole as long as anything is left)
    assert idx.evict(3) == grown.keys[::-1][:3] and len(idx) == 8 and idx.match(toks) == 24
    assert idx.evict(2) == other[::-1]  # the matched prefix counts as used now
    assert idx.evict(10) == grown.keys[:6][::-1] and len(idx) == 0


def test_agentic_steps_have_the_cited_shape():
    from talaria_jax.rollout.replay import AgenticShape, agentic_step

    shape = AgenticShape()
    trajs = agentic_step(4, 8, seed=1)
    assert len(trajs) == 32 and len({t.turns[0].prompt for t in trajs}) == 4  # GRPO groups share a prompt
    assert all(len(t.turns[0].prompt) == shape.prompt_tokens for t in trajs)
    contexts = [sum(len(x.prompt) + len(x.output) for x in t.turns) for t in trajs]
    assert max(contexts) <= shape.max_context and np.mean(contexts) > 20_000  # contexts grow to tens of K
    turns = [len(t.turns) for t in trajs]
    assert max(turns) <= shape.turns[1] and np.mean(turns) > 15
    outputs = [len(x.output) for t in trajs for x in t.turns]
    assert 150 < np.median(outputs) < 300
    tools = [x.tool_s for t in trajs for x in t.turns]
    assert 0.1 < np.median(tools) < 1.0 and max(tools) <= shape.max_tool_s and np.mean(tools) > 5
    assert all(x.tool_s == 0 for t in agentic_step(1, 2, tool_scale=0.0) for x in t.turns)
    assert agentic_step(1, 2, seed=3) == agentic_step(1, 2, seed=3)


def test_the_replay_holds_a_real_replicas_kv():
    """A real replica (tiny model, its KV under pressure: evictions and preemptions) runs a multi-turn
    rollout; the replay of its trajectories on the same limits computes as many prefill tokens and
    preempts as often: its admission, eviction and preemption are the engine's. (A replay that admits
    every waiting turn at once, pinning its cached prefix, preempts 3x as often here.)"""
    from conftest import TEST_CACHE
    from talaria_jax.engine import EngineConfig, SamplingParams
    from talaria_jax.rollout.replica import ReplicaSpec
    from talaria_jax.rollout.service import RolloutService
    from talaria_jax.sim.hardware import ModelShape

    config = EngineConfig(max_seqs=8, max_tokens_per_step=64, max_model_len=512, prefix_cache=True, warmup=False)
    probe = ReplicaSpec("tiny-dense", devices=(0,), engine=config, compilation_cache=TEST_CACHE).build()
    config = dataclasses.replace(config, kv_memory_bytes_per_device=72 * probe.engine.pool_spec.page_bytes)
    replica = ReplicaSpec("tiny-dense", devices=(0,), engine=config, compilation_cache=TEST_CACHE).build()
    engine = replica.engine
    vocab = engine.model.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, vocab, 96).tolist() for _ in range(4)]

    def make_env(i, j):
        env_rng = np.random.default_rng(100 * i + j)
        return lambda completion: env_rng.integers(5, vocab, 32).tolist()

    with RolloutService([replica], "round_robin", seed=0) as service:
        trajs = service.rollout(prompts, make_env, SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True),
                                n=3, max_turns=4)
        stats = service.stats()["replicas"][0]
    shape = ReplicaShape(HW, ModelShape.from_config(engine.model.cfg, "float32", 1), max_seqs=8, max_tokens_per_step=64,
                         page_size=engine.page_size, kv_tokens=engine.pool_spec.num_slots)
    res = replay_step(records_of(trajs), shape, 1, "round_robin")
    assert stats["preemptions"] > 5 and stats["prefix_evicted_pages"] > 100 and stats["prefix_hit_tokens"] > 0
    assert res.prefill_tokens == pytest.approx(stats["prefill_tokens"], rel=0.05)
    assert res.preemptions == pytest.approx(stats["preemptions"], abs=3)
