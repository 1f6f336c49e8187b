"""Tool calling without a model: the output parsers (hermes, llama3_json), the stream's content and
tool-call deltas against the whole parse, the tools and tool-call history rendered for templates
with and without a tools section, the constrained-call grammars, and OpenAI's request checks."""
import asyncio
import json
import random

import pytest
from absl import app

from talaria_jax.engine import grammar
from talaria_jax.serve import protocol, tools
from talaria_jax.launch.common import chat_template_text
from talaria_jax.tokenizer import ByteTokenizer, chat_text, render_chat_template
from talaria_jax import web

SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a template with a tools section, in Qwen2.5's manner (tool calls read as objects)
NATIVE_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                   "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                   "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:"
                   "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
                   "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")
LLAMA_TEMPLATE = ("{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>"
                  "{% for m in messages %}{{ m.content }}{% endfor %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}, "required": ["q"]}}}]


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ("Let me look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}\n</tool_call>",
     "Let me look.\n", [("search", {"q": "x"})]),
    ("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", "
     "\"arguments\": \"{\\\"k\\\": 1}\"}</tool_call>", "", [("a", {}), ("b", {"k": 1})]),
    ("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}", "", [("a", {"x": 1})]),  # cut before the close
    ("no call here", "no call here", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # left as text
    ("<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>", []),  # no name
])
def test_hermes_output_parses(text, content, calls):
    got_content, got = tools.parse(text, "hermes")
    assert got_content == content and _names_args(got) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "search", "parameters": {"q": "x"}}', [("search", {"q": "x"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 2}}',
     [("a", {}), ("b", {"k": 2})]),
    ("plain text", []),
    ('{"name": "a", "parameters": {}} and more', []),
])
def test_llama3_json_output_parses(text, calls):
    content, got = tools.parse(text, "llama3_json")
    assert _names_args(got) == calls
    assert content == ("" if calls else text)


A = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
B = '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", "First.\n" + A + B + '<tool_call>{"name": "c", "argu', "First.\n", [("a", {"x": 1}), ("b", {})]),
    ("hermes", A + "<tool_call>", "", [("a", {"x": 1})]),
    ("hermes", 'Let me.<tool_call>{"name": "a", "ar', "Let me.", []),  # the cut call is nowhere
    ("hermes", A + "<tool_call>{broken}</tool_call>", A + "<tool_call>{broken}</tool_call>", []),  # closed: not cut
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "param', "", [("a", {})]),
    ("llama3_json", '{"answer": "a long', '{"answer": "a long', []),  # a cut answer stays an answer
])
def test_an_output_cut_at_its_limit_keeps_its_complete_calls(fmt, text, content, calls):
    got_content, got = tools.parse(text, fmt, cut=True)
    assert (got_content, _names_args(got)) == (content, calls)
    for n in (1, 3, 7):  # streamed: the same calls, and no text of a call in the content
        s = tools.ToolStream(fmt)
        sent = "".join(s.feed(text[i:i + n]) for i in range(0, len(text), n))
        rest, streamed = s.finish(cut=True)
        assert (sent + rest or None) == tools.message_content(content, calls) or (sent + rest == content == text)
        assert _names_args(streamed) == calls
    if calls:  # read as a whole output, the cut call spoils them all
        assert tools.parse(text, fmt)[1] == []


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "I will check.  \n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"<tool\"}}\n</tool_call>"),
    ("hermes", "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>"
               "<tool_call>{\"name\": \"b\", \"arguments\": {}}"),
    ("hermes", "An answer with < and <tool but no call.\n"),
    ("hermes", "<tool_call>{broken</tool_call> then text"),
    ("hermes", "   \n"),
    ("llama3_json", ' <|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}'),
    ("llama3_json", '{"name": "a", "parameters": {}}'),
    ("llama3_json", "<|python is not a tag"),
    ("llama3_json", "Sure: {\"name\": \"a\"}"),
])
def test_stream_deltas_add_up_to_the_whole_parse(fmt, text):
    content, calls = tools.parse(text, fmt)
    rng = random.Random(len(text))
    for _ in range(20):
        s, sent, i = tools.ToolStream(fmt), "", 0
        while i < len(text):
            n = rng.choice([1, 1, 2, 3, 8])
            sent += s.feed(text[i:i + n])
            i += n
        rest, got = s.finish()
        sent += rest
        assert (sent or None) == tools.message_content(content, calls) or (sent == content and not calls)
        assert _names_args(got) == _names_args(calls)
        if calls:  # nothing of a call ever went out as content
            assert "<tool_call>" not in sent and '"name"' not in sent


