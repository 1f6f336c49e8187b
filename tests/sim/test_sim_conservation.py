"""Conservation on the default trace for every policy: each call completes exactly once, in order
within its session, and no instance exceeds its HBM or its KV pages."""
import pytest

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.scheduler import POLICIES, get_policy
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.hardware import load_hardware, load_models
from talaria_jax.scheduler.session import reusable_prefixes
from talaria_jax.sim.traces import TraceSpec, generate, read_jsonl, summary

CALLS = read_jsonl(CONFIG_DIR / "traces" / "swebench-30x32.jsonl")
HW, SHAPES = load_hardware("h200x8"), load_models()


def _check(res, calls):
    keys = [(r.session, r.turn) for r in res.records]
    assert len(keys) == len(set(keys)) == len(calls)
    assert set(keys) == {c.key for c in calls}
    by: dict[str, list] = {}
    for r in res.records:
        by.setdefault(r.session, []).append(r)
    for recs in by.values():
        assert [r.turn for r in recs] == list(range(len(recs)))  # completion order is turn order
        for a, b in zip(recs, recs[1:]):
            assert b.issued_s >= a.done_s and b.done_s > b.issued_s
    for inst in res.instances:
        assert inst.stats.peak_device_bytes <= inst.capacity
        assert inst.stats.peak_kv_pages * inst.page_bytes <= inst.capacity
        assert not inst.running and not inst.waiting


@pytest.mark.parametrize("name", list(POLICIES))
def test_default_trace_conserves_calls(name):
    _check(replay(CALLS, get_policy(name), HW, SHAPES, seed=1), CALLS)


def test_replay_is_deterministic_per_seed():
    a = replay(CALLS, get_policy("talaria"), HW, SHAPES, seed=3).summary()
    b = replay(CALLS, get_policy("talaria"), HW, SHAPES, seed=3).summary()
    c = replay(CALLS, get_policy("talaria"), HW, SHAPES, seed=4).summary()
    assert a == b and a != c


def test_talaria_restores_prefixes_that_round_keeps_or_recomputes():
    # mechanisms, not a ratio (the sweep in talaria-replay --sweep measures those): talaria brings every
    # evicted prefix back from host memory, round (no host KV) never restores one
    t = replay(CALLS, get_policy("talaria"), HW, SHAPES, seed=0).summary()
    r = replay(CALLS, get_policy("round"), HW, SHAPES, seed=0).summary()
    assert t["kv_recomputed_tokens"] == 0 and t["kv_restored_tokens"] > 0
    assert r["kv_restored_tokens"] == 0


def test_sessions_that_use_two_models_conserve_calls_and_lose_no_kv():
    # a third of each session's calls on a second model, contexts compacted past 9K tokens: every
    # policy completes every call in order; talaria serves each call's reusable prefix (per model, cut
    # by a compaction on either) from device or host, and recomputes none of it
    calls = generate(TraceSpec(sessions=12, turns=12, second_model_share=0.3, compact_at_tokens=9000, seed=2))
    assert summary(calls)["multi_model_sessions"] >= 10 and summary(calls)["compactions"] >= 5
    for name in ("talaria", "round", "talaria-chain"):
        res = replay(calls, get_policy(name), HW, SHAPES, seed=0)
        _check(res, calls)
    reusable = sum(sum(reusable_prefixes([c for c in calls if c.session == sid]).values())
                   for sid in {c.session for c in calls})
    for servers in (1, 2):  # (on two, a session's KV on the other instance is older: a compaction cut it too)
        s = replay(calls, get_policy("talaria"), HW, SHAPES, seed=0, servers=servers).summary()
        assert s["kv_restored_tokens"] + s["kv_device_hit_tokens"] + s["kv_recomputed_tokens"] == reusable
        assert s["kv_recomputed_tokens"] == 0 or servers == 2


def test_default_models_cannot_all_stay_resident():
    total = sum(SHAPES[m].weight_bytes for m in {c.model for c in CALLS})
    assert total > HW.usable_hbm_bytes  # the scenario forces switching (docs/traces.md)


def test_tool_time_jitter_is_common_to_every_policy():
    # a seed draws each call's tool-time jitter by call, not in completion order, so every policy
    # replayed with that seed waits the same tool time after each call (common random numbers)
    def gaps(name):
        recs = {(r.session, r.turn): r for r in replay(CALLS, get_policy(name), HW, SHAPES, seed=2).records}
        return {k: recs[(k[0], k[1] + 1)].issued_s - r.done_s for k, r in recs.items() if (k[0], k[1] + 1) in recs}
    g = {name: gaps(name) for name in ("talaria", "round")}
    assert g["talaria"].keys() == g["round"].keys() and len(g["talaria"]) == len(CALLS) - 30
    assert all(abs(g["talaria"][k] - g["round"][k]) < 1e-6 for k in g["talaria"])
    nominal = {c.key: c.tool_gap_s for c in CALLS}
    assert any(abs(v - nominal[k]) > 1e-3 for k, v in g["talaria"].items())  # jitter is on
