"""Steps as layer programs (EngineConfig.layers_per_program): the same tokens and logprobs as the
one-program step on every kind of model and step, one program for every run of like layers, weights
let go when replaced, and the config's checks."""
import gc
import weakref

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.runner import LAYERS_PER_PROGRAM_CPU, layers_per_program, query_tiles
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec import SpecConfig
from talaria_jax.models import init_model, load_model_config
from talaria_jax.sharding import make_mesh

PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)] * 3 + \
         [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True, logprobs=2) for s in (3, 4)]


def _prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(0, 256, n).tolist() for n in (3, 40, 17, 9, 26)]


def _run(model, n, **kw):
    eng = Engine(model, EngineConfig(warmup=False, page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96,
                                     layers_per_program=n, **kw))
    return eng, eng.generate(_prompts(), PARAMS, progress=False)


def _same(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert np.allclose(g.logprobs, w.logprobs, atol=1e-5)
        assert [sorted(t) for t in g.top_logprobs] == [sorted(t) for t in w.top_logprobs]


@pytest.mark.parametrize("name,changes,devices,spec", [
    ("tiny-dense", {}, 1, False),
    ("tiny-dense", dict(sliding_windows=(6, 0, 6, 0)), 1, False),  # runs of different windows
    ("tiny-dense", dict(num_heads=6, num_kv_heads=1, head_dim=20), 1, False),  # one kv head, head_dim 20
    ("tiny-moe", {}, 1, False),            # a dense first layer, then MoE layers
    ("tiny-dense", {}, 8, False),          # tensor parallel over 8 devices
    ("tiny-dense", {}, 1, True),           # verifying steps (speculation)
])
def test_layer_programs_give_the_one_program_steps_tokens_and_logprobs(name, changes, devices, spec):
    cfg = load_model_config(name).replace(**changes)
    model = init_model(cfg, make_mesh(jax.devices()[:devices], tp=devices), seed=3)
    kw = dict(speculation=SpecConfig(policy="always", max_spec_tokens=4, min_token_prob=0.0)) if spec else {}
    one, want = _run(model, 0, **kw)
    assert not one.runner.by_layers
    for n in (1, 2):  # runs of one layer each, and of two (the second run's layers at a traced offset)
        eng, got = _run(model, n, **kw)
        assert eng.runner.by_layers
        _same(got, want)
        if spec:
            assert eng.stats.spec_steps and eng.stats.accepted_tokens
    if devices > 1:
        assert len(eng.runner.kv.addressable_shards) == devices


def test_one_program_serves_every_run_of_like_layers():
    """A step shape compiles the embedding, one program per kind of run (runs of the same layer
    definitions and windows) and the head, whatever the depth."""
    cfg = load_model_config("tiny-dense").replace(num_layers=6)
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=0)

    def programs(n, windows=None):
        m = model if windows is None else init_model(cfg.replace(sliding_windows=windows),
                                                     make_mesh(jax.devices()[:1]), seed=0)
        r = Engine(m, EngineConfig(warmup=False, max_seqs=2, max_model_len=64, layers_per_program=n)).runner
        t = r.bucket(2)
        return len(r._programs(r.empty_batch(t), query_tiles([], t, 1, t), None, set()))

    assert programs(1) == programs(2) == programs(3) == programs(6) == 3  # embedding, layers, head
    assert programs(4) == programs(5) == 3  # runs of 3: the most up to 4 (or 5) that divide 6 layers
    assert programs(2, windows=(8, 0) * 3) == 3  # every run is (8, 0)
    assert programs(1, windows=(8, 0) * 3) == 4  # runs (8) and (0)
    assert programs(3, windows=(8, 0) * 3) == 4  # runs (8, 0, 8) and (0, 8, 0)
    assert programs(0) == 1  # the whole step


def test_layers_per_program_is_checked_and_defaults_by_platform():
    with pytest.raises(ValueError, match="EngineConfig.layers_per_program must be None or an int >= 0, got -1"):
        EngineConfig(layers_per_program=-1).validate()
    with pytest.raises(ValueError, match="EngineConfig.layers_per_program must be None or an int >= 0, got '2'"):
        EngineConfig(layers_per_program="2").validate()
    with pytest.raises(ValueError, match="EngineConfig.layers_per_program must be None or an int >= 0, got True"):
        EngineConfig(layers_per_program=True).validate()
    mesh, deep = make_mesh(jax.devices()[:1]), LAYERS_PER_PROGRAM_CPU + 1
    assert layers_per_program(None, mesh, "reference", deep) == LAYERS_PER_PROGRAM_CPU
    assert layers_per_program(None, mesh, "reference", LAYERS_PER_PROGRAM_CPU) == 0  # one run: one program
    assert layers_per_program(None, mesh, "pallas", deep) == 0  # the kernel's layer index is static
    assert layers_per_program(3, mesh, "reference", 2) == 3


def test_replaced_weights_are_not_held_by_the_layer_programs():
    """The runner keeps the flat leaves of the weights its programs read; once the engine serves other
    weights, the old arrays are let go (an evicted model's weights must free their memory)."""
    cfg = load_model_config("tiny-dense")
    eng, _ = _run(init_model(cfg, make_mesh(jax.devices()[:1]), seed=3), 1)
    old = weakref.ref(jax.tree.leaves(eng.model.state)[0])
    eng.update_weights(init_model(cfg, make_mesh(jax.devices()[:1]), seed=4).state)
    gc.collect()
    assert old() is None
    eng.generate(_prompts()[:1], PARAMS[:1], progress=False)  # and it serves the new ones


def test_a_warm_engine_of_layer_programs_lowers_nothing_more():
    """Warm-up compiles every program the layer programs' steps run (a token bucket's head once):
    serving chunked prefills and decodes after it lowers none."""
    lowered = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kw.get("fun_name", "?"))

    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=3)
    eng = Engine(model, EngineConfig(page_size=4, max_seqs=4, max_tokens_per_step=32, max_model_len=96,
                                     layers_per_program=2))
    assert eng.runner.compilations == len(eng.runner.step_shapes())
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        eng.generate(_prompts(), PARAMS, progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert lowered == [] and eng.runner.compilations == len(eng.runner.step_shapes())