def _weather_turn(ask: str, call_id: str, city: str, result: str) -> list[dict]:
    """A user's question, the assistant's get_weather call (content null) and the tool's answer."""
    return [{"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def test_templates_without_tools_get_the_fallback_format():
    history = _weather_turn("Weather in Paris?", "call_1", "Paris", "18 C")
    messages, listed = tools.render_messages(history, TOOLS, SMOL_TEMPLATE)
    assert listed is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>" in messages[0]["content"] and json.dumps(TOOLS[0]) in messages[0]["content"]
    assert json.loads(messages[2]["content"].split("\n")[1]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>"
    text = render_chat_template(SMOL_TEMPLATE, messages)  # renders: every content is a string
    assert "<tool_call>" in text and "<|im_start|>assistant\n" in text
    sys_first = tools.render_messages([{"role": "system", "content": "Be brief."}, *history], TOOLS, SMOL_TEMPLATE)[0]
    assert sys_first[0]["content"].startswith("Be brief.\n\n# Tools") and len(sys_first) == 4
    plain = [{"role": "user", "content": "hi"}]
    assert tools.render_messages(plain, None, SMOL_TEMPLATE) == (plain, None)  # no tools: unchanged


def test_a_template_given_at_launch_serves_a_tokenizer_without_one(tmp_path):
    """--chat_template: the byte tokenizer has no template and no apply_chat_template; the given one
    renders its chats, tools in the fallback format. A file that cannot be read is a usage error."""
    messages, listed = tools.render_messages([{"role": "user", "content": "Weather in Paris?"}], TOOLS, SMOL_TEMPLATE)
    text = chat_text(ByteTokenizer(), SMOL_TEMPLATE, messages, listed)
    assert text == render_chat_template(SMOL_TEMPLATE, messages) and "<tools>" in text

    class OwnTemplate(ByteTokenizer):  # a tokenizer that renders its own template (and takes no other)
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
            return "own:" + render_chat_template(self.chat_template, messages)

        def template_variables(self):
            return {"bos_token": "<s>"}

    hi = [{"role": "user", "content": "hi"}]
    assert chat_text(OwnTemplate(), OwnTemplate.chat_template, hi) == "own:hi"
    assert chat_text(OwnTemplate(), "{{ bos_token }}{{ messages[0].content }}", hi) == "<s>hi"  # given in its place
    (tmp_path / "t.jinja").write_text(SMOL_TEMPLATE)
    assert chat_template_text(str(tmp_path / "t.jinja")) == SMOL_TEMPLATE and chat_template_text(None) is None
    with pytest.raises(app.UsageError, match="--chat_template: cannot read .*none.jinja"):
        chat_template_text(str(tmp_path / "none.jinja"))


def test_templates_with_tools_get_them_natively():
    history = _weather_turn("Weather?", "c1", "Oslo", "-3 C")
    messages, listed = tools.render_messages(history, TOOLS, NATIVE_TEMPLATE)
    assert listed == TOOLS and messages[1]["content"] == ""
    text = render_chat_template(NATIVE_TEMPLATE, messages, tools=listed)
    assert "TOOLS:get_weather;search;" in text and '<tool_call>get_weather:{"city": "Oslo"}</tool_call>' in text
    assert "[c1]" in text


def test_the_parser_follows_the_template():
    assert tools.parser_for(SMOL_TEMPLATE) == "hermes"  # no tools section: the fallback's format
    assert tools.parser_for(NATIVE_TEMPLATE) == "hermes"
    assert tools.parser_for(LLAMA_TEMPLATE) == "llama3_json"
    assert tools.parser_for(SMOL_TEMPLATE, "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        tools.parser_for(SMOL_TEMPLATE, "mistral")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_required_and_named_grammars_take_only_declared_calls(fmt):
    tok = ByteTokenizer()
    g = grammar.Grammars(tok, 320, (tok.eos_id,))
    key = "arguments" if fmt == "hermes" else "parameters"

    def written(name, args):
        body = json.dumps({"name": name, key: args}, separators=(",", ":"))
        return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body

    def takes(choice, text):
        ids = tok.encode(text)
        return g.constraint(tools.call_grammar(TOOLS, choice, fmt)).valid_prefix(ids) == len(ids)

    anyone = tools.ToolChoice("required")
    assert takes(anyone, written("get_weather", {"city": "Oslo", "unit": "c"}))
    assert takes(anyone, written("search", {"q": "x"}))
    assert not takes(anyone, written("unknown", {}))
    assert not takes(anyone, written("search", {"q": 3}))  # the schema's types
    assert not takes(anyone, written("search", {"q": "x", "extra": 1}))  # declared arguments only
    assert not takes(anyone, written("get_weather", {"unit": "c"}))  # required fields
    named = tools.ToolChoice("required", "search")
    assert takes(named, written("search", {"q": "x"})) and not takes(named, written("get_weather", {"city": "a"}))
    assert tools.call_grammar(TOOLS, tools.ToolChoice("auto"), fmt) is None


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "user", "content": "and?"}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]},
     "messages[1].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0]"),  # arguments as an object, not a JSON string
])
def test_bad_chat_requests_name_the_field(extra, param):
    with pytest.raises(web.ApiError) as e:
        protocol.parse_chat({**BODY, **extra}, protocol.Limits())
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_agent_histories_parse():
    """What SDKs send on the turn after a tool ran: content null beside tool_calls, a tool message per
    call, content as text parts, developer messages."""
    body = {**BODY, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "r2"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "r1"}]}],
        "logit_bias": {"7": -100, "9": 5.5}}
    p = protocol.parse_chat(body, protocol.Limits())
    assert p.tool_choice == tools.ToolChoice("required", None, False)
    assert p.messages[0]["content"] == "Be brief." and p.messages[4]["content"] == "r1"
    assert p.params[0].logit_bias == ((7, -100.0), (9, 5.5))


