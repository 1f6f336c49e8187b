"""Grammar-constrained decoding in the engine (tiny random model, byte tokenizer): sampled outputs
under five JSON schemas parse and validate, the same tokens with speculative decoding and after
preemption, masks batched beside unconstrained requests that stay as they were, logit bias applied,
nothing compiled for either on a warm engine, and a grammar the library refuses named at add_request."""
import json

import jax
import jsonschema
import numpy as np
import pytest

from talaria_jax.engine import grammar
from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.grammar import GrammarError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec.suffix import SpecConfig
from talaria_jax.models import init_model, load_model_config
from talaria_jax.sharding import make_mesh

# bounded (a random model fills strings and numbers until a bound ends them)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "address": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 5},
                                          "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                                          "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},  # nested objects
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},  # enums
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1},
                                      "n": {"type": "integer", "minimum": 10, "maximum": 99}},
     "required": ["x", "n"], "additionalProperties": False},  # numbers
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                      "note": {"type": "string", "maxLength": 3}},
     "required": ["id", "tags"], "additionalProperties": False},  # required fields, one optional
]
PROMPTS = [[1, 2, 3], [9, 8], [40, 41, 42, 43], [7] * 9]


@pytest.fixture(scope="module")
def dense():
    return init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)


def _engine(model, spec=None, **kw):
    return Engine(model, EngineConfig(**{"warmup": False, "page_size": 4, "max_seqs": 6, "max_tokens_per_step": 32,
                                         "max_model_len": 160, "speculation": spec, **kw}))


def _params(schema, seeds, **kw):
    g = grammar.json_schema(schema)
    return [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g, **kw) for s in seeds]


@pytest.fixture(scope="module")
def constrained(dense):
    """Every schema's outputs, 8 seeded draws each, from one engine (their requests batched together)."""
    eng = _engine(dense)
    params = [p for schema in SCHEMAS for p in _params(schema, range(8))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return prompts, params, eng.generate(prompts, params, progress=False)


def test_outputs_validate_under_each_schema(constrained):
    _, _, outs = constrained
    for k, schema in enumerate(SCHEMAS):
        for o in outs[8 * k:8 * k + 8]:
            assert o.finish_reason == "stop", (o.finish_reason, o.text)
            jsonschema.validate(json.loads(o.text), schema)
        assert len({o.text for o in outs[8 * k:8 * k + 8]}) > 1  # sampled, not one fixed answer


def test_the_same_tokens_with_speculation_and_after_preemption(dense, constrained):
    """Drafts are cut where the grammar refuses them and verified against per-node masks; a preempted
    request resumes with its grammar where its output left it: both change nothing."""
    prompts, params, want = constrained
    spec = _engine(dense, SpecConfig(policy="always", max_spec_tokens=4, min_token_prob=0.0))
    got = spec.generate(prompts, params, progress=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.stats.spec_steps and 0 < spec.stats.accepted_tokens <= spec.stats.draft_tokens
    tight = _engine(dense, num_pages=60)
    got = tight.generate(prompts, params, progress=False)
    assert tight.stats.preemptions > 0 and [o.token_ids for o in got] == [o.token_ids for o in want]


def test_unconstrained_neighbours_and_logit_bias(dense):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = _engine(dense).generate([PROMPTS[0]], plain, progress=False)[0].token_ids
    mixed = _engine(dense).generate([PROMPTS[1], PROMPTS[0]], [_params(SCHEMAS[2], [0])[0], plain], progress=False)
    assert mixed[1].token_ids == alone  # a masked row beside it changes nothing
    jsonschema.validate(json.loads(mixed[0].text), SCHEMAS[2])
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((65, 100.0),))
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=((alone[0], -100.0),))
    out = _engine(dense).generate([PROMPTS[0]] * 2, [forced, banned], progress=False)
    assert out[0].token_ids == [65] * 6
    assert out[1].token_ids[0] != alone[0]
    # logprobs stay the model's own: the forced token's is not 0 (the bias is not in them)
    assert out[0].logprobs[0] < -0.01


def test_warm_engine_compiles_nothing_for_grammars_or_bias(dense):
    eng = _engine(dense, warmup=True)
    before = eng.runner.compilations
    eng.generate([PROMPTS[2]] * 2, [_params(SCHEMAS[1], [3])[0],
                                    SamplingParams(max_tokens=4, logit_bias=((3, 2.0),))], progress=False)
    assert eng.runner.compilations == before


def test_a_refused_grammar_is_named_and_nothing_else_is_lost(dense):
    eng = _engine(dense)
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    for bad, words in [({"type": "string", "format": "no-such-format"}, "no-such-format"),
                       ({"type": "strange"}, "strange")]:
        with pytest.raises(GrammarError, match=words):
            eng.add_request(PROMPTS[1], SamplingParams(grammar=grammar.json_schema(bad)))
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammar.json_schema("{oops")
    outs = []
    while eng.requests:
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == [rid]

