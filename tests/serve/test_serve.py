"""The instance server on 127.0.0.1 with the real `openai` client: completions and chat (plain and
streamed), token-id prompts and logprobs, OpenAI error bodies for bad input while it keeps serving,
API keys and tenant salts, stop strings, client disconnects, draining, metrics."""
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.serve.app import ServedModel, build_app, serving
from talaria_jax.serve.protocol import Limits
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import load_model

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

KEY, OTHER = "sk-test-a", "sk-test-b"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, prefix_cache=True,
                      warmup=False)



@pytest.fixture(scope="module")
def tiny():
    """tiny-dense (random weights, byte tokenizer) behind a server with two tenants' keys."""
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    app = build_app(ServedModel("tiny", Engine(model, CONFIG)), api_keys=[KEY, OTHER],
                    limits=Limits(max_body_bytes=4096, max_tokens=64, max_n=2))
    with serving(app) as url:
        yield model, app, url


@pytest.fixture(scope="module")
def smol():
    lm = load_model("smollm2-135m-instruct", make_mesh(jax.devices()[:1]))
    app = build_app(ServedModel("smollm2-135m-instruct", Engine(lm.model, CONFIG, tokenizer=lm.tokenizer)),
                    api_keys=[KEY])
    with serving(app) as url:
        yield lm, app, url


def settled(app, timeout_s: float = 30.0) -> bool:
    """Whether every request the server took is done within `timeout_s` (aborts apply between steps)."""
    deadline = time.time() + timeout_s
    while app.state.engine.num_in_flight() and time.time() < deadline:
        time.sleep(0.02)
    return app.state.engine.num_in_flight() == 0


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"talaria:{name}") and not line.startswith("#"))


def test_the_real_client_chats_and_completes_streamed_and_not(smol):
    lm, app, url = smol
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["smollm2-135m-instruct"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    n = full.usage.completion_tokens
    assert "Paris" in text and 1 <= n <= 12 and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas) == text and len([d for d in deltas if d]) > 1  # deltas, not the whole text again
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].choices == []
    # the same conversation is a prefix hit (full pages of the prompt), shown in usage and /metrics
    again = c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 8 and metric(url, "prefix_cache_hits_total") >= 8
    prompt = "The capital of France is"
    done = c.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == done.choices[0].text and done.usage.prompt_tokens == len(lm.tokenizer.encode(prompt))


def test_token_id_prompts_logprobs_and_n(tiny):
    model, app, url = tiny
    ids = np.random.RandomState(0).randint(0, 256, 20).tolist()
    out = client(url).completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    want = greedy_generate(model, [ids], 6)[0]
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.tokens == [app.state.engine.engine.tokenizer.decode([t]) for t in want]
    two = client(url).completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=1.0, n=2, seed=3)
    assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 8


def _post(url, path, body, key=KEY, raw=None):
    """`key`: the API key ("": none sent), or a (header, value) sent with the right key."""
    extra = dict([key]) if isinstance(key, tuple) else {}
    key = KEY if extra else key
    auth = {"Authorization": f"Bearer {key}"} if key else {}  # "": no key sent at all
    return httpx.post(f"{url}{path}", content=raw if raw is not None else json.dumps(body),
                      headers={**auth, "Content-Type": "application/json", **extra}, timeout=60)


