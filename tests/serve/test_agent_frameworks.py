"""Agent frameworks through talaria-route's gateway over an instance server on 127.0.0.1 (SmolLM2):
the openai-agents SDK runs a function tool and answers with its result; mini-swe-agent in tool-call
mode runs bash steps on a toy task in a temporary folder; langchain-openai binds a tool, gets the
call, and sends the tool's answer back. Each run stops by itself (max turns, steps, tokens)."""
import httpx
import pytest

from conftest import OPTIMIZED
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.local_cluster import LocalCluster

pytestmark = pytest.mark.slow  # SmolLM2 behind a real server

KEY = "sk-frameworks"
CONFIG = EngineConfig(page_size=16, max_seqs=4, max_tokens_per_step=256, max_model_len=2048, prefix_cache=True,
                      warmup=False, compiler_options=OPTIMIZED)


@pytest.fixture(scope="module")
def cluster():
    """The gateway's URL and its one instance's."""
    with LocalCluster.build(InstanceConfig({"smol": "smollm2-135m-instruct"}, ServerConfig((KEY,)), CONFIG,
                                           hardware="cpu", kv_bytes_per_device=64 << 20)) as lc:
        with lc.gateway(get_policy("talaria"), probe_interval_s=0.5) as gateway:
            yield gateway, lc.urls[0]


@pytest.fixture(scope="module")
def url(cluster):
    return cluster[0]


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"talaria:{name}") and not line.startswith("#"))


def test_the_openai_agents_sdk_calls_the_tool_and_uses_its_result(url):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return "It is 18 degrees and sunny."

    model = agents.OpenAIChatCompletionsModel(model="smol", openai_client=AsyncOpenAI(
        base_url=f"{url}/v1", api_key=KEY, max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                          max_tokens=80))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls and calls[0]  # the SDK ran the tool with the model's arguments
    outputs = [i for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    assert outputs and outputs[0].output == "It is 18 degrees and sunny."
    assert isinstance(result.final_output, str) and result.final_output  # the turn after the tool answered
    # the answer came from a request that carried the tool's result (the SDK's last input)
    assert any(getattr(r, "usage", None) for r in result.raw_responses)
    assert len(result.raw_responses) >= 2


def test_langchain_binds_a_tool_and_takes_its_answer(url):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def search(query: str) -> str:
        """Searches the web."""
        return f"3 results for {query}"

    chat = lc.ChatOpenAI(model="smol", base_url=f"{url}/v1", api_key=KEY, temperature=0, max_tokens=80,
                         max_retries=0)
    bound = chat.bind_tools([search], tool_choice="search", parallel_tool_calls=False)
    messages = [HumanMessage("Find news about Oslo.")]
    ai = bound.invoke(messages)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "search" and ai.tool_calls[0]["args"]["query"]
    messages += [ai, ToolMessage(search.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    reply = chat.bind_tools([search]).invoke(messages)
    assert reply.content or reply.tool_calls


SWE_SYSTEM = "You are a helpful assistant that runs bash commands with the bash tool, one per answer."
SWE_TASK = "In the current folder, the file greeting.txt says hello. Show it with cat, then make it say goodbye."


def test_mini_swe_agent_runs_bash_steps_through_the_gateway(cluster, tmp_path):
    """mini-swe-agent 2.x in tool-call mode (its default): every answer the server gives is a bash
    call (tool_choice required), the agent runs each in the folder, and the session's later calls
    reuse its prefix on the instance."""
    pytest.importorskip("minisweagent")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    gateway, instance = cluster
    (tmp_path / "greeting.txt").write_text("hello\n")
    model = LitellmModel(model_name="openai/smol", cost_tracking="ignore_errors", model_kwargs={
        "api_base": f"{gateway}/v1", "api_key": KEY, "tool_choice": "required", "temperature": 0.7, "seed": 3,
        "max_tokens": 80, "extra_headers": {"x-session-id": "swe"}})
    ran = []

    class Env(LocalEnvironment):
        def execute(self, action, *a, **kw):
            ran.append(action["command"])
            return super().execute(action, *a, **kw)

    hits = _metric(instance, "prefix_cache_hits_total")
    agent = DefaultAgent(model, Env(cwd=str(tmp_path), timeout=10), system_template=SWE_SYSTEM,
                         instance_template=SWE_TASK, step_limit=2, cost_limit=0)
    result = agent.run("Make greeting.txt say goodbye.")
    assert result["exit_status"] == "LimitsExceeded", result  # 2 steps, then the limit ends the run
    assert not [m for m in agent.messages if m.get("extra", {}).get("interrupt_type") == "FormatError"]
    assert len(ran) >= 2 and all(isinstance(c, str) and c for c in ran)  # bash calls, each executed
    assert _metric(instance, "prefix_cache_hits_total") - hits >= 64  # the steps after the first reuse the prefix
