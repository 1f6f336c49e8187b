"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) as a
translation of chat completions.

A Responses request becomes a chat completions request (`Translated`), served by the same path as
any chat call (templates, tool calls and their grammars, sessions, the router's failover), and its
answer is translated back (`answer`: a whole response, or the Responses stream events from the chat
stream's chunks). The instance server and the gateway both use it, each with its own `Store` of the
responses it answered, so `previous_response_id` works at whichever front door the client uses.

Served: `input` (a string, or message, `function_call` and `function_call_output` items; reasoning
items are dropped), `instructions`, function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema: the chat path's grammars), `max_output_tokens`,
`temperature`, `top_p`, `stream`, `store` (default true; false keeps nothing), `previous_response_id`
(the stored response's whole history comes before `input`; its instructions do not),
`conversation` (its items kept by the server, per tenant: each call continues it), `prompt_cache_key`,
`metadata`. A call's session, unless the request names one
(`session_id`, `x-session-id`): its `prompt_cache_key`, else the session of its
`previous_response_id` (a response chain is a session), else its `conversation`, else inferred from
its prompt. Errors are OpenAI's body; an unknown or expired `previous_response_id` is a 404.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from talaria_jax.serve.protocol import stream_data
from talaria_jax.web import ApiError

__all__ = ["Store", "Translated", "answer", "translate"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message[:300], param, code)


@dataclasses.dataclass
class _Stored:
    tenant: str
    at: float
    items: list[dict]  # the whole conversation, this response's output included (as input items)
    session: str | None
    body: dict | None  # the response as answered (None: a conversation's items)
    size: int = 0  # bytes counted against the store's bound


class Store:
    """What a server keeps of the Responses API's calls: the responses answered with `store` on (for
    `previous_response_id`, `GET` and `DELETE`) and each `conversation`'s items. At most `max_count`
    entries and about `max_bytes` of them (their JSON; the oldest go first), each for `ttl_s` seconds
    after it was written, visible only to the tenant that wrote it."""

    def __init__(self, max_count: int = 10_000, ttl_s: float = 3600.0, max_bytes: int = 1 << 30):
        if max_count < 0 or ttl_s <= 0 or max_bytes < 0:
            raise ValueError(f"responses.Store: max_count ({max_count}) and max_bytes ({max_bytes}) must be >= 0 "
                             f"and ttl_s ({ttl_s}) > 0")
        self.max_count, self.ttl_s, self.max_bytes = max_count, ttl_s, max_bytes
        self._items: collections.OrderedDict[str, _Stored] = collections.OrderedDict()
        self._mu = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, stored: _Stored, new_items: list[dict]) -> None:
        """Keeps `stored` under `key` (a response id, or a conversation's `conversation_key`);
        `new_items`, what it adds to the conversation it continues, and its body are what it counts."""
        stored.size = len(json.dumps(new_items)) + (len(json.dumps(stored.body)) if stored.body is not None else 0)
        with self._mu:
            old = self._items.pop(key, None)
            if old is not None:  # a conversation goes on: it holds what it held and what this call adds
                stored.size += old.size
                self.bytes -= old.size
            self.bytes += stored.size
            self._items[key] = stored
            while self._items and (len(self._items) > self.max_count or self.bytes > self.max_bytes):
                self.bytes -= self._items.popitem(last=False)[1].size

    def get(self, key: str, tenant: str, param: str | None = None) -> _Stored | None:
        """What `tenant` stored under `key`; a response that is not there is ApiError 404 (OpenAI's),
        a conversation that is not there None."""
        with self._mu:
            s = self._items.get(key)
            if s is not None and time.monotonic() - s.at > self.ttl_s:
                self.bytes -= self._items.pop(key).size
                s = None
        if s is None or s.tenant != tenant:
            if key.startswith(_CONVERSATION):
                return None
            raise ApiError(404, f"Response with id '{key}' not found.", param,
                           "previous_response_not_found" if param else "not_found")
        return s

    def delete(self, rid: str, tenant: str) -> dict:
        self.get(rid, tenant)
        with self._mu:
            s = self._items.pop(rid, None)
            self.bytes -= s.size if s is not None else 0
        return {"id": rid, "object": "response", "deleted": True}


_CONVERSATION = "conversation\0"


def conversation_key(conversation: str, tenant: str) -> str:
    return f"{_CONVERSATION}{tenant}\0{conversation}"


# ---- requests ------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or a list of content parts", where, "invalid_type")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _bad(f"'{where}[{i}]': only text parts are served (input_text, output_text), got {kind!r}",
                       f"{where}[{i}]", "unsupported")
        out.append(part["text"])
    return "".join(out)


def _items(value: Any) -> list[dict]:
    """`input` as a list of items, checked."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of items", "input", "invalid_type")
    items = []
    for i, it in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad(f"'{where}' must be an object", where, "invalid_type")
        kind = it.get("type", "message")
        if kind == "message":
            if it.get("role") not in ("user", "assistant", "system", "developer"):
                raise _bad(f"'{where}.role' must be user, assistant, system or developer", f"{where}.role")
            items.append({"type": "message", "role": it["role"], "content": _text(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(it.get(f), str) for f in ("call_id", "name", "arguments")):
                raise _bad(f"'{where}': a function_call needs string 'call_id', 'name' and 'arguments'", where)
            items.append({"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                          "arguments": it["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(f"'{where}.call_id' must be a string", f"{where}.call_id")
            items.append({"type": "function_call_output", "call_id": it["call_id"],
                          "output": _text(it.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # no reasoning is served; a client may send back what another model gave it
        else:
            raise _bad(f"'{where}.type' {kind!r} is not served (message, function_call, function_call_output)",
                       f"{where}.type", "unsupported")
    return items


def _messages(items: list[dict]) -> list[dict]:
    """Chat messages of items: an assistant's text and the function calls after it make one message."""
    out: list[dict] = []
    for it in items:
        if it["type"] == "message":
            out.append({"role": it["role"], "content": it["content"]})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # its text, or its calls so far
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def _tools(body: dict) -> dict:
    tools = body.get("tools")
    if tools is None or tools == []:
        return {"tool_choice": body["tool_choice"]} if body.get("tool_choice") not in (None, "auto", "none") else {}
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"'tools[{i}]': only function tools are served, with a string 'name' (got type {kind!r})",
                       f"tools[{i}]", "unsupported")
        described = {"description": t["description"]} if isinstance(t.get("description"), str) else {}
        out.append({"type": "function", "function": {"name": t["name"], **described,
                                                     "parameters": t.get("parameters") or {}}})
    chat: dict[str, Any] = {"tools": out}
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    elif tc is not None:
        chat["tool_choice"] = tc
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def _format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text.format.type")


