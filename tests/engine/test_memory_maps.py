"""The memory-map budget: a clear error before compiling passes the kernel's vm.max_map_count (XLA:CPU
maps ~3 regions per compiled kernel; past the limit LLVM fails and the process dies)."""
import jax
import pytest

from talaria_jax.engine import memory_maps
from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.memory_maps import MapBudget, MapLimitError, map_count, map_limit
from talaria_jax.models import init_model, load_model_config
from talaria_jax.sharding import make_mesh


def test_this_process_reads_its_maps_and_the_limit():
    n, limit = map_count(), map_limit()
    assert isinstance(n, int) and isinstance(limit, int) and 0 < n < limit


def test_the_projection_raises_before_the_limit_with_its_numbers(monkeypatch):
    counts = iter([100, 1500, 1600, 1650, 1900])  # read by each check and after the first program
    monkeypatch.setattr(memory_maps, "map_count", lambda: next(counts))
    monkeypatch.setattr(memory_maps, "map_limit", lambda: 2500)
    b = MapBudget(total=5, what="the test's programs")
    b.check()  # nothing compiled yet
    b.compiled()  # the first program: 1500 maps after it, what a first compilation sets up once included
    b.check()  # one program: no rate yet
    b.compiled()
    b.check()  # 150 a program since the first: 1650 + 3 x 150 = 2100 <= 90% of 2500
    b.compiled()
    with pytest.raises(MapLimitError, match=r"the test's programs: this process holds 1900 memory maps, and the 2 "
                                            r"programs left would take about 400 more \(200 each.*"
                                            r"vm.max_map_count=2500"):
        b.check()  # 1900 + 2 x 200 = 2300 > 2250


def test_warmup_stops_with_a_clear_error_instead_of_crashing(monkeypatch):
    """An engine whose warm-up would pass the limit (here 1,000 maps, fewer than any process running
    JAX holds: a limit tied to the process's own count can be passed the other way when a worker that
    ran other tests unmaps their programs during this warm-up) stops with MapLimitError once its first
    two programs have compiled, naming the limit and what to do."""
    monkeypatch.setattr(memory_maps, "map_limit", lambda: 1000)
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    with pytest.raises(MapLimitError, match=r"step programs of tiny-dense.*vm.max_map_count=\d+.*sysctl"):
        Engine(model, EngineConfig(page_size=8, max_seqs=2, max_tokens_per_step=16, max_model_len=64, warmup=True))
