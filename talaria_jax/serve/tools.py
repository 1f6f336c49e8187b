"""Tool calling in chat completions, as OpenAI's API has it: the request's tools and its tool-call
history rendered for the model's chat template, and the model's output parsed back into tool calls,
whole or as a stream.

Formats (`--tool_call_parser`; `auto` reads the chat template):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5/3, Hermes, and
  the fallback below);
- `llama3_json`: the output is one JSON object `{"name": ..., "parameters": {...}}` (or several, `;`
  between them), optionally after `<|python_tag|>` (Llama 3.1-3.3).

A template that never reads `tools` (SmolLM2's) gets them in the fallback format: a system message
that lists the tools as JSON and asks for hermes blocks, assistant tool calls written as those blocks,
and tool results as user messages in `<tool_response>` tags. Every model can then call tools.
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from talaria_jax.engine import grammar

FORMATS = ("hermes", "llama3_json")
PARSERS = ("auto", *FORMATS)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

FALLBACK_SYSTEM = """# Tools

You may call one or more functions to help with the user's request. The functions you can call are
listed as JSON within <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments within
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def native_tools(template: str | None) -> bool:
    """Whether the chat template renders `tools` itself."""
    return template is not None and re.search(r"\btools\b", template) is not None


def parser_for(template: str | None, flag: str = "auto") -> str:
    """The tool-call format of a model: `flag`, or for `auto` the one its chat template writes (hermes
    when the template shows none: the fallback asks for it)."""
    if flag != "auto":
        if flag not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {flag!r}")
        return flag
    t = template or ""
    if HERMES_OPEN in t or not native_tools(t):
        return "hermes"
    if PYTHON_TAG in t or "ipython" in t or '"parameters"' in t:
        return "llama3_json"
    return "hermes"


# ---- rendering ---------------------------------------------------------------------------------
def _arguments(call: Mapping) -> Any:
    """A history tool call's arguments as the template wants them: the object its JSON string holds
    (templates write `arguments | tojson` or read its keys)."""
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def render_messages(messages: Sequence[Mapping], tools: Sequence[Mapping] | None, template: str | None
                    ) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to give the chat template. A template with a tools section gets them as
    they are (tool-call arguments as objects, a null content as ""); another gets the fallback format."""
    if native_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("content") is None:
                m["content"] = ""
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, (list(tools) if tools else None)
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return [dict(m) for m in messages], None
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            # written as a constrained call writes it (compact JSON), so the next turn's prompt repeats the
            # tokens the session's KV holds
            blocks = [f"{HERMES_OPEN}\n{_compact({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                      f"\n{HERMES_CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":  # one user message for the results of one answer's calls
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        listed = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{listed}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out, None


# ---- parsing -----------------------------------------------------------------------------------
def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call(name: Any, arguments: Any, names: Sequence[str] | None = None) -> dict | None:
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (dict, str)):
        return None
    if isinstance(arguments, str):  # some models write the JSON string OpenAI sends
        try:
            json.loads(arguments)
        except ValueError:
            return None
    text = arguments if isinstance(arguments, str) else _compact(arguments)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": text}}


def _hermes(text: str, cut: bool) -> tuple[str, list[dict]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls, i = [], start
    while i >= 0:  # text between and after the blocks is left out of the content
        body_start = i + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:end if end >= 0 else len(text)].strip()
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is None and cut and end < 0:  # the output stopped inside this call: the others stand
            break
        if call is None:
            return text, []  # not a call this parser can read: the text stays the content
        calls.append(call)
        if end < 0:
            break
        i = text.find(HERMES_OPEN, end + len(HERMES_CLOSE))
    return text[:start], calls


def _llama3_json(text: str, names: Sequence[str] | None, cut: bool) -> tuple[str, list[dict]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            if cut and calls:  # the output stopped inside a later call: the complete ones stand
                break
            return text, []
        # a call names a declared function and brings its arguments: other JSON is an answer, not a call
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        call = _call(obj.get("name"), args, names) if args is not None else None
        if call is None:
            return text, []
        calls.append(call)
        rest = body[i:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        i = len(body) - len(rest) + 1
        while i < len(body) and body[i].isspace():
            i += 1
    return "", calls


def parse(text: str, fmt: str, names: Sequence[str] | None = None, cut: bool = False) -> tuple[str, list[dict]]:
    """The content and the tool calls of a model's whole output (no calls: the text, as it was; with
    calls, the text before them, which may be only whitespace). `names`: the declared functions
    (llama3_json reads only calls of those: other JSON is an answer). `cut`: the output ended at its
    token limit, so a last call it could not finish is left out, of the calls and of the content, and
    the complete calls before it are returned. A hermes call is known by its tag even when cut, so a
    cut first call leaves the text before it; a cut llama3_json output with no complete call may be
    a JSON answer, and stays the content."""
    return _hermes(text, cut) if fmt == "hermes" else _llama3_json(text, names, cut)


class ToolStream:
    """The content deltas of a streamed output while it may still turn into tool calls: text streams
    until a call may be starting (`<tool_call>`; for llama3_json, an output that opens with `{` or
    `<|python_tag|>`), then waits for the end, where `finish` parses the whole. Trailing whitespace is
    held until more text follows, so the deltas add up to the content `parse` gives. Each feed costs
    time in its delta and the few characters held back."""

    def __init__(self, fmt: str, names: Sequence[str] | None = None):
        self.fmt, self.names = fmt, names
        self._parts: list[str] = []  # the whole output (joined at the end)
        self._pending = ""  # its end not sent yet, while nothing is held: whitespace, a marker's start
        self.sent = 0  # characters sent as content
        self.held = False  # a call may be under way: nothing more is sent until the end

    def feed(self, delta: str) -> str:
        if not delta:
            return ""
        self._parts.append(delta)
        if self.held:
            return ""
        pending = self._pending + delta
        end = len(pending)
        if self.fmt == "hermes":
            k = pending.find(HERMES_OPEN)
            if k >= 0:
                self.held, end = True, k
            else:  # a marker may be completing at the end
                for n in range(min(len(HERMES_OPEN) - 1, len(pending)), 0, -1):
                    if HERMES_OPEN.startswith(pending[-n:]):
                        end -= n
                        break
        elif self.sent == 0:
            head = pending.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.held = True
                return ""
            if PYTHON_TAG.startswith(head):  # nothing but whitespace yet, or the tag may be completing
                self._pending = pending
                return ""
        end = len(pending[:end].rstrip())
        out, self._pending = pending[:end], pending[end:]
        self.sent += end
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """At the end: the content not sent yet and the tool calls (`cut`: as `parse`)."""
        content, calls = parse("".join(self._parts), self.fmt, self.names, cut)
        rest = content[self.sent:] if content.strip() or not calls else ""
        self.sent = len(content)
        return rest, calls


def message_content(content: str, calls: list[dict]) -> str | None:
    """A message's content beside its tool calls: None when there is no text besides them."""
    return content if content.strip() or not calls else None


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """The request's tool choice: `mode` none, auto or required (a named function is required with
    `name`), and whether several calls may come in one answer."""
    mode: str
    name: str | None = None
    parallel: bool = True


