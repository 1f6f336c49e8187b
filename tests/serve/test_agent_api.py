"""Tool calling and structured outputs with SmolLM2 and the real `openai` client: tool_choice required
and named always give calls of declared tools with schema-valid arguments; json_schema outputs
validate; streamed tool calls add up to the answer; the turn after a tool ran is served. Sessions are
inferred for calls that name none; Anthropic's Messages API, through the real `anthropic` client,
answers as the equivalent chat call."""
import concurrent.futures
import json
import os

import anthropic
import httpx
import jax
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from conftest import OPTIMIZED
from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.serve.app import ServedModel, build_app, serving
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import load_model

pytestmark = pytest.mark.slow  # SmolLM2 behind a real server

KEY = "sk-agent"
CONFIG = EngineConfig(page_size=16, max_seqs=16, max_tokens_per_step=256, max_model_len=1024, prefix_cache=True,
                      warmup=False, compiler_options=OPTIMIZED)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "description": "Searches the web",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 80},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                                          "required": ["query"]}}},
    {"type": "function", "function": {"name": "add", "description": "Adds numbers",
                                      "parameters": {"type": "object", "properties": {
                                          "numbers": {"type": "array", "items": {"type": "number"},
                                                      "maxItems": 4}},
                                          "required": ["numbers"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What is the weather in {}?", "Find recent news about {}.", "How warm is it in {} today?",
        "Search for the history of {}.", "Add the number of letters in {} to 12."]
PLACES = ["Paris", "Oslo", "Tokyo", "Lima", "Cairo", "Delhi", "Quito", "Rome", "Seoul", "Accra", "Dakar", "Hanoi",
          "Bern", "Kyiv", "Riga", "Baku", "Doha", "Suva", "Apia", "Perth"]
PROMPTS = [a.format(p) for a in ASKS for p in PLACES]  # 100
# the suite asks 8 spread over them (one batch of the engine); TALARIA_AGENT_PROMPTS=100 asks all (docs/agents.md)
COUNT = int(os.environ.get("TALARIA_AGENT_PROMPTS", "8"))
PICKED = [round(i * 100 / COUNT) for i in range(COUNT)]  # of the 100 cases: a case is its prompt and seed
# Arrays and strings are bounded: a 135M model under a grammar can repeat an array's items or a
# string's text until max_tokens (the output is then cut: finish_reason "length"), as it can without one.
TEXT = {"type": "string", "maxLength": 40}
SCHEMAS = [
    {"type": "object", "properties": {"name": TEXT, "address": {
        "type": "object", "properties": {"city": TEXT, "country": TEXT}, "required": ["city", "country"]}},
     "required": ["name", "address"]},  # nested objects
    {"type": "object", "properties": {"items": {"type": "array", "items": TEXT, "maxItems": 5}},
     "required": ["items"]},  # arrays
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}, "required": ["mood"]},  # enums
    {"type": "object", "properties": {"temperature": {"type": "number"}, "year": {"type": "integer",
                                                                                   "minimum": 1900, "maximum": 2100}},
     "required": ["temperature", "year"]},  # numbers
    {"type": "object", "properties": {"title": TEXT, "pages": {"type": "integer"},
                                      "tags": {"type": "array", "items": TEXT, "maxItems": 3}},
     "required": ["title", "pages", "tags"], "additionalProperties": False},  # required fields
]
TOPICS = ["a person", "a shopping list", "a feeling", "today's weather", "a book", "a trip", "a city", "a game",
          "a song", "a meal", "a friend", "a movie", "a garden", "a school", "a car", "a river", "a job", "a dog",
          "a storm", "a museum"]


@pytest.fixture(scope="module")
def server():
    lm = load_model("smollm2-135m-instruct", make_mesh(jax.devices()[:1]))
    app = build_app(ServedModel("smol", Engine(lm.model, CONFIG, tokenizer=lm.tokenizer)), api_keys=[KEY])
    with serving(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)


def _many(fn, items):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # batched in the engine, as agents' calls are
        return list(pool.map(fn, items))


def _valid_call(call) -> bool:
    try:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        return call.type == "function" and call.id.startswith("call_")
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False


def test_required_gives_a_declared_call_with_valid_arguments_every_time(server):
    def ask(k):
        return server.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPTS[k]}],
                                              tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                              temperature=0.8, seed=k, max_tokens=300)
    answers = _many(ask, PICKED)
    good = [a for a in answers if a.choices[0].finish_reason == "tool_calls" and a.choices[0].message.content is None
            and len(a.choices[0].message.tool_calls) == 1 and _valid_call(a.choices[0].message.tool_calls[0])]
    assert len(good) == COUNT, [a.choices[0] for a in answers if a not in good][:3]
    assert len({a.choices[0].message.tool_calls[0].function.name for a in answers}) > 1  # the prompt matters


