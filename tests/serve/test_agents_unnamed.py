"""Agents as they are: real clients that name no session, through talaria-route's gateway over two
instance servers (SmolLM2), run concurrently. The openai-agents SDK with its default Responses model
and with its Chat Completions model, mini-swe-agent (through litellm) and the anthropic SDK in a tool
loop. The gateway's inferred sessions are compared with the true runs, call by call: every call of
a run in one session (recall 1.0), no two runs merged (precision 1.0), two runs that open with the
same prompt kept apart. Each call is observed at the gateway's front door (the run's tag it was sent
with, the session its answer names), by a recorder around the gateway's ASGI app."""
import asyncio
import concurrent.futures
import itertools
import os
import threading

import anthropic
import httpx
import pytest

from conftest import OPTIMIZED
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve.app import serve_in_thread
from talaria_jax.serve.gateway import build_gateway
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.local_cluster import LocalCluster

pytestmark = pytest.mark.slow  # SmolLM2 behind two real servers
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (litellm would fetch its cost map from the web)

KEY, OTHER = "sk-unnamed", "sk-unnamed-2"
CONFIG = EngineConfig(page_size=16, max_seqs=8, max_tokens_per_step=512, max_model_len=4096, prefix_cache=True,
                      warmup=False, compiler_options=OPTIMIZED)


class Recorder:
    """An ASGI wrapper that notes, for each call, the `x-run` header it came with and the
    `x-talaria-session` header of its answer."""

    def __init__(self, app):
        self.app, self.calls, self.mu = app, [], threading.Lock()

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        run = dict(scope["headers"]).get(b"x-run", b"").decode()

        async def noting(message):
            if message["type"] == "http.response.start" and run:
                session = dict(message.get("headers", [])).get(b"x-talaria-session", b"").decode()
                with self.mu:
                    self.calls.append((run, session, scope["path"], message["status"]))
            await send(message)
        await self.app(scope, receive, noting)


@pytest.fixture(scope="module")
def gateway():
    with LocalCluster.build(InstanceConfig({"smol": "smollm2-135m-instruct"}, ServerConfig((KEY, OTHER)), CONFIG,
                                           hardware="cpu", kv_bytes_per_device=256 << 20), instances=2) as lc:
        recorder = Recorder(build_gateway(lc.urls, api_keys=[KEY, OTHER], policy=get_policy("talaria"),
                                          probe_interval_s=5.0, probe_timeout_s=600.0))
        # (health checks wait 5 s on a busy CPU; a probe waits for the step in flight, which may compile a
        # new step shape here: the engines do not warm up, and a slow probe would pass its instance over)
        url, server = serve_in_thread(recorder)
        try:
            yield url, recorder
        finally:
            server.should_exit = True
            server.thread.join(timeout=30)


CITIES = ["Paris", "Oslo", "Tokyo", "Lima", "Cairo", "Delhi", "Quito", "Rome", "Seoul", "Accra", "Dakar", "Hanoi"]


def weather(city: str) -> str:
    return f"{abs(hash(city)) % 30} degrees in {city}, clear sky."


def agents_run(url: str, run: str, city: str, responses: bool, seed: int | None = None) -> bool:
    """The openai-agents SDK: one agent with a function tool, its default model (Responses) or its
    Chat Completions model, at most 3 turns. True when the SDK ended the run at an answer cut at
    `max_tokens`: tool arguments that are not whole JSON (the SDK raises), or a run whose answers call
    no tool although the first must (an answer cut before its tool call, which the SDK ends the run at)."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return weather(city)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600,
                         default_headers={"x-run": run})
    model = (agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel)(
        model="smol", openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                    max_tokens=60, extra_args={"seed": seed} if seed is not None else None)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=settings)
    try:
        result = asyncio.run(agents.Runner.run(agent, f"What is the weather in {city}?", max_turns=3))
    except agents.MaxTurnsExceeded:
        return False
    except agents.ModelBehaviorError:
        return True
    return not any(item.type == "tool_call_item" for item in result.new_items)


def claude_run(url: str, run: str, city: str) -> None:
    """The anthropic SDK in a tool loop: each tool_use answered with a tool_result, 3 calls."""
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=600,
                                 default_headers={"x-run": run})
    tools = [{"name": "get_weather", "description": "The current weather of a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"]}}]
    messages = [{"role": "user", "content": f"Check the weather in {city}, then in two nearby cities."}]
    for _ in range(3):
        answer = client.messages.create(model="smol", max_tokens=60, messages=messages, tools=tools,
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True})
        uses = [b for b in answer.content if b.type == "tool_use"]
        messages += [{"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input"})
                                                       for b in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": weather(str(b.input.get("city")))} for b in uses]}]


def swe_run(url: str, run: str, k: int, folder) -> None:
    """mini-swe-agent (litellm, tool-call mode): bash steps on a file of its own, 2 steps."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    (folder / f"note{k}.txt").write_text(f"note {k}\n")
    model = LitellmModel(model_name="openai/smol", cost_tracking="ignore_errors", model_kwargs={
        "api_base": f"{url}/v1", "api_key": KEY, "tool_choice": "required", "temperature": 0.7, "seed": k,
        "max_tokens": 60, "extra_headers": {"x-run": run}})
    agent = DefaultAgent(model, LocalEnvironment(cwd=str(folder), timeout=10),
                         system_template="You run bash commands with the bash tool, one per answer.",
                         instance_template=f"Show note{k}.txt with cat, then append the word done{k} to it.",
                         step_limit=2, cost_limit=0)
    agent.run(f"Finish note{k}.txt.")