def test_strict_json_schema_closes_every_object():
    tok = ByteTokenizer()
    g = grammar.Grammars(tok, 320, (tok.eos_id,))
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "list": {"type": "array", "items": {"type": "object", "properties": {
                                                   "c": {"type": "string"}}}}}}

    def takes(strict, value):
        ids = tok.encode(json.dumps(value, separators=(",", ":")))
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        return g.constraint(tools.response_grammar(rf)).valid_prefix(ids) == len(ids)

    nested_extra = {"a": {"b": 1, "zz": 2}}
    listed_extra = {"list": [{"c": "x", "zz": 1}]}
    assert takes(False, nested_extra) and takes(False, listed_extra)
    assert not takes(True, nested_extra) and not takes(True, listed_extra)
    assert takes(True, {"a": {"b": 1}, "list": [{"c": "x"}]})


def test_llama3_json_takes_only_declared_calls():
    assert tools.parse('{"name": "Ann", "age": 3}', "llama3_json", ["search"]) == ('{"name": "Ann", "age": 3}', [])
    assert tools.parse('{"name": "Ann", "parameters": {}}', "llama3_json", ["search"])[1] == []
    assert _names_args(tools.parse('{"name": "search", "parameters": {"q": "x"}}', "llama3_json", ["search"])[1]) \
        == [("search", {"q": "x"})]


def test_nested_definitions_of_a_tool_are_enforced():
    """A tool whose parameters use $defs (pydantic-made schemas: openai-agents' function tools)."""
    tok = ByteTokenizer()
    g = grammar.Grammars(tok, 320, (tok.eos_id,))
    pet = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fn = {"type": "function", "function": {"name": "adopt", "parameters": {
        "$defs": {"Pet": pet}, "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"]}}}
    constraint = g.constraint(tools.call_grammar([TOOLS[1], fn], tools.ToolChoice("required"), "hermes"))

    def takes(args):
        ids = tok.encode("<tool_call>\n" + json.dumps({"name": "adopt", "arguments": args}, separators=(",", ":"))
                         + "\n</tool_call>")
        return constraint.valid_prefix(ids) == len(ids)
    assert takes({"pet": {"name": "Rex"}}) and not takes({"pet": {"age": 2}})


def test_one_answers_tool_results_render_as_one_message():
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "search", "arguments": "{}"}} for k in (1, 2)]
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c2", "content": "two"}, {"role": "tool", "tool_call_id": "c1",
                                                                          "content": "one"}]
    messages, _ = tools.render_messages(history, TOOLS, SMOL_TEMPLATE)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[3]["content"] == "<tool_response>\ntwo\n</tool_response>\n<tool_response>\none\n</tool_response>"
    assert messages[2]["content"].count('{"name":"search","arguments":{}}') == 2  # compact, as a call is written


@pytest.mark.parametrize("cut", [1, 7, 13])
def test_a_stream_is_read_as_its_events_however_it_is_cut(cut):
    """The server-sent events of a chat stream (what the Messages and Responses APIs translate), cut
    anywhere, a multi-byte character included, the last line without its newline: the same events in
    order, None for [DONE]."""
    events = [{"choices": [{"delta": {"content": "Grüße, 世界"}}]}, {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
    raw = ("".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]").encode()

    async def chunks():
        for k in range(0, len(raw), cut):
            yield raw[k:k + cut]

    async def read():
        return [e async for e in protocol.stream_data(chunks())]
    assert asyncio.run(read()) == events + [None]