def test_an_answer_cut_by_max_tokens_keeps_its_complete_calls(server):
    # SmolLM2 under tool_choice required answers this with two calls; cut short, the answer keeps the
    # calls it finished and shows the cut one nowhere (neither as a call nor as raw text), plain and streamed
    kw = dict(model="smol", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
              tool_choice="required", temperature=0.0)
    whole = server.chat.completions.create(max_tokens=200, **kw)
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    n = whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == "tool_calls" and len(want) == 2, whole
    kept = []
    for limit in (n // 2 + 3, n - 8, 6):  # after the first call, inside the second, inside the first
        cut = server.chat.completions.create(max_tokens=limit, **kw).choices[0]
        got = [(c.function.name, c.function.arguments) for c in cut.message.tool_calls or ()]
        assert cut.finish_reason == "length" and got == want[:len(got)] and not cut.message.content, (limit, cut)
        streamed, calls, finish = "", {}, None
        for chunk in server.chat.completions.create(stream=True, max_tokens=limit, **kw):
            for ch in chunk.choices:
                streamed += ch.delta.content or ""
                calls.update({c.index: (c.function.name, c.function.arguments) for c in ch.delta.tool_calls or ()})
                finish = ch.finish_reason or finish
        assert finish == "length" and streamed == "" and list(calls.values()) == got, (limit, streamed, calls)
        kept.append(len(got))
    assert kept[0] == kept[1] == 1 and kept[2] == 0, kept


def test_a_named_tool_is_always_the_one_called(server):
    def ask(k):
        return server.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": PROMPTS[k]}], tools=TOOLS, temperature=0.8, seed=k,
            tool_choice={"type": "function", "function": {"name": "search"}}, parallel_tool_calls=False, max_tokens=300)
    for a in _many(ask, PICKED):
        calls = a.choices[0].message.tool_calls
        assert a.choices[0].finish_reason == "tool_calls" and len(calls) == 1, a.choices[0]
        assert calls[0].function.name == "search" and _valid_call(calls[0])


def test_json_schema_outputs_validate_every_time(server):
    def ask(k):
        schema = SCHEMAS[k % len(SCHEMAS)]
        topic = TOPICS[round(k * len(TOPICS) / 100) % len(TOPICS)]
        return schema, server.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema, "strict": True}},
            temperature=0.8, seed=k, max_tokens=300)
    for schema, a in _many(ask, PICKED):
        text = a.choices[0].message.content
        assert a.choices[0].finish_reason == "stop", text
        try:
            value = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"{e}: {text!r} ({a.usage.completion_tokens} tokens)") from None
        jsonschema.validate(value, schema)
    # json_object: any object (unbounded: at temperature 0 this model nests until max_tokens)
    def ask_object(seed):
        return server.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Give a JSON object about a cat."}],
            response_format={"type": "json_object"}, temperature=0.8, seed=seed, max_tokens=200).choices[0]
    for any_object in _many(ask_object, range(3)):  # batched
        assert any_object.message.content.startswith("{")
        if any_object.finish_reason == "stop":
            assert isinstance(json.loads(any_object.message.content), dict)


def test_a_streamed_tool_call_adds_up_to_the_answer(server):
    def whole_and_streamed(k):
        kw = dict(model="smol", messages=[{"role": "user", "content": PROMPTS[k]}], tools=TOOLS, temperature=0,
                  tool_choice="required", parallel_tool_calls=False, max_tokens=300)
        whole = server.chat.completions.create(**kw).choices[0]
        return whole, [c.choices[0] for c in server.chat.completions.create(**kw, stream=True) if c.choices]

    for whole, chunks in _many(whole_and_streamed, (0, 21, 47)):  # batched
        calls = [t for c in chunks for t in (c.delta.tool_calls or [])]
        assert "".join(c.delta.content or "" for c in chunks) == (whole.message.content or "")
        assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
               [(i, t.function.name, t.function.arguments) for i, t in enumerate(whole.message.tool_calls)]
        assert chunks[-1].finish_reason == whole.finish_reason == "tool_calls"
        assert sum(c.finish_reason is not None for c in chunks) == 1


