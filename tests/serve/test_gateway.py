"""The router gateway on 127.0.0.1 with the real `openai` client: over two instance servers that each
host two models under the scheduler; sessions follow their KV; bad input gets OpenAI's error body;
tenants stay apart; a killed instance loses no call; a stream placed again never repeats text."""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from conftest import FAST_COMPILE
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve.app import serve_in_thread
from talaria_jax.serve.gateway import _Relay, build_gateway
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.local_cluster import LocalCluster

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

KEY, OTHER = "sk-gw-a", "sk-gw-b"
SMOL = "smollm2-135m-instruct"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=512, prefix_cache=True,
                      warmup=False)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"talaria:{name}") and not line.startswith("#"))


@pytest.fixture(scope="module")
def cluster():
    """Two in-process instance servers, each hosting SmolLM2 and tiny-dense on one device under talaria,
    and the gateway over them (limits: 4 KiB bodies)."""
    with LocalCluster.build(InstanceConfig({SMOL: SMOL, "tiny-dense": "tiny-dense"}, ServerConfig((KEY, OTHER)), CONFIG,
                                           hardware="cpu", kv_bytes_per_device=32 << 20), instances=2) as lc:
        with lc.gateway(get_policy("talaria"), max_body_bytes=4096, probe_interval_s=0.2) as url:
            yield lc.router, url, lc.urls