def _pairs(calls):
    tp = fp = fn = 0
    for (run_a, sa, _), (run_b, sb, _) in itertools.combinations(calls, 2):
        tp += run_a == run_b and sa == sb
        fp += run_a != run_b and sa == sb
        fn += run_a == run_b and sa != sb
    return tp, fp, fn


def test_real_clients_without_a_session_header_get_their_true_sessions(gateway, tmp_path):
    url, recorder = gateway
    pytest.importorskip("agents")
    pytest.importorskip("minisweagent")
    jobs = [lambda i=i: agents_run(url, f"resp-{i}", CITIES[i], responses=True) for i in range(6)]
    jobs += [lambda i=i: agents_run(url, f"chat-{i}", CITIES[6 + i], responses=False) for i in range(4)]
    # two runs that open with the very same prompt (their sampled answers then differ)
    jobs += [lambda s=s: agents_run(url, f"twin-{s}", "Bern", responses=False, seed=s) for s in (11, 12)]
    jobs += [lambda i=i: claude_run(url, f"claude-{i}", CITIES[i]) for i in range(5)]
    jobs += [lambda i=i: swe_run(url, f"swe-{i}", i, tmp_path) for i in range(4)]
    assert len(jobs) >= 20
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        ended_at_a_cut_answer = sum(bool(f.result()) for f in [pool.submit(job) for job in jobs])
    answered = [c for c in recorder.calls if c[2] in ("/v1/responses", "/v1/chat/completions", "/v1/messages")]
    refused = [c for c in answered if c[3] != 200]  # (a client's own bad request: a context overflow, say)
    print(f"refused: {refused}")
    assert len(refused) <= len(answered) // 10, refused
    cut = {c[0] for c in refused}  # runs that a refused call ended early (the client raises)
    print(f"runs ended by an answer cut at max_tokens: {ended_at_a_cut_answer}")
    calls = [c[:3] for c in answered if c[3] == 200]
    assert all(session for _, session, _ in calls), [c for c in calls if not c[1]]  # every answer names its session
    runs = {run for run, _, _ in calls}
    assert len(runs | cut) == len(jobs)
    assert {path for _, _, path in calls} == {"/v1/responses", "/v1/chat/completions", "/v1/messages"}
    per_run = {run: [c for c in calls if c[0] == run] for run in runs}
    # each run makes two calls or more, but for those its client ended early (a refused call, an answer
    # cut at max_tokens); most runs make two or more
    short = {r for r, c in per_run.items() if len(c) < 2}
    assert len(short - cut) <= ended_at_a_cut_answer, {r: len(c) for r, c in per_run.items()}
    assert len(short) <= len(jobs) // 3, {r: len(c) for r, c in per_run.items()}
    tp, fp, fn = _pairs(calls)
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    print(f"{len(calls)} calls of {len(runs)} runs: precision {precision:.3f}, recall {recall:.3f}")
    assert (precision, recall) == (1.0, 1.0), {run: [s for _, s, _ in c] for run, c in per_run.items()}
    twins = [{s for _, s, _ in per_run.get(f"twin-{s}", [])} for s in (11, 12)]
    assert not twins[0] & twins[1]


def test_two_tenants_with_the_same_prompts_share_no_session_and_no_kv(gateway):
    """A tenant that sends what continues another tenant's conversation is not put in its session,
    and reads none of its KV."""
    url, _ = gateway
    ask = [{"role": "user", "content": "Write a haiku about tenants and keys."}]

    def chat(key, messages):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {key}"},
                       json={"model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0})
        return r.headers["x-talaria-session"], r.json()
    first, answer = chat(KEY, ask)
    more = ask + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "Another one."}]
    mine, mine_answer = chat(KEY, more)
    theirs, their_answer = chat(OTHER, more)
    assert mine == first and theirs not in (first, mine)
    assert mine_answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert their_answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_runs_alike_to_the_token_keep_their_sessions_by_their_tool_call_ids(gateway):
    """Two runs send the same prompt and, greedy, get the same tool call: only the ids the server made
    up differ. Each run's next call (the same prompt again), sent in the opposite order, continues its
    own session."""
    url, _ = gateway
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Bern?"}]

    def chat(messages):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "smol", "messages": messages, "tools": tools, "tool_choice": "required",
                             "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.headers["x-talaria-session"], r.json()["choices"][0]["message"]

    def then(message):
        return ask + [{"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}] + [
            {"role": "tool", "tool_call_id": c["id"], "content": "12 degrees, clear sky."} for c in message["tool_calls"]]
    (s1, m1), (s2, m2) = chat(ask), chat(ask)
    assert s1 != s2 and [c["function"] for c in m1["tool_calls"]] == [c["function"] for c in m2["tool_calls"]]
    second, _ = chat(then(m2))
    first, _ = chat(then(m1))
    assert (first, second) == (s1, s2)