def test_the_turn_after_a_tool_ran_is_served_from_the_prefix_cache(server):
    """What an SDK sends after running the tool: the assistant's tool calls (content null) and a tool
    message per call; rendered in the fallback format for SmolLM2, whose template has no tools."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = server.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=300, extra_headers={"x-session-id": "oslo"})
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees celsius, snowing"}]
    second = server.chat.completions.create(model="smol", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=30, extra_headers={"x-session-id": "oslo"})
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


# ---- sessions without a header, and Anthropic's Messages API ------------------------------------------
def test_sessions_are_inferred_from_the_prompts_and_keys_name_them(server):
    """Two conversations that open alike, neither naming a session: each call of one is in one session,
    and the two are never merged (the answer the server sent shows in each one's next prompt)."""
    def call(messages, seed, **kw):
        raw = server.chat.completions.with_raw_response.create(model="smol", messages=messages, temperature=1.0,
                                                                seed=seed, max_tokens=12, **kw)
        return raw.headers["x-talaria-session"], raw.parse().choices[0].message.content
    convs = {seed: [{"role": "user", "content": "Name a colour and a fruit."}] for seed in (1, 2)}
    sessions = {seed: [] for seed in convs}
    for turn in range(3):
        for seed, messages in convs.items():
            session, text = call(messages, seed + 10 * turn)
            sessions[seed].append(session)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And number {turn}?"}]
    assert all(len(set(s)) == 1 for s in sessions.values()), sessions
    assert sessions[1][0] != sessions[2][0]
    assert call([{"role": "user", "content": "Hi"}], 0, extra_body={"prompt_cache_key": "conv-7"})[0] == "conv-7"
    assert call([{"role": "user", "content": "Hi"}], 0, extra_headers={"x-session-id": "mine"})[0] == "mine"


def _same_tokens(text: str, chat_choice) -> bool:
    """`text` is the greedy chat answer's, up to where the chat answer's best two tokens were within
    1e-3 of each other (the same prompt read from the prefix cache or computed afresh sums in
    another order, which can flip such a near tie): the two agree to there."""
    if text == (chat_choice.message.content or ""):
        return True
    done = ""
    for t in chat_choice.logprobs.content:
        if not text.startswith(done + t.token):  # the first token where they part
            top = sorted((c.logprob for c in t.top_logprobs), reverse=True)
            return text.startswith(done) and len(top) > 1 and top[0] - top[1] < 1e-3
        done += t.token
    return False


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(server.base_url).rstrip("/").removesuffix("/v1"), api_key=KEY,
                               max_retries=0, timeout=600)


GREEDY = {"temperature": 0}  # (the SDK's own arguments have no temperature; the API takes one)
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _uses(message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def test_a_messages_tool_round_trip_equals_the_chat_call_with_the_whole_history(server):
    claude = _anthropic(server)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = claude.messages.create(model="smol", max_tokens=300, messages=ask, tools=A_TOOLS,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    chat = server.chat.completions.create(model="smol", messages=ask, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=300).choices[0].message
    assert first.stop_reason == "tool_use" and first.usage.output_tokens > 0
    assert _uses(first) == [(c.function.name, json.loads(c.function.arguments)) for c in chat.tool_calls]
    uses = [b for b in first.content if b.type == "tool_use"]
    history = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": u.id, "name": u.name,
                                                        "input": u.input} for u in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                   "content": "-3 degrees celsius, snowing"} for u in uses]}]
    second = claude.messages.create(model="smol", max_tokens=40, messages=history, tools=A_TOOLS, extra_body=GREEDY)
    same = server.chat.completions.create(model="smol", tools=TOOLS, temperature=0, max_tokens=40, logprobs=True,
                                          top_logprobs=2, messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
            for u in uses]}] + [{"role": "tool", "tool_call_id": u.id, "content": "-3 degrees celsius, snowing"}
                                for u in uses])
    text = "".join(b.text for b in second.content if b.type == "text")
    assert text and _same_tokens(text, same.choices[0])
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == same.usage.prompt_tokens
    assert second.usage.cache_read_input_tokens > 0  # the history's prefix was cached
    with claude.messages.stream(model="smol", max_tokens=40, messages=history, tools=A_TOOLS,
                                extra_body=GREEDY) as stream:  # the SDK parses every event with its own types
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in second.content]
    assert streamed.stop_reason == second.stop_reason


