"""The client-side load driver (`serve.load`) against the real server on 127.0.0.1 with SmolLM2:
multi-turn chat and completion sessions, side by side, reuse their growing prefix and their timings
add up; sessions are deterministic from their seed; a failing call is recorded instead of raised."""
import dataclasses
import math

import jax
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.serve.app import ServedModel, build_app, serving
from talaria_jax.serve.load import agent_sessions, run_sessions, summarize
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import load_model

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

KEY = "sk-load-test"
MODEL = "smollm2-135m-instruct"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=8, max_model_len=1024, prefix_cache=True,
                      warmup=False)



@pytest.fixture(scope="module")
def url():
    lm = load_model(MODEL, make_mesh(jax.devices()[:1]))
    app = build_app(ServedModel(MODEL, Engine(lm.model, CONFIG, tokenizer=lm.tokenizer)), api_keys=[KEY])
    with serving(app) as base:
        yield base


def test_sessions_are_deterministic_from_the_seed():
    kw = dict(models=["a", "b", "c"], chat_models={"a"}, obs_words=(5, 40))
    one = agent_sessions(20, 4, seed=7, **kw)
    assert one == agent_sessions(20, 4, seed=7, **kw) and one != agent_sessions(20, 4, seed=8, **kw)
    assert [s.id for s in one] == [f"s{i}" for i in range(20)]
    assert all(len(s.observations) == len(s.tool_gap_s) == 4 and s.tool_gap_s[-1] == 0 for s in one)
    assert all(5 <= len(o.split()) <= 40 for s in one for o in s.observations)
    assert all(s.chat == (s.model == "a") for s in one)
    counts = [sum(s.model == m for s in agent_sessions(300, 1, ["a", "b", "c"])) for m in "abc"]
    assert counts[0] > counts[1] > counts[2] > 0  # Zipf-like: the first model the most popular
    assert agent_sessions(2, 2, ["a"], start_task="Fix it.")[1].observations[0] == "Fix it."


def test_chat_and_completion_sessions_reuse_their_growing_prefix(url):
    chat = agent_sessions(3, 3, [MODEL], chat_models={MODEL}, max_tokens=8, obs_words=(10, 30), tool_gap_s=0.05)
    sessions = [*chat[:2], dataclasses.replace(chat[2], chat=False)]  # two chats and a growing text prompt
    results = run_sessions(url, KEY, sessions, start_gap_s=0.02, progress=False)
    assert [r.id for r in results] == ["s0", "s1", "s2"]
    for r in results:
        assert not r.errors and [c.turn for c in r.calls] == [0, 1, 2]
        assert all(c.text and 1 <= c.completion_tokens <= 8 and 0 < c.ttft_s <= c.e2e_s for c in r.calls)
        assert all(c.cached_tokens > 0 for c in r.calls[1:]), [c.cached_tokens for c in r.calls]
        assert len(r.calls[-1].itl_s) >= 1 and r.sct_s >= sum(c.e2e_s for c in r.calls)
    s = summarize(results)
    assert s["sessions"] == 3 and s["calls"] == 9 and s["errors"] == 0
    assert all(math.isfinite(v) for k, v in s.items() if k.endswith("_s"))
    assert s["ttft_p50_s"] <= s["ttft_p99_s"] and s["sct_p50_s"] <= s["sct_p90_s"] <= s["sct_p99_s"]
    assert s["tokens"] == sum(c.completion_tokens for r in results for c in r.calls) and s["cached_tokens"] > 0


def test_a_failing_call_is_recorded_and_ends_its_session(url):
    sessions = agent_sessions(2, 3, [MODEL], chat_models={MODEL}, max_tokens=4, tool_gap_s=0.01)
    results = run_sessions(url, "sk-wrong", sessions, progress=True)  # the bar on stderr too
    for r in results:
        assert len(r.calls) == 1 and len(r.errors) == 1 and "AuthenticationError" in r.errors[0]
        assert "\n" not in r.errors[0] and r.sct_s >= r.calls[0].e2e_s
    s = summarize(results)
    assert s["errors"] == 2 and s["calls"] == 2 and math.isnan(s["ttft_p50_s"]) and math.isnan(s["sct_mean_s"])
    [wrong_model] = agent_sessions(1, 2, ["gpt-9"], max_tokens=4)
    [r] = run_sessions(url, KEY, [wrong_model], progress=False)  # an unknown model: a 404, recorded alike
    assert "NotFoundError" in r.errors[0] and len(r.calls) == 1
