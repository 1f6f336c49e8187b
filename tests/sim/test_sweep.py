"""talaria-replay --sweep: the regime matrix, the marking of cells where talaria is not best, the plots."""
import pytest

from talaria_jax.launch import sweep
from talaria_jax.sim.traces import summary


def test_compare_marks_rivals_more_than_the_tie_faster():
    sct = {"talaria": (100.0, 200.0), "a": (97.0, 300.0), "b": (150.0, 190.0), "c": (99.0, 199.0)}
    ratio, beaten_by = sweep.compare(sct)
    assert ratio["a"] == pytest.approx((0.97, 1.5)) and ratio["b"] == pytest.approx((1.5, 0.95))
    assert beaten_by == ["a", "b"]  # c is within the 2% tie at both quantiles
    assert sweep.dominated_by({**ratio, "d": (0.9, 0.97)}) == ["d"]  # faster at p50 and p95 both


def test_matrix_cells():
    cells = sweep.cells()
    assert len(cells) == 9 * 2 * 4 + 3
    assert {c.trace for c in cells} == {"default", "gen1", "gen2", "gen3", "short", "long", "bimodal", "sparse",
                                        "multi", "open0.02", "open0.03", "open0.05"}
    sparse = sweep.cell_trace("sparse", "unused")
    per_session = [1 + max(c.turn for c in sparse if c.session == s) for s in {c.session for c in sparse}]
    assert len(per_session) == 60 and max(per_session) <= 9 and sum(n >= 3 for n in per_session) >= 0.9 * 60
    assert sweep.cell_trace("bimodal", "unused")[0].session == "s00"
    multi = summary(sweep.cell_trace("multi", "unused"))
    assert multi["multi_model_sessions"] == multi["sessions"] == 30
    assert [c.label for c in sweep.cells(["open0.05"])] == ["open0.05 h200x8 gaps x1"]
    with pytest.raises(ValueError, match=r"sweep traces \['gen5'\] unknown; known: default, gen1"):
        sweep.cells(["gen5"])
    with pytest.raises(ValueError, match="not default, gen<seed>, open<rate>, sparse, multi or short, long, bimodal"):
        sweep.cell_trace("nope", "unused")


def test_sweep_runs_a_cell_and_reports_it(tmp_path):
    with pytest.raises(ValueError, match="put talaria in --policies"):
        sweep.run_sweep(["round"], [0], trace_names=["open0.05"])
    res = sweep.run_sweep(["talaria", "round"], [0], trace_names=["open0.05"], progress=lambda m: None)
    (cell,) = res["cells"]
    assert cell["label"] == "open0.05 h200x8 gaps x1" and cell["floor"][0] <= cell["sct"]["talaria"][0]
    table = sweep.format_sweep(res)
    assert "| open0.05 h200x8 gaps x1 |" in table and "of 1 cells; no rival faster at both p50 and p95 in" in table
    pytest.importorskip("matplotlib")
    sweep.plot_heatmap(res, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_timeline_draws_slots_and_calls(tmp_path):
    pytest.importorskip("matplotlib")
    from talaria_jax.scheduler import Call, get_policy
    from talaria_jax.sim.cluster import replay
    from talaria_jax.sim.toys import TOY_HW, TOY_SHAPES

    calls = [Call("a", 0, "m1", 1000, 10, 0.5, 0.0), Call("a", 1, "m1", 1100, 10, 0.0), Call("b", 0, "m2", 1000, 10, 0.0, 0.1)]
    runs = {n: replay(calls, get_policy(n), TOY_HW, TOY_SHAPES, seed=0) for n in ("talaria", "round")}
    assert sorted(r.model for r in runs["talaria"].records) == ["m1", "m1", "m2"]  # records carry the model
    sweep.plot_timeline(runs, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


def test_sweep_noise_seeds_report_talaria_against_itself():
    with pytest.raises(ValueError, match=r"--noise_seeds \[0\] are among --seeds"):
        sweep.run_sweep(["talaria"], [0], trace_names=["open0.05"], noise_seeds=[0])
    res = sweep.run_sweep(["talaria", "round"], [0], trace_names=["open0.05"], progress=lambda m: None, noise_seeds=[1])
    (cell,) = res["cells"]
    alone = sweep.run_sweep(["talaria"], [1], trace_names=["open0.05"], progress=lambda m: None)["cells"][0]
    assert cell["noise"] == pytest.approx([a / b for a, b in zip(alone["sct"]["talaria"], cell["sct"]["talaria"])])
    assert cell["noise"] != pytest.approx([1.0, 1.0])  # another seed moves the same policy
    table = sweep.format_sweep(res)
    assert "talaria, seeds 1" in table and "differs from itself over seeds 0 by more than the tie in" in table