def test_a_messages_answer_cut_by_max_tokens_keeps_its_complete_calls(server):
    claude = _anthropic(server)
    kw = dict(model="smol", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=A_TOOLS,
              tool_choice={"type": "any"}, extra_body=GREEDY)
    whole = claude.messages.create(max_tokens=200, **kw)
    want, n = _uses(whole), whole.usage.output_tokens
    assert whole.stop_reason == "tool_use" and len(want) == 2, whole
    cut = claude.messages.create(max_tokens=n // 2 + 3, **kw)
    assert cut.stop_reason == "max_tokens" and _uses(cut) == want[:1] and all(b.type == "tool_use" for b in cut.content)
    with claude.messages.stream(max_tokens=n // 2 + 3, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens" and _uses(streamed) == want[:1]


def test_messages_stop_sequences_and_errors_in_anthropics_shape(server):
    claude = _anthropic(server)
    ask = [{"role": "user", "content": "Describe the sea in one sentence."}]
    text = claude.messages.create(model="smol", max_tokens=30, extra_body=GREEDY, messages=ask).content[0].text
    words = text.split()
    stop = words[len(words) // 2]
    cut = claude.messages.create(model="smol", max_tokens=30, extra_body=GREEDY, stop_sequences=[stop], messages=ask)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="gpt-9", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "gpt-9" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=claude.base_url, api_key="sk-wrong", max_retries=0).messages.create(
            model="smol", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smol", max_tokens=5, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["type"] == "error" and "messages[0].content[0]" in e.value.body["error"]["message"]
    missing = httpx.post(f"{claude.base_url}/v1/messages", headers={"x-api-key": KEY},
                         json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 400 and missing.json()["error"] == {
        "type": "invalid_request_error", "message": "'max_tokens' is required"}


# ---- OpenAI's Responses API ---------------------------------------------------------------------------
R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _calls(response) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]


def test_a_responses_tool_round_trip_and_continuation_equal_the_chat_calls(server):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    raw = server.responses.with_raw_response.create(model="smol", input=ask[0]["content"], tools=R_TOOLS,
                                                    tool_choice="required", temperature=0, max_output_tokens=300)
    first = raw.parse()
    chat = server.chat.completions.create(model="smol", messages=ask, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=300).choices[0].message
    assert first.status == "completed" and _calls(first) == [(c.function.name, c.function.arguments)
                                                             for c in chat.tool_calls]
    outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": "-3 degrees celsius, snowing"}
               for o in first.output if o.type == "function_call"]
    raw2 = server.responses.with_raw_response.create(model="smol", previous_response_id=first.id, input=outputs,
                                                     tools=R_TOOLS, temperature=0, max_output_tokens=40)
    second = raw2.parse()
    assert raw.headers["x-talaria-session"] == raw2.headers["x-talaria-session"]  # a response chain is a session
    same = server.chat.completions.create(model="smol", tools=TOOLS, temperature=0, max_tokens=40, logprobs=True,
                                          top_logprobs=2, messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in chat.tool_calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": "-3 degrees celsius, snowing"} for c in chat.tool_calls])
    assert second.output_text and _same_tokens(second.output_text, same.choices[0])
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # streamed: every event is valid under the openai client's own types, and they add up to the answer
    events = []
    with httpx.stream("POST", f"{server.base_url}responses", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "smol", "previous_response_id": first.id, "input": outputs, "tools": R_TOOLS,
                            "temperature": 0, "max_output_tokens": 40, "stream": True}, timeout=600) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[-1].type == "response.completed" and parsed[-1].response.output_text == second.output_text
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == second.output_text
    with server.responses.stream(model="smol", input="Say hi.", temperature=0, max_output_tokens=8) as stream:
        last = [e for e in stream][-1]  # the SDK's own stream reader
    assert last.type in ("response.completed", "response.incomplete") and last.response.output_text
    # stored responses: read, deleted, and then unknown (a 404 in OpenAI's shape)
    assert server.responses.retrieve(first.id).id == first.id
    assert server.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        server.responses.create(model="smol", previous_response_id=first.id, input="And now?", max_output_tokens=5)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    unstored = server.responses.create(model="smol", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        server.responses.retrieve(unstored.id)


def test_a_responses_answer_cut_by_max_tokens_keeps_its_complete_calls(server):
    kw = dict(model="smol", input="What is the weather in Paris?", tools=R_TOOLS, tool_choice="required",
              temperature=0)
    whole = server.responses.create(max_output_tokens=200, **kw)
    want, n = _calls(whole), whole.usage.output_tokens
    assert len(want) == 2, whole
    cut = server.responses.create(max_output_tokens=n // 2 + 3, **kw)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert _calls(cut) == want[:1] and all(o.type == "function_call" for o in cut.output)
    with server.responses.stream(max_output_tokens=n // 2 + 3, **kw) as stream:
        streamed = [e for e in stream]
    done = streamed[-1]
    assert done.type == "response.incomplete" and _calls(done.response) == want[:1]