def test_the_real_client_works_through_the_gateway_and_sessions_follow_their_kv(cluster):
    gw, url, instances = cluster
    c = client(url)
    assert sorted(m.id for m in c.models.list().data) == sorted([SMOL, "tiny-dense"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model=SMOL, messages=messages, max_tokens=10, temperature=0,
                                     extra_headers={"x-session-id": "paris"})
    assert "Paris" in full.choices[0].message.content
    home = gw.state.sessions[next(k for k in gw.state.sessions if k.endswith(":paris"))]
    at = {u: metric(u, "prefix_cache_hits_total") for u in instances}
    messages += [{"role": "assistant", "content": full.choices[0].message.content},
                 {"role": "user", "content": "And of Italy?"}]
    chunks = list(c.chat.completions.create(model=SMOL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            extra_headers={"x-session-id": "paris"},
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "Rome" in text and chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    # the second call went where the session's KV was, and the hit shows in that instance's /metrics
    k = [f"i{n}" for n in range(2)].index(home)
    assert gw.state.sessions[next(s for s in gw.state.sessions if s.endswith(":paris"))] == home
    assert metric(instances[k], "prefix_cache_hits_total") - at[instances[k]] >= 16
    done = c.completions.create(model="tiny-dense", prompt=[1, 2, 3, 4], max_tokens=6, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-dense", prompt=[1, 2, 3, 4], max_tokens=6, temperature=0, stream=True) if ch.choices)
    assert streamed == done.choices[0].text and done.usage.completion_tokens == 6
    # each instance loaded a model at least once, and /metrics counts the switches and their seconds
    assert sum(metric(u, "model_switches_total") for u in instances) >= 2
    assert sum(metric(u, "model_switch_seconds_total") for u in instances) > 0
    assert metric(url, "router_requests_total") >= 4


def test_a_session_that_calls_two_models_returns_to_its_first_models_kv(cluster):
    """One session calls SmolLM2, then tiny-dense, then SmolLM2 again: every call is served, and the
    return to SmolLM2 reuses the session's own SmolLM2 prefix."""
    gw, url, instances = cluster
    c, h = client(url), {"x-session-id": "two-models"}
    messages = [{"role": "user", "content": "Name the largest city of Canada."}]  # (text no other test sends)
    first = c.chat.completions.create(model=SMOL, messages=messages, max_tokens=8, temperature=0, extra_headers=h)
    helper = c.completions.create(model="tiny-dense", prompt=list(range(1, 40)), max_tokens=4, temperature=0,
                                  extra_headers=h)
    assert helper.usage.completion_tokens == 4
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Australia?"}]
    again = c.chat.completions.create(model=SMOL, messages=messages, max_tokens=8, temperature=0, extra_headers=h)
    # the full pages of the first prompt (not only the chat template's system prompt every session shares)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 8 * 8 - 8 <= cached <= first.usage.prompt_tokens + first.usage.completion_tokens


def _post(url, body, key=KEY, raw=None, path="/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", content=raw if raw is not None else json.dumps(body).encode(),
                      headers={**headers, "Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body,raw,key,status,param,text", [
    ({"model": "tiny-dense", "prompt": [1] * 600}, None, KEY, 400, "prompt", "exceeds the context limit"),
    ({"model": "tiny-dense", "prompt": "hi", "max_tokens": 0}, None, KEY, 400, "max_tokens", "[1, 4096]"),
    ({"model": "tiny-dense", "prompt": "hi", "max_tokens": 5000}, None, KEY, 400, "max_tokens", "[1, 4096]"),
    ({"model": "tiny-dense", "prompt": [1, 99999]}, None, KEY, 400, "prompt", "outside the vocabulary"),
    (None, b"{not json", KEY, 400, None, "not valid JSON"),
    ({"model": "tiny-dense", "prompt": "hi", "temperature": "hot"}, None, KEY, 400, "temperature", "finite number"),
    ({"model": "gpt-9", "prompt": "hi"}, None, KEY, 404, "model", "does not exist"),
    ({"model": "tiny-dense", "prompt": "x" * 5000}, None, KEY, 413, None, "over the limit"),
    ({"model": "tiny-dense", "prompt": "hi"}, None, None, 401, None, "API key"),
    ({"model": "tiny-dense", "prompt": "hi"}, None, "sk-wrong", 401, None, "API key"),
])
def test_bad_input_gets_the_openai_error_body_through_the_gateway(cluster, body, raw, key, status, param, text):
    gw, url, _ = cluster
    r = _post(url, body, key, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["param"] == param and err["type"]
    ok = client(url).completions.create(model="tiny-dense", prompt="still serving", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_an_instances_4xx_reaches_the_client_unchanged_and_the_instance_stays_up(cluster):
    gw, url, instances = cluster
    body = {"model": "tiny-dense", "prompt": [1] * 600}  # over the instances' context: only they can tell
    direct = _post(instances[0], body)
    refused = metric(url, "router_refused_total")
    via = _post(url, body)
    assert direct.status_code == via.status_code == 400 and via.json() == direct.json()
    assert metric(url, "router_refused_total") == refused  # the gateway's own checks passed it
    health = httpx.get(f"{url}/health").json()
    assert health["instances_up"] == 2 and [i["up"] for i in health["instances"]] == [True, True]
    assert [i["url"] for i in health["instances"]] == instances


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny-dense", "prompt": "hi", "stop": 5}, "stop"),
    ({"model": "tiny-dense", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "tiny-dense", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
])
def test_what_every_instance_would_refuse_is_refused_before_fan_out(cluster, body, param):
    gw, url, _ = cluster
    refused = metric(url, "router_refused_total")
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(url, body, path=path)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert metric(url, "router_refused_total") == refused + 1


@pytest.mark.parametrize("raw", [  # greedy: a sampled draw may end at the end-of-text token
    b'{"model": "tiny-dense", "prompt": "hi", "max_tokens": 2, "stop": [], "temperature": 0}',
    b'{"model": "tiny-dense", "prompt": "a\\ud800b", "max_tokens": 2, "temperature": 0}',  # a lone surrogate
])
def test_edge_inputs_pass_the_gateway(cluster, raw):
    _, url, _ = cluster
    r = _post(url, None, raw=raw)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_a_call_is_rendered_and_tokenized_once_and_a_probe_is_its_callers_only(cluster, monkeypatch):
    from talaria_jax.serve import app as instance_app

    gw, url, instances = cluster
    renders = []
    real = instance_app._prompt_ids
    monkeypatch.setattr(instance_app, "_prompt_ids", lambda served, p: renders.append(p.messages) or real(served, p))
    messages = [{"role": "user", "content": "Name a prime number."}]
    through = client(url).chat.completions.create(model=SMOL, messages=messages, max_tokens=6, temperature=0)
    # two instances probed: the first rendered, the other was probed with its token ids, and the one
    # chosen served the call as its probe checked it
    assert renders == [messages]
    direct = client(instances[1]).chat.completions.create(model=SMOL, messages=messages, max_tokens=6, temperature=0)
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.prompt_tokens == direct.usage.prompt_tokens
    # a probe's id names a request for the caller that probed it only: another key's request is read anew
    body = {"model": SMOL, "messages": messages, "max_tokens": 6, "temperature": 0}
    probe = httpx.post(f"{instances[0]}/talaria/probe", params={"kind": "chat", "tokens": "true"}, json=body,
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    assert probe["prompt_token_ids"] and len(probe["prompt_token_ids"]) == probe["prompt_tokens"]
    # asked again by its id once the session is known (the gateway's inference), a probe answers from
    # the request it kept: its body is not read, the prompt not rendered again
    n = len(renders)
    again = httpx.post(f"{instances[0]}/talaria/probe", params={"kind": "chat"}, content=b"(not read)",
                       headers={"Authorization": f"Bearer {KEY}", "x-talaria-probe": probe["probe"],
                                "x-session-id": "known-now"})
    assert again.status_code == 200 and len(renders) == n
    assert again.json()["prompt_tokens"] == probe["prompt_tokens"] and again.json()["probe"] != probe["probe"]
    other = {**body, "messages": [{"role": "user", "content": "Name three colors of the rainbow, please."}]}
    r = httpx.post(f"{instances[0]}/v1/chat/completions", json=other, timeout=300,
                   headers={"Authorization": f"Bearer {OTHER}", "x-talaria-probe": again.json()["probe"]})
    assert r.status_code == 200 and renders[-1] == other["messages"]
    assert r.json()["usage"]["prompt_tokens"] != probe["prompt_tokens"]


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_tool_calls_through_the_gateway_stream_as_they_answer(cluster):
    """A required tool call through the gateway (its probes and relay): the streamed deltas add up to
    the answer; the turn after the tool ran is served in the same session."""
    _, url, _ = cluster
    c = client(url)
    kw = dict(model=SMOL, messages=USER, tools=WEATHER, tool_choice="required", temperature=0, max_tokens=60,
              extra_headers={"x-session-id": "tools"})
    whole = c.chat.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    calls = [t for ch in chunks for t in (ch.delta.tool_calls or [])]
    assert whole.finish_reason == chunks[-1].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in calls] == \
           [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert json.loads(calls[0].function.arguments)["city"]
    turn = USER + [{"role": "assistant", "content": None, "tool_calls": [whole.message.tool_calls[0].model_dump()]},
                   {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "content": "-3 C"}]
    after = c.chat.completions.create(**{**kw, "messages": turn, "tool_choice": "none", "max_tokens": 16})
    assert after.choices[0].message.content and after.usage.prompt_tokens_details.cached_tokens > 0


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),  # malformed schema
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema"),  # unsupported
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "content": "-3 C"}]}, "messages[2].tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "user", "content": "and?"}]}, "messages[1].tool_calls"),  # dangling call
    ({"extra_body": {"agent_hints": {"calls_left": "few"}}}, "agent_hints.calls_left"),
    ({"extra_headers": {"x-agent-hints": "priority=99"}}, "x-agent-hints.priority"),
])
def test_bad_agent_requests_are_named_and_the_next_call_is_served(cluster, extra, param):
    _, url, _ = cluster
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{"model": SMOL, "messages": USER, "max_tokens": 4, **extra})
    assert e.value.body["param"] == param, e.value.body
    ok = c.chat.completions.create(model=SMOL, messages=USER, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tenants_stay_apart_through_the_gateway(cluster):
    gw, url, instances = cluster
    prompt = list(range(1040, 1090))  # 50 tokens: 6 full pages of SmolLM2 (tiny-dense's pages hold ~200 tokens)
    kw = dict(model=SMOL, prompt=prompt, max_tokens=2, temperature=0)
    client(url, KEY).completions.create(**kw)
    assert client(url, KEY).completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 48
    hits = sum(metric(u, "prefix_cache_hits_total") for u in instances)
    assert client(url, OTHER).completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    assert sum(metric(u, "prefix_cache_hits_total") for u in instances) == hits  # on no instance


def test_a_stream_placed_again_continues_without_repeating():
    """The relay of a stream whose instance was lost after two deltas, placed again: the retry's events
    repeat those deltas, and the client gets each character, logprob entry, role and finish reason once."""
    def ev(i, content=None, role=False, finish=None, lp=None):
        delta = ({"role": "assistant"} if role else {}) | ({"content": content} if content is not None else {})
        return {"id": "x", "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                        "logprobs": None if lp is None else {"content": lp}}]}
    full = [ev(0, "", role=True), ev(0, "Hel", lp=[1, 2]), ev(0, "lo wor", lp=[3, 4]), ev(0, "ld", lp=[5], finish="stop"),
            {"id": "x", "choices": [], "usage": {"completion_tokens": 5}}]
    relay = _Relay(chat=True)
    sent = [relay.feed(json.loads(json.dumps(e))) for e in full[:3]]  # then the instance is lost
    relay.attempt()
    sent += [relay.feed(json.loads(json.dumps(e))) for e in full]
    sent = [e for e in sent if e is not None]
    text = "".join(c["delta"].get("content", "") for e in sent for c in e["choices"])
    assert text == "Hello world"
    assert sum("role" in c["delta"] for e in sent for c in e["choices"]) == 1
    assert [x for e in sent for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]] == [1, 2, 3, 4, 5]
    assert sum(c["finish_reason"] == "stop" for e in sent for c in e["choices"]) == 1
    assert sum("usage" in e for e in sent) == 1
    done = _Relay(chat=False)  # completions: the text field, the same rules
    out = [done.feed({"choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in ("ab", "cd")]
    done.attempt()
    out += [done.feed({"choices": [{"index": 0, "text": t, "finish_reason": f}]}) for t, f in
            (("abc", None), ("de", "length"))]
    assert "".join(e["choices"][0]["text"] for e in out if e) == "abcde"
    # two choices, and the retry's chunks cut at other places than the first attempt's
    def cp(i, text, lp, finish=None):
        return {"choices": [{"index": i, "text": text, "finish_reason": finish,
                             "logprobs": {"tokens": lp, "token_logprobs": [-1.0] * len(lp)}}]}
    two = _Relay(chat=False)
    out = [two.feed(e) for e in (cp(0, "ab", ["a", "b"]), cp(1, "x", ["x"]), cp(0, "c", ["c"]))]
    two.attempt()
    out += [two.feed(e) for e in (cp(1, "xy", ["x", "y"], "stop"), cp(0, "a", ["a"]), cp(0, "bcd", ["b", "c", "d"]),
                                   cp(0, "", [], "length"))]
    for i, want_text, want_tokens in ((0, "abcd", list("abcd")), (1, "xy", list("xy"))):
        mine = [c for e in out if e for c in e["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in mine) == want_text
        assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == want_tokens
    assert two.complete


def test_a_tool_call_stream_placed_again_sends_its_calls_once():
    """An instance lost mid-answer; the retry's stream repeats the content and ends with the calls:
    the client gets the content once and the calls once, whole, with the finish reason."""
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}

    def ev(content=None, role=False, calls=None, finish=None):
        delta = ({"role": "assistant", "content": ""} if role else {}) | (
            {"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        return {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    full = [ev(role=True), ev("Let me check."), ev(calls=[call], finish="tool_calls")]
    relay = _Relay(chat=True)
    sent = [relay.feed(json.loads(json.dumps(e))) for e in full[:2]]  # lost before its last chunk
    relay.attempt()
    sent += [relay.feed(json.loads(json.dumps(e))) for e in full]
    deltas = [c["delta"] for e in sent if e for c in e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    assert [t for d in deltas for t in d.get("tool_calls", [])] == [call]
    assert [c["finish_reason"] for e in sent if e for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


_STATE = {"name": "i", "policy": "talaria", "models": ["tiny-dense"], "active_model": "tiny-dense",
          "weights": {"tiny-dense": "active"}, "switch_s": {"tiny-dense": 0.0}, "page_size": {"tiny-dense": 8},
          "kv_pages_total": 100, "kv_pages_used": 0, "kv_pages_reserved": 0, "running": 0, "waiting": 0,
          "prompt_tokens": 2, "device_tokens": 0, "host_tokens": 0}


def _failing_instance(status: int) -> FastAPI:
    """An instance double that is up and lists tiny-dense but answers every probe `status` with its own
    error body (200: an idle instance's state, and completions answered "ok"): it isolates the gateway's
    handling of instances' answers."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return {"id": "c", "object": "text_completion", "created": 0, "model": "tiny-dense",
                "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                          "prompt_tokens_details": {"cached_tokens": 0}}}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-dense", "object": "model", "created": 0, "owned_by": "x"}]}

    @app.post("/talaria/probe")
    async def probe(tokens: str = "false"):
        if status == 200:
            return _STATE | ({"prompt_token_ids": [7, 8]} if tokens == "true" else {})
        return JSONResponse({"error": {"message": f"the instance answered {status}", "type": "x", "param": None,
                                       "code": "boom"}}, status_code=status)
    return app


def test_a_5xx_moves_the_call_and_when_every_instance_fails_the_client_gets_the_instances_error():
    doubles = [serve_in_thread(_failing_instance(500)) for _ in range(2)]
    gw = build_gateway([u for u, _ in doubles], api_keys=[KEY], policy=get_policy("talaria"), probe_interval_s=0.2)
    url, server = serve_in_thread(gw)
    try:
        r = _post(url, {"model": "tiny-dense", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["message"] == "the instance answered 500"
        assert metric(url, "router_replacements_total") == 0  # a probe's failure: placed elsewhere before forwarding
        assert all(up.accepting for up in gw.state.upstreams)  # answering a 5xx is not being down
    finally:
        server.should_exit = True
        for _, s in doubles:
            s.should_exit = True


def test_a_call_one_instance_refuses_goes_to_one_that_takes_it():
    """Instances may have other limits (--max_n, --max_model_len): one's 4xx is the answer only if all refuse."""
    doubles = [serve_in_thread(_failing_instance(code)) for code in (400, 200)]
    gw = build_gateway([u for u, _ in doubles], api_keys=[KEY], policy=get_policy("talaria"), probe_interval_s=0.2)
    url, server = serve_in_thread(gw)
    try:
        r = _post(url, {"model": "tiny-dense", "prompt": "hi", "max_tokens": 1, "n": 16})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    finally:
        server.should_exit = True
        for _, s in doubles:
            s.should_exit = True


def test_a_call_whose_first_probe_fails_is_still_put_in_a_session():
    """The instance asked for the prompt's token ids fails its probe: the next one answers them, and
    the call is placed in an inferred session (named in its answer) as any other."""
    doubles = [serve_in_thread(_failing_instance(code)) for code in (500, 200)]
    gw = build_gateway([u for u, _ in doubles], api_keys=[KEY], policy=get_policy("talaria"), probe_interval_s=0.2)
    url, server = serve_in_thread(gw)
    try:
        r = _post(url, {"model": "tiny-dense", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers.get("x-talaria-session")
        assert metric(url, "router_sessions_total{identified=\"inferred\"}") == 1
    finally:
        server.should_exit = True
        for _, s in doubles:
            s.should_exit = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(url: str, sid: str, task: int, turns: int, stream: bool) -> list[str]:
    """An agent session of tiny-dense completions through `url` on task number `task`: each call's
    reply and a tool result join the prompt. Returns the replies."""
    c = client(url)
    repo = ["flask", "numpy", "requests", "django"][task % 4]
    prompt = f"You are a coding agent. Answer briefly.\nList the files of the {repo} repository.\n"
    replies = []
    for t in range(turns):
        kw = dict(model="tiny-dense", prompt=prompt, max_tokens=16, temperature=0, extra_headers={"x-session-id": sid})
        if stream:
            text = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
        else:
            text = c.completions.create(**kw).choices[0].text
        replies.append(text)
        prompt += f"{text}\nTool output {t}: README.md setup.py src/ tests/ ({repo})\n"
    return replies


# A plain chat template (the tiny models' byte tokenizer has none): tools reach the model in the
# fallback format of serve.tools, their calls constrained by the grammar of tool_choice required.
TINY_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
LIST_FILES = [{"type": "function", "function": {"name": "list_files", "description": "List a repository's files",
                                                "parameters": {
    "type": "object", "properties": {"repo": {"enum": ["flask", "numpy", "requests"]}, "depth": {"enum": [1, 2]}},
    "required": ["repo", "depth"]}}}]


def _tool_session(url: str, sid: str, turns: int, stream: bool, in_flight=None) -> list[tuple]:
    """A tool-calling chat session of tiny-dense through `url` (tool_choice required, one call a turn):
    each call's tool result joins the history. Returns each answer's (content, calls, finish reason),
    streamed deltas joined; `in_flight(turn)` runs while a streamed answer is open, after its first chunk."""
    c = client(url)
    messages = [{"role": "user", "content": "Which files does the flask repository have?"}]
    answers = []
    for t in range(turns):
        kw = dict(model="tiny-dense", messages=messages, tools=LIST_FILES, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, temperature=0, extra_headers={"x-session-id": sid})
        if stream:
            content, calls, reason = "", [], None
            for n, ch in enumerate(c.chat.completions.create(stream=True, **kw)):
                if n == 0 and in_flight is not None:
                    in_flight(t)
                for choice in ch.choices:
                    content += choice.delta.content or ""
                    calls += [(d.function.name, d.function.arguments) for d in choice.delta.tool_calls or []]
                    reason = choice.finish_reason or reason
            answer = (content or None, calls, reason)
        else:
            choice = c.chat.completions.create(**kw).choices[0]
            answer = (choice.message.content, [(d.function.name, d.function.arguments)
                                               for d in choice.message.tool_calls or []], choice.finish_reason)
        answers.append(answer)
        ids = [f"call_{t}_{k}" for k in range(len(answer[1]))]
        messages += [{"role": "assistant", "content": answer[0], "tool_calls": [
                          {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                          for i, (n, a) in zip(ids, answer[1])]},
                     *({"role": "tool", "tool_call_id": i, "content": f"README.md setup.py src/ ({t})"} for i in ids)]
    return answers


def _responses_session(url: str, sid: str, turns: int, stream: bool, in_flight=None) -> list[tuple]:
    """`_tool_session` on the Responses API: each answer's function calls and status; each turn
    continues the last response (`previous_response_id`) with the calls' outputs."""
    c = client(url)
    tools = [{"type": "function", **t["function"]} for t in LIST_FILES]
    previous, given, answers = None, "Which files does the flask repository have?", []
    for t in range(turns):
        kw = dict(model="tiny-dense", input=given, tools=tools, tool_choice="required", parallel_tool_calls=False,
                  max_output_tokens=120, temperature=0, previous_response_id=previous,
                  extra_headers={"x-session-id": sid})
        if stream:
            for n, event in enumerate(c.responses.create(stream=True, **kw)):
                if n == 0 and in_flight is not None:
                    in_flight(t)
            response = event.response  # the last event's: response.completed (or incomplete)
        else:
            response = c.responses.create(**kw)
        calls = [o for o in response.output if o.type == "function_call"]
        answers.append(([(o.name, o.arguments) for o in calls], response.status))
        previous = response.id
        given = [{"type": "function_call_output", "call_id": o.call_id, "output": f"README.md ({t})"} for o in calls]
    return answers


def _messages_session(url: str, sid: str, turns: int, stream: bool, in_flight=None) -> list[tuple]:
    """`_tool_session` on Anthropic's Messages API, with the anthropic client."""
    import anthropic

    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300,
                                 default_headers={"x-session-id": sid})
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in LIST_FILES]
    messages, answers = [{"role": "user", "content": "Which files does the flask repository have?"}], []
    for t in range(turns):
        kw = dict(model="tiny-dense", max_tokens=120, messages=messages, tools=tools,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
        if stream:
            with claude.messages.stream(**kw) as events:
                for n, _ in enumerate(events):
                    if n == 0 and in_flight is not None:
                        in_flight(t)
                answer = events.get_final_message()
        else:
            answer = claude.messages.create(**kw)
        uses = [b for b in answer.content if b.type == "tool_use"]
        answers.append(([(b.name, b.input) for b in uses], answer.stop_reason))
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": b.id, "name": b.name,
                                                        "input": b.input} for b in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": f"README.md ({t})"} for b in uses]}]
    return answers


def test_a_killed_instance_loses_no_call(tmp_path):
    """Two talaria-serve processes behind the gateway; one is killed (SIGKILL) while it streams a tool
    call of a running session, other sessions' calls in flight. Every session completes, each reply
    what it is without the fault, and the streamed tool calls, joined, are the calls answered whole.
    Then, the killed server started again, the same on the Responses API, and again on Anthropic's
    Messages API: a stream cut by the kill continues on the other instance, its answer whole.
    The tiny random model keeps the two servers' start-up short (the real-client test above runs
    SmolLM2)."""
    ports = [_free_port(), _free_port()]
    template = tmp_path / "chat.jinja"
    template.write_text(TINY_TEMPLATE)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}"}

    def start(k: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "talaria_jax.launch.serve", f"--port={ports[k]}",
                                 f"--api_key={KEY}", "--model=tiny-dense", "--max_model_len=2048", "--max_seqs=4",
                                 "--kv_mib_per_device=64", f"--chat_template={template}", "--nowarmup"],
                                env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"i{k}.log", "a"))

    def wait_up(k: int) -> None:
        deadline = time.time() + 300
        while True:
            assert procs[k].poll() is None and time.time() < deadline, (tmp_path / f"i{k}.log").read_text()[-3000:]
            try:
                if httpx.get(f"{urls[k]}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    procs = [start(k) for k in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for k in range(2):
            wait_up(k)
        gw = build_gateway(urls, api_keys=[KEY], policy=get_policy("talaria"), probe_interval_s=0.2)
        gurl, gserver = serve_in_thread(gw)
        ups, killed = gw.state.upstreams, []

        def kill_its_instance(turn: int):  # the tool session's second answer is streaming: kill its instance
            if turn == 1 and not killed:
                [name] = [up for key, up in gw.state.sessions.items() if key.endswith(":tools")]
                killed.append(next(k for k, up in enumerate(ups) if up.name == name))
                procs[killed[0]].send_signal(signal.SIGKILL)

        with concurrent.futures.ThreadPoolExecutor(5) as pool:  # no fault, tool calls answered whole: what to expect
            want = list(pool.map(lambda k: _session(gurl, f"ref-{k}", k, 4, k % 2 == 0), range(4)))
            want_tools = _tool_session(gurl, "ref-tools", 3, stream=False)
            futures = [pool.submit(_session, gurl, f"s{k}", k, 4, k % 2 == 0) for k in range(4)]
            tools = pool.submit(_tool_session, gurl, "tools", 3, True, kill_its_instance)
            got = [f.result() for f in futures]
            got_tools = tools.result()
        assert killed, "the tool session never streamed a second answer"
        assert got == want
        assert got_tools == want_tools and all(reason == "tool_calls" and len(calls) == 1
                                               for _, calls, reason in got_tools), got_tools
        assert not ups[killed[0]].alive and ups[1 - killed[0]].alive
        assert metric(gurl, "router_replacements_total") >= 1
        for api, session in (("responses", _responses_session), ("messages", _messages_session)):
            procs[killed[0]] = start(killed[0])  # the killed server back: both instances up again
            wait_up(killed[0])
            while not all(up.accepting for up in ups):
                time.sleep(0.1)
            killed.clear()

            def kill_it(turn: int, sid=f"{api}-fault"):  # its second answer is streaming: kill its instance
                if turn == 1 and not killed:
                    [name] = [up for key, up in gw.state.sessions.items() if key.endswith(f":{sid}")]
                    killed.append(next(k for k, up in enumerate(ups) if up.name == name))
                    procs[killed[0]].send_signal(signal.SIGKILL)
            want = session(gurl, f"{api}-ref", 3, stream=False)
            got = session(gurl, f"{api}-fault", 3, True, kill_it)
            assert killed and got == want and all(len(calls) == 1 for calls, _ in got), (api, got, want)
        gserver.should_exit = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_talaria_route_serves_over_local_instances(tmp_path):
    """`talaria-route --local_instances=2` starts two talaria-serve processes (each its own memory
    maps: two SmolLM2 instances' programs do not fit one process's vm.max_map_count), answers the
    openai client over them, and stops them with itself on SIGTERM."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "talaria_jax.launch.route", "--local_instances=2",
                             "--model=tiny-dense,tiny-moe", f"--port={port}", f"--api_key={KEY}", "--nowarmup",
                             "--max_model_len=256", "--max_seqs=2", "--kv_mib_per_device=4", "--policy=round",
                             "--host_kv_bytes=8M"],
                            env={**os.environ, "XLA_FLAGS": FAST_COMPILE},
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "route.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "route.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).json().get("instances_up") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        c = client(url)
        assert sorted(m.id for m in c.models.list().data) == ["tiny-dense", "tiny-moe"]
        out = c.completions.create(model="tiny-moe", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        kids = _children(proc.pid)
        assert len(kids) == 2 and all(b"talaria_jax.launch.serve" in open(f"/proc/{k}/cmdline", "rb").read()
                                      for k in kids)
        instances = httpx.get(f"{url}/health").json()["instances"]
        assert len({i["url"] for i in instances}) == 2 and all(i["up"] for i in instances)
        host_kv = metric(instances[0]["url"], "host_kv_capacity_bytes")
        assert host_kv == 8 << 20  # --host_kv_bytes=8M reached each instance
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully, then re-raises the signal
        assert proc.wait(timeout=90) in (0, -signal.SIGTERM)
        assert not any(os.path.exists(f"/proc/{k}") for k in kids)  # the instances stopped before it exited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _sessions(instances) -> int:
    """Sessions the instances keep (from their probe answers)."""
    ask = {"model": "tiny-dense", "prompt": "x", "max_tokens": 1}
    return sum(httpx.post(f"{u}/talaria/probe", json=ask, headers={"Authorization": f"Bearer {KEY}"}).json()["sessions"]
               for u in instances)


def test_agent_hints_reach_the_instances_and_last_calls_free_their_sessions(cluster):
    _, url, instances = cluster
    c = client(url)
    kw = dict(model="tiny-dense", prompt="Once upon a time", max_tokens=4, temperature=0)
    before = _sessions(instances)
    for k in range(7):  # header and body hints: one call follows, then the session ends
        c.completions.create(**kw, extra_headers={"x-session-id": f"h{k}", "x-agent-hints": "calls_left=1, tool_s=2"})
        c.completions.create(**kw, extra_headers={"x-session-id": f"h{k}"}, extra_body={"agent_hints": {"calls_left": 0}})
    # an instance believes hints once three sessions have borne them out: of seven sessions over two
    # instances, at least one instance saw four, and freed the fourth as its last call ended
    assert before + 1 <= _sessions(instances) < before + 7