@pytest.mark.parametrize("path,body,raw,key,status,param,text", [
    ("/v1/completions", {"model": "tiny", "prompt": [1] * 300, "max_tokens": 4}, None, KEY, 400, "prompt",
     "exceeds the context limit of 256"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, None, KEY, 400, "max_tokens", "[1, 64]"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 65}, None, KEY, 400, "max_tokens", "[1, 64]"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 70000]}, None, KEY, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", None, b'{"model": "tiny", "prompt": ', KEY, 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, None, KEY, 400, "temperature",
     "must be a finite number"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, None, KEY, 400, "messages", "non-empty list"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 3}, None, KEY, 400, "n", "[1, 2]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, None, KEY, 400,
     "messages", "no chat template"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, None, KEY, 404, "model", "does not exist"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 5000}, None, KEY, 413, None, "over the limit of 4096"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}, None, "sk-wrong", 401, None, "API key"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}, None, "", 401, None, "API key"),
    ("/v1/nothing", {"model": "tiny", "prompt": "hi"}, None, KEY, 404, None, "Not Found"),
    ("/v1/completions", None, b"[" * 4000, KEY, 400, None, "not valid JSON"),  # nested past the parser's depth
    ("/v1/completions", None, b'{"model": "tiny", "prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", KEY, 400,
     "temperature", "finite number"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, None, KEY, 400,
     "messages[0].role", "must be one of system"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]},
     None, KEY, 400, "tools[0]", "'type': 'function'"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, None, KEY, 400,
     "stream_options", "only allowed with 'stream': true"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     None, KEY, 400, "stream_options.include_usage", "must be a boolean"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**63}, None, KEY, 400, "seed", "[0, 2**63)"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": -1}, None, KEY, 400, "seed", "[0, 2**63)"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2.5}, None, KEY, 400, "max_tokens",
     "must be an integer"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "agent_hints": {"calls_left": -1}}, None, KEY, 400,
     "agent_hints.calls_left", "'agent_hints.calls_left' must be an integer >= 0, got -1"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "agent_hints": {"priority": 20}}, None, KEY, 400,
     "agent_hints.priority", "must be an integer in [-8, 8], got 20"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "agent_hints": {"tool_s": "soon"}}, None, KEY, 400,
     "agent_hints.tool_s", "'agent_hints.tool_s' must be a finite number of seconds >= 0, got 'soon'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "agent_hints": {"steps_left": 2}}, None, KEY, 400,
     "agent_hints.steps_left", "'agent_hints.steps_left' is not a hint (known: calls_left, tool_s, priority)"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}, None, ("x-agent-hints", "calls_left"), 400,
     "x-agent-hints", "name=number pairs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi"}, None, ("x-agent-hints", "calls_left=1, tool_s=-3"), 400,
     "x-agent-hints.tool_s", "'x-agent-hints.tool_s' must be a finite number of seconds >= 0, got -3.0"),
])
def test_bad_input_gets_the_openai_error_body_and_serving_goes_on(tiny, path, body, raw, key, status, param, text):
    _, app, url = tiny
    r = _post(url, path, body, key=key, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["param"] == param and err["type"]
    ok = _post(url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert settled(app)


@pytest.mark.parametrize("extra,raw_prompt", [
    ({"stop": []}, None),  # no stop strings
    ({"max_tokens": 2.0, "n": 1.0}, None),  # integers written as floats (JSON Schema's integers)
    ({"seed": 2**63 - 1, "n": 2, "temperature": 1.0}, None),  # the second choice's seed wraps to 0
    ({}, "a\\ud800b"),  # a lone surrogate: valid JSON, not valid UTF-8
    ({"agent_hints": {"calls_left": 0, "tool_s": 1.5, "priority": -2}}, None),  # (one model's engine: unused)
])
def test_edge_inputs_that_openai_accepts_are_served(tiny, extra, raw_prompt):
    _, app, url = tiny
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
    raw = json.dumps(body).replace('"hi"', f'"{raw_prompt}"').encode() if raw_prompt else None
    r = _post(url, "/v1/completions", body, raw=raw)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == body.get("n", 1)
    assert settled(app)


def test_health_needs_no_key_and_other_routes_do(tiny):
    _, _, url = tiny
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401 and httpx.get(f"{url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(url, "sk-nope").models.list()


def test_tenants_never_share_prefix_kv(tiny):
    _, _, url = tiny
    ids = np.random.RandomState(7).randint(0, 256, 40).tolist()
    a1 = client(url, KEY).completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    b = client(url, OTHER).completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    a2 = client(url, KEY).completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0  # the same prompt, another key: no hit
    assert a2.usage.prompt_tokens_details.cached_tokens == 32  # the same key: its 4 full pages
    assert a1.choices[0].text == b.choices[0].text == a2.choices[0].text


def test_stop_strings_cut_the_text_and_end_the_request(smol):
    _, app, url = smol
    c = client(url)
    free = c.completions.create(model="smollm2-135m-instruct", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text[3:5]
    assert stop and stop in text
    later = text[7:9]  # listed first, matched later: the text is cut at the earliest match of any
    cut = c.completions.create(model="smollm2-135m-instruct", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                               stop=[later, stop])
    assert later and cut.choices[0].text == text[:min(text.index(stop), text.index(later))]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="smollm2-135m-instruct", prompt="1, 2, 3, 4,", max_tokens=12,
                                       temperature=0, stop=[later, stop], stream=True))
    assert all(ch.choices for ch in chunks)  # no usage chunk unless stream_options asks for one
    assert "".join(ch.choices[0].text for ch in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop" and settled(app)
    assert 'finished_reason="stop"' in httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_a_client_that_goes_away_frees_its_pages(smol):
    _, app, url = smol  # SmolLM2 takes long enough a step here that the request is still running
    eng = app.state.engine.engine
    body = {"model": "smollm2-135m-instruct", "prompt": "Count from 1 to 100: 1, 2, 3,", "max_tokens": 150,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        lines = r.iter_lines()  # kept: a collected line iterator closes the connection
        assert next(lines).startswith("data: ")  # the first token arrived: the request holds pages
        assert app.state.engine.num_in_flight() == 1
    assert settled(app) and not eng.running and not eng.waiting
    cached = eng.prefix_cache.num_pages if eng.prefix_cache is not None else 0
    assert eng.allocator.num_used == cached  # only the prefix cache holds pages
    assert eng.stats.aborted >= 1


def test_draining_refuses_new_requests_and_finishes_running_ones():
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    app = build_app(ServedModel("tiny", Engine(model, CONFIG)), api_keys=[KEY])
    with serving(app) as url:
        running = {}
        t = threading.Thread(target=lambda: running.update(r=_post(url, "/v1/completions", {
            "model": "tiny", "prompt": [4] * 50, "max_tokens": 64, "temperature": 0})))
        t.start()
        while app.state.engine.num_in_flight() == 0:
            time.sleep(0.01)
        drained = {}
        d = threading.Thread(target=lambda: drained.update(ok=app.state.engine.drain(60)))
        d.start()
        while app.state.engine.state != "draining":
            time.sleep(0.01)
        assert httpx.get(f"{url}/health").status_code == 503
        refused = _post(url, "/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        t.join(60), d.join(60)
        assert drained["ok"] and running["r"].status_code == 200
        assert running["r"].json()["usage"]["completion_tokens"] == 64


def test_an_engine_that_keeps_failing_is_reported_dead_and_answers_503():
    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    engine = Engine(model, CONFIG)

    def broken(plan):
        raise RuntimeError("injected device failure")

    engine.before_step = broken
    app = build_app(ServedModel("tiny", engine), api_keys=[KEY])
    with serving(app) as url:
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
        assert engine.stats.step_failures == 3  # retried, then given up
        assert httpx.get(f"{url}/health").status_code == 503
        again = _post(url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"


def test_talaria_serve_drains_on_sigterm(tmp_path):
    # the launcher as users run it: SIGTERM while a stream runs -> 503 to new requests, the stream ends whole
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "talaria_jax.launch.serve", "--model=tiny-dense", f"--port={port}",
                             f"--api_key={KEY}", "--nowarmup", "--max_model_len=1024", "--drain_timeout_s=60",
                             "--speculate=4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert proc.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": "tiny-dense", "prompt": [7] * 10, "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            while metric(url, "spec_decode_num_accepted_tokens") == 0:  # --speculate: drafts verified, some
                assert next(lines) != "data: [DONE]"  # accepted, while the stream runs
            proc.send_signal(signal.SIGTERM)
            while httpx.get(f"{url}/health").status_code != 503:  # draining
                time.sleep(0.02)
            refused = _post(url, "/v1/completions", {"model": "tiny-dense", "prompt": "hi"})
            assert refused.status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][len("data: "):])
        assert final["choices"][0]["finish_reason"] == "length"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