def delta_calls(calls: list[dict]) -> list[dict]:
    """Tool calls as a stream chunk's delta carries them (each with its index)."""
    return [{"index": i, **c} for i, c in enumerate(calls)]


# ---- constrained calls -------------------------------------------------------------------------
COMPACT = {"whitespace_flexible": False, "coerce_one_of": True}  # llguidance's JSON options: no free whitespace


def call_grammar(tools: Sequence[Mapping], choice: ToolChoice, fmt: str) -> str | None:
    """The grammar of an answer that is only tool calls (tool_choice required, or a named function):
    one call (several with parallel_tool_calls) of a declared function, its arguments valid under
    the function's parameters schema, in the model's format. None for none and auto."""
    if choice.mode != "required":
        return None
    key = "arguments" if fmt == "hermes" else "parameters"
    one_of, defs = [], {}
    for i, t in enumerate(tools):
        if choice.name is None or t["function"]["name"] == choice.name:
            params = _hoisted(_declared(t["function"]), f"f{i}_", defs)
            one_of.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                           "properties": {"name": {"const": t["function"]["name"]}, key: params}})
    call = json.dumps({"oneOf": one_of, "x-guidance": COMPACT, **({"$defs": defs} if defs else {})})
    more = '("\\n" call)*' if choice.parallel else ""
    sep = '(";" call)*' if choice.parallel else ""
    if fmt == "hermes":
        return grammar.lark(f'start: call {more}\ncall: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
                            f'body: %json {call}')
    return grammar.lark(f"start: call {sep}\ncall: %json {call}")


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` to nest in a larger one: its `$defs` (and `definitions`) moved into `defs` under
    `prefix`, and its local references rewritten to them (nested, `#/$defs/X` would point nowhere)."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema

    def moved(x):
        if isinstance(x, list):
            return [moved(v) for v in x]
        if not isinstance(x, dict):
            return x
        out = {k: moved(v) for k, v in x.items() if k not in ("$defs", "definitions")}
        ref = x.get("$ref")
        if isinstance(ref, str):
            for root in ("#/$defs/", "#/definitions/"):
                if ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
        return out

    defs.update({prefix + name: moved(sub) for name, sub in own.items()})
    return moved(schema)


def _declared(fn: Mapping) -> dict:
    """A function's parameters schema, its arguments limited to the declared ones unless it says
    otherwise (a function takes what it declares; OpenAI's strict mode requires the same)."""
    params = dict(fn.get("parameters") or {"type": "object"})
    if params.get("type") == "object" and "properties" in params:
        params.setdefault("additionalProperties", False)
    return params


def response_grammar(response_format: Mapping | None) -> str | None:
    """The grammar of `response_format`: one JSON object (json_object) or JSON valid under the schema
    (json_schema); None for text."""
    if not response_format:
        return None
    if response_format["type"] == "json_object":
        return grammar.any_json()
    js = response_format["json_schema"]
    schema = js.get("schema") or {"type": "object"}
    return grammar.json_schema(_closed(schema) if js.get("strict") else schema)


def _closed(schema: Any) -> Any:
    """OpenAI's strict mode: every object with listed properties takes only those (additionalProperties
    false where the schema does not say), through nested schemas."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    nested = ("items", "anyOf", "oneOf", "allOf", "prefixItems")
    out = {k: (_closed(v) if k in nested else v) for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: _closed(sub) for name, sub in schema[k].items()}
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out