@dataclasses.dataclass
class Translated:
    """A Responses request as the chat path serves it: the chat body, the session it names (with how it
    was identified) if any, and what the answer needs."""
    chat: dict
    session: tuple[str, str] | None
    request: dict  # the Responses request (for the answer's echo of its parameters)
    items: list[dict]  # the conversation before the answer, as input items
    known: int  # how many of them were stored (a previous response's or the conversation's)
    previous: str | None
    conversation: str | None


def translate(body: Any, store: Store, tenant: str) -> Translated:
    """ApiError 400 naming the field at fault; 404 for an unknown `previous_response_id`."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_body")
    if body.get("input") is None:
        raise ApiError(400, "'input' is required", "input", "missing_required_parameter")
    items = _items(body["input"])
    previous, session, history = body.get("previous_response_id"), None, []
    if previous is not None:
        if not isinstance(previous, str):
            raise _bad("'previous_response_id' must be a string", "previous_response_id", "invalid_type")
        stored = store.get(previous, tenant, "previous_response_id")
        history = stored.items
        session = (stored.session or previous, "chain")
    conv = body.get("conversation")
    conv = conv.get("id") if isinstance(conv, dict) else conv
    if conv is not None:
        if not isinstance(conv, str) or not 0 < len(conv) <= 256:
            raise _bad("'conversation' must be a string id (or {'id': ...}) of 1 to 256 characters", "conversation")
        if previous is not None:
            raise _bad("'conversation' and 'previous_response_id' cannot be given together", "conversation")
        kept = store.get(conversation_key(conv, tenant), tenant)
        history = kept.items if kept is not None else []  # the conversation so far
        session = (kept.session if kept is not None and kept.session else conv, "conversation")
    items = history + items
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            raise _bad("'prompt_cache_key' must be a string of 1 to 256 characters", "prompt_cache_key")
        session = (key, "prompt_cache_key")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions", "invalid_type")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(items)
    if not messages:
        raise _bad("'input' is empty", "input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for f in ("temperature", "top_p", "stream", "session_id", "seed"):
        if body.get(f) is not None:
            chat[f] = body[f]
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    chat |= _tools(body) | _format(body)
    return Translated(chat, session, body, items, len(history), previous, conv)


# ---- answers -------------------------------------------------------------------------------------
def _usage(u: dict | None) -> dict:
    u = u or {}
    return {"input_tokens": u.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": u.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.get("prompt_tokens", 0) + u.get("completion_tokens", 0)}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class _Answering:
    """One response being answered: its id, its body once whole, and what is stored of it."""

    def __init__(self, t: Translated, model: str, store: Store, tenant: str, session: str | None):
        self.t, self.model, self.store, self.tenant, self.session = t, model, store, tenant, session
        self.id, self.created = _id("resp"), int(time.time())

    def body(self, status: str, output: list[dict], usage: dict | None, incomplete: bool = False) -> dict:
        r = self.t.request
        chat = self.t.chat
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": chat.get("parallel_tool_calls", True),
                "previous_response_id": self.t.previous, "temperature": chat.get("temperature", 1.0),
                "top_p": chat.get("top_p", 1.0), "tool_choice": r.get("tool_choice", "auto"),
                "tools": r.get("tools") or [], "text": r.get("text") or {"format": {"type": "text"}},
                "truncation": "disabled", "store": r.get("store", True) is not False,
                "metadata": r.get("metadata") or {}, "usage": usage, "user": r.get("user")}

    def done(self, output: list[dict], usage: dict, incomplete: bool) -> dict:
        body = self.body("incomplete" if incomplete else "completed", output, usage, incomplete)
        kept = [{"type": "message", "role": "assistant", "content": "".join(c["text"] for c in it["content"])}
                if it["type"] == "message" else
                {"type": "function_call", "call_id": it["call_id"], "name": it["name"], "arguments": it["arguments"]}
                for it in output]
        new = self.t.items[self.t.known:] + kept  # what this call adds to its conversation
        items, now = self.t.items + kept, time.monotonic()
        if self.t.conversation is not None:  # the conversation goes on with this answer (stored or not)
            self.store.put(conversation_key(self.t.conversation, self.tenant),
                           _Stored(self.tenant, now, items, self.session, None), new)
        if self.t.request.get("store", True) is not False:
            self.store.put(self.id, _Stored(self.tenant, now, items, self.session, body), new)
        return body


def answer(chat_answer: Response, t: Translated, store: Store, tenant: str) -> Response:
    """A chat route's answer (a JSON body or an SSE stream) as the Responses API's, stored (unless
    `store: false`) once whole; the session and request-id headers kept."""
    session = chat_answer.headers.get("x-talaria-session")
    named = {k: v for k, v in chat_answer.headers.items() if k in ("x-talaria-session", "x-request-id")}
    a = _Answering(t, t.chat.get("model"), store, tenant, session)
    if isinstance(chat_answer, StreamingResponse):
        chat_answer.body_iterator = _events(chat_answer.body_iterator, a)
        return chat_answer
    chat = json.loads(chat_answer.body)
    ch = chat["choices"][0]
    msg = ch["message"]
    output = ([_message_item(msg["content"])] if msg.get("content") else [])
    output += [_call_item(c) for c in msg.get("tool_calls") or []]
    body = a.done(output, _usage(chat.get("usage")), ch.get("finish_reason") == "length")
    return JSONResponse(body, status_code=chat_answer.status_code, headers=named)


async def _events(chunks: AsyncIterator[str], a: _Answering) -> AsyncIterator[str]:
    """The Responses stream events of a chat stream's SSE lines (one choice, usage included)."""
    seq = iter(range(1 << 62))

    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data, 'sequence_number': next(seq)})}\n\n"
    yield event("response.created", response=a.body("in_progress", [], None))
    yield event("response.in_progress", response=a.body("in_progress", [], None))
    output: list[dict] = []
    text: list[str] = []
    msg: dict | None = None  # the open message item
    usage, finish = None, None

    def close_text() -> list[str]:
        nonlocal msg
        if msg is None:
            return []
        whole = "".join(text)
        part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
        msg["content"], msg["status"] = [part], "completed"
        k, mid = len(output) - 1, msg["id"]
        msg = None
        return [event("response.output_text.done", item_id=mid, output_index=k, content_index=0, text=whole,
                      logprobs=[]),
                event("response.content_part.done", item_id=mid, output_index=k, content_index=0, part=part),
                event("response.output_item.done", output_index=k, item=output[k])]

    async for data in stream_data(chunks):
        if data is None:
            for e in close_text():
                yield e
            incomplete = finish == "length"
            body = a.done(output, _usage(usage), incomplete)
            yield event("response.incomplete" if incomplete else "response.completed", response=body)
            return
        if "error" in data:
            e = data["error"]
            yield event("error", code=e.get("code"), message=e.get("message", "the server failed"),
                        param=e.get("param"))
            return
        usage = data.get("usage") or usage
        for ch in data.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content"):
                if msg is None:
                    msg = _message_item("", "in_progress")
                    output.append(msg)
                    yield event("response.output_item.added", output_index=len(output) - 1, item=msg)
                    yield event("response.content_part.added", item_id=msg["id"], output_index=len(output) - 1,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})
                text.append(delta["content"])
                yield event("response.output_text.delta", item_id=msg["id"], output_index=len(output) - 1,
                            content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                for e in close_text():
                    yield e
                item = _call_item(call, "in_progress")
                args, item["arguments"] = item["arguments"], ""
                output.append(item)
                k = len(output) - 1
                yield event("response.output_item.added", output_index=k, item=dict(item))
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=args)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            arguments=args, name=item["name"])
                item["arguments"], item["status"] = args, "completed"
                yield event("response.output_item.done", output_index=k, item=item)
            finish = ch.get("finish_reason") or finish

