"""Anthropic's Messages API (`POST /v1/messages`) as a translation of chat completions.

A Messages request becomes a chat completions request (`to_chat`), served by the same path as any
chat call (templates, tool calls and their grammars, sessions, the router's failover), and its
answer is translated back: a whole message (`from_chat`) or Anthropic's stream events
(`stream_events`, from the chat stream's chunks). The instance server and the gateway both use it,
so they answer alike.

Served: `system` (a string or text blocks), text / `tool_use` / `tool_result` blocks, `tools` and
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `stop_sequences`, `temperature`,
`top_p`, `top_k`, `metadata.user_id` (a Claude-Code-style id that ends in `_session_<id>` names
the session), `stream`. Thinking blocks in the history are dropped and `thinking` is ignored (no
reasoning budget is served); images and documents are refused by name. Errors are Anthropic's
body, `{"type": "error", "error": {"type", "message"}}`.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from talaria_jax.serve.protocol import stream_data
from talaria_jax.web import ApiError

__all__ = ["answer", "error_body", "from_chat", "stream_events", "to_chat"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}
_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,128})$")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error" if status >= 500
                                                                  else "invalid_request_error"),
                                       "message": message}}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message[:300], param, "invalid_value")


def _text_of(blocks: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"'{where}' must be a string or a list of content blocks", where)
    out = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed:
            raise _bad(f"'{where}[{i}]': a block of type {kind!r} is not supported here (text only)", f"{where}[{i}]")
        if not isinstance(b.get("text"), str):
            raise _bad(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
        out.append(b["text"])
    return "".join(out)


def _message(i: int, m: Any) -> list[dict]:
    """One Messages message as chat messages (a user message's tool results come first, as tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"'{where}' must be an object with 'role' user or assistant", f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise _bad(f"'{where}.content' must be a string or a list of content blocks", f"{where}.content")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
                raise _bad(f"'{at}': a tool_use block needs a string 'id' and 'name' and an object 'input'", at)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind == "tool_result" and m["role"] == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"'{at}.tool_use_id' must be a string", f"{at}.tool_use_id")
            body = _text_of(b.get("content", ""), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {body}" if b.get("is_error") else body})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise _bad(f"'{at}': a block of type {kind!r} is not supported in a {m['role']} message "
                       "(text, tool_use from the assistant, tool_result from the user)", at)
    if m["role"] == "assistant":
        return [{"role": "assistant", "content": "".join(text) or None, "tool_calls": calls}] if calls else \
            [{"role": "assistant", "content": "".join(text)}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def to_chat(body: Any) -> dict:
    """A chat completions request equivalent to the Messages request `body`; ApiError 400 naming the
    field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_body")
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required", "max_tokens", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages", "missing_required_parameter")
    chat: list[dict] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(messages):
        chat += _message(i, m)
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat, "max_tokens": body["max_tokens"]}
    for f in ("temperature", "top_p", "top_k", "stream"):
        if body.get(f) is not None:
            out[f] = body[f]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    if out.get("stream") is True:
        out["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list of tools", "tools")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("input_schema"), dict)):
                raise _bad(f"'tools[{i}]' must be a custom tool with a string 'name' and an object 'input_schema' "
                           f"(server tools are not served)", f"tools[{i}]")
            described = {"description": t["description"]} if isinstance(t.get("description"), str) else {}
            out["tools"].append({"type": "function", "function": {"name": t["name"], **described,
                                                                  "parameters": t["input_schema"]}})
        out.update(_tool_choice(body.get("tool_choice")))
    elif body.get("tool_choice") is not None:
        raise _bad("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    meta = body.get("metadata")
    if meta is not None:
        user = meta.get("user_id") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or not (user is None or isinstance(user, str) and len(user) <= 256):
            raise _bad("'metadata' must be an object whose 'user_id' is a string of at most 256 characters",
                       "metadata.user_id")
        named = _SESSION.search(user or "")
        if named:
            out["prompt_cache_key"] = named.group(1)
    return out


def _tool_choice(tc: Any) -> dict:
    if tc is None:
        return {}
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise _bad("'tool_choice.name' must name a tool", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    if tc.get("disable_parallel_tool_use") is True and kind != "none":
        out["parallel_tool_calls"] = False
    return out


def _stop_reason(choice: dict) -> tuple[str, str | None]:
    if choice.get("stop_reason") is not None:
        return "stop_sequence", choice["stop_reason"]
    return _STOP.get(choice.get("finish_reason"), "end_turn"), None


def _usage(u: dict | None) -> dict:
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


def from_chat(chat: dict) -> dict:
    """The Messages answer of a chat completion."""
    ch = chat["choices"][0]
    msg = ch["message"]
    content = ([{"type": "text", "text": msg["content"]}] if msg.get("content") else [])
    content += [_tool_use(c) for c in msg.get("tool_calls") or []]
    reason, sequence = _stop_reason(ch)
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(chat.get("usage"))}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def stream_events(chunks: AsyncIterator[str], model: str) -> AsyncIterator[str]:
    """Anthropic's stream events from a chat stream's SSE lines (one choice, usage included):
    message_start, each content block's start, deltas and stop, message_delta with the stop reason and
    the usage, message_stop; an error event if the chat stream ends with an error."""
    yield _event("message_start", {"message": {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message",
                                               "role": "assistant", "model": model, "content": [],
                                               "stop_reason": None, "stop_sequence": None,
                                               "usage": _usage(None)}})
    block, text_open, stop, usage = 0, False, ("end_turn", None), None
    async for data in stream_data(chunks):
        if data is None:
            if text_open:
                yield _event("content_block_stop", {"index": block})
            yield _event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                           "usage": _usage(usage)})
            yield _event("message_stop", {})
            return
        if "error" in data:
            e = data["error"]
            yield _event("error", {"error": error_body(503 if e.get("type") == "service_unavailable" else 500,
                                                       e.get("message", "the server failed"))["error"]})
            return
        usage = data.get("usage") or usage
        for ch in data.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content"):
                if not text_open:
                    yield _event("content_block_start", {"index": block, "content_block": {"type": "text",
                                                                                            "text": ""}})
                    text_open = True
                yield _event("content_block_delta", {"index": block, "delta": {"type": "text_delta",
                                                                                "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                if text_open:
                    yield _event("content_block_stop", {"index": block})
                    block, text_open = block + 1, False
                use = _tool_use(call)
                yield _event("content_block_start", {"index": block, "content_block": {**use, "input": {}}})
                yield _event("content_block_delta", {"index": block, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
                yield _event("content_block_stop", {"index": block})
                block += 1
            if ch.get("finish_reason"):
                stop = _stop_reason(ch)


def answer(chat_answer: Response, model: str) -> Response:
    """A chat route's answer (a JSON body or an SSE stream) as the Messages API's, its headers kept."""
    if isinstance(chat_answer, StreamingResponse):
        chat_answer.body_iterator = stream_events(chat_answer.body_iterator, model)
        return chat_answer
    named = {k: v for k, v in chat_answer.headers.items() if k in ("x-talaria-session", "x-request-id")}
    return JSONResponse(from_chat(json.loads(chat_answer.body)), status_code=chat_answer.status_code, headers=named)
