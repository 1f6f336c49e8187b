"""The OpenAPI documents of the instance server (talaria-serve) and the gateway (talaria-route), over
tiny-dense on 127.0.0.1: both serve `/openapi.json` and `/docs` without a key and list every route
with every status it answers; real answers of each route, and bodies the hand parser accepts, are
valid under the documented schemas; and schemathesis fuzzes both servers (a bounded, derandomized
number of examples per operation): no 5xx, every status, content type and body (each event of a
stream) as documented."""
import collections
import copy
import json
import socket
import time

import httpx
import jax
import jinja2
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.instance import Instance, LiveTokens, shapes_of
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve import protocol, schema
from talaria_jax.serve.app import ServedModel, build_app, serve_in_thread, serving
from talaria_jax.serve.gateway import build_gateway
from talaria_jax.serve.instance_engine import InstanceEngine
from talaria_jax.serve.protocol import Limits
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.hardware import load_hardware
from talaria_jax.tokenizer import ByteTokenizer
from talaria_jax.weights import load_model

import jsonschema  # the dev extra's, as schemathesis is: a missing one fails the suite, not skips it
import referencing
import referencing.jsonschema
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, \
    status_code_conformance

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

KEY = "sk-openapi"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = Limits(max_body_bytes=8192, max_tokens=8, max_n=2)  # small answers: each fuzzed request is quick
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, prefix_cache=True,
                      warmup=False)
EXAMPLES = 25  # per operation and generation mode


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a chat template that renders any conversation (tiny-dense has no
    template, and the fuzzer's conversations need not suit a real model's)."""
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{% endfor %}assistant: "

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return jinja2.Template(self.chat_template).render(messages=messages)


@pytest.fixture(scope="module")
def servers():
    """{"serve": url, "route": url}: an instance server as talaria-serve builds one (tiny-dense served
    as "tiny" under the scheduler, with the probe route), and a gateway over it."""
    model = load_model("tiny-dense", make_mesh(jax.devices()[:1])).model
    inst = Instance("i0", {"tiny": model}, load_hardware("cpu"), shapes_of({"tiny": model}, 1), engine_config=CONFIG,
                    tokens=LiveTokens(), kv_bytes_per_device=4 << 20, tokenizers={"tiny": ChatBytes()})
    ie = InstanceEngine(inst, get_policy("talaria"))
    app = build_app([ServedModel("tiny", ie.engine_of("tiny"))], api_keys=[KEY], limits=LIMITS, backend=ie)
    with serving(app) as url:
        gateway = build_gateway([url], api_keys=[KEY], policy=get_policy("talaria"),
                                max_body_bytes=LIMITS.max_body_bytes, probe_interval_s=0.5)
        gurl, server = serve_in_thread(gateway)
        try:
            yield {"serve": url, "route": gurl}
        finally:
            server.should_exit = True
            server.thread.join(timeout=10)


# ---- the documents ---------------------------------------------------------------------------------
ROUTES = {("get", "/health"), ("get", "/v1/models"), ("get", "/metrics"), ("post", "/v1/completions"),
          ("post", "/v1/chat/completions"), ("post", "/v1/messages"), ("post", "/v1/responses"),
          ("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}")}
GENERATION = {"200", "400", "401", "404", "413", "499", "500", "503"}
STATUSES = {"/health": {"200", "500", "503"}, "/v1/models": {"200", "401", "500"}, "/metrics": {"200", "401", "500"},
            "/v1/completions": GENERATION, "/v1/chat/completions": GENERATION, "/v1/messages": GENERATION,
            "/v1/responses": GENERATION, "/v1/responses/{response_id}": {"200", "401", "404", "500"},
            "/talaria/probe": {"200", "400", "401", "404", "413", "500", "503"}}


@pytest.mark.parametrize("name,routes", [("serve", ROUTES | {("post", "/talaria/probe")}), ("route", ROUTES)])
def test_both_apps_publish_every_route_with_every_status(servers, name, routes):
    url = servers[name]
    r = httpx.get(f"{url}/openapi.json")  # no key
    assert r.status_code == 200
    doc = r.json()
    assert doc["info"]["title"] == f"talaria-{name}" and doc["info"]["version"] == schema.VERSION
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == routes
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert set(op["responses"]) == STATUSES[path], (method, path)
            assert ("security" in op) == (path != "/health")
            if path == "/v1/messages":  # Anthropic's clients send x-api-key
                assert op["security"] == [{"bearer": []}, {"x-api-key": []}]
    assert not {"HTTPValidationError", "ValidationError"} & set(doc["components"]["schemas"])  # no 422 anywhere
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert request.get("maximum") == (LIMITS.max_tokens if name == "serve" else None)  # the instance's own limit
    docs = httpx.get(f"{url}/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text and "swagger-ui" in docs.text


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _validator(doc: dict, pointer: str) -> jsonschema.Draft202012Validator:
    """A validator of the schema at `pointer` in `doc` (its references resolved within `doc`)."""
    resource = referencing.jsonschema.DRAFT202012.create_resource(doc)
    registry = referencing.Registry().with_resource("urn:openapi", resource)
    return jsonschema.Draft202012Validator({"$ref": f"urn:openapi#{pointer}"}, registry=registry)


def conforms(doc: dict, method: str, path: str, r: httpx.Response) -> None:
    """Asserts that `r`, an answer to `method path`, is one the document lists: its status, its
    content type, and its body (each event of a stream, which ends with [DONE]) under their schema."""
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(r.status_code) in responses, (method, path, r.status_code, r.text[:300])
    media = r.headers["content-type"].split(";")[0]
    assert media in responses[str(r.status_code)]["content"], (method, path, media)
    at = f"/paths/{_escape(path)}/{method.lower()}/responses/{r.status_code}/content/{_escape(media)}"
    if media == "text/event-stream" and path in ("/v1/messages", "/v1/responses"):  # named events, no [DONE]
        lines = r.text.splitlines()
        names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert len(names) == len(events) and names[-1] in ("message_stop", "response.completed",
                                                           "response.incomplete"), names[-3:]
        event = _validator(doc, at + "/itemSchema/properties/data/contentSchema")
        for name, e in zip(names, events):
            _validator(doc, at + "/itemSchema").validate({"event": name, "data": e})
            event.validate(json.loads(e))
            assert json.loads(e)["type"] == name and name != "error", e
    elif media == "text/event-stream":
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunk = _validator(doc, at + "/itemSchema/properties/data/anyOf/1/contentSchema")
        for e in events[:-1]:
            _validator(doc, at + "/itemSchema").validate({"data": e})
            chunk.validate(json.loads(e))
            assert "error" not in json.loads(e), e
    else:
        _validator(doc, at + "/schema").validate(r.json() if media == "application/json" else r.text)


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
MESSAGE = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSE = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 0}
CALLS = [  # method, path, query, body, headers, status
    ("GET", "/health", {}, None, {}, 200),
    ("GET", "/v1/models", {}, None, AUTH, 200),
    ("GET", "/v1/models", {}, None, {}, 401),
    ("GET", "/metrics", {}, None, AUTH, 200),
    ("GET", "/metrics", {}, None, {"Authorization": "Bearer sk-wrong"}, 401),
    ("POST", "/v1/completions", {}, {**COMPLETION, "n": 2, "logprobs": 2}, AUTH, 200),
    ("POST", "/v1/completions", {}, {**COMPLETION, **STREAM, "logprobs": 0, "stop": ["zz"]}, AUTH, 200),
    ("POST", "/v1/completions", {}, {**COMPLETION, "prompt": [[1, 2, 3]], "seed": 7, "temperature": 1.0}, AUTH, 200),
    ("POST", "/v1/chat/completions", {}, {**CHAT, "logprobs": True, "top_logprobs": 2}, AUTH, 200),
    ("POST", "/v1/chat/completions", {}, {**CHAT, **STREAM, "n": 2, "logprobs": True}, AUTH, 200),
    ("POST", "/v1/completions", {}, {**COMPLETION, "temperature": "hot"}, AUTH, 400),
    ("POST", "/v1/chat/completions", {}, {**CHAT, "messages": []}, {**AUTH, "x-session-id": "s1"}, 400),
    ("POST", "/v1/completions", {}, {**COMPLETION, "prompt": "x" * 9000}, AUTH, 413),
    ("POST", "/v1/chat/completions", {}, {**CHAT, "model": "gpt-9"}, AUTH, 404),
    ("POST", "/v1/chat/completions", {}, CHAT, {}, 401),
    ("POST", "/v1/messages", {}, MESSAGE, {"x-api-key": KEY}, 200),
    ("POST", "/v1/messages", {}, {**MESSAGE, "stream": True, "stop_sequences": ["zz"]}, AUTH, 200),
    ("POST", "/v1/messages", {}, {**MESSAGE, "max_tokens": None}, AUTH, 400),
    ("POST", "/v1/messages", {}, {**MESSAGE, "model": "gpt-9"}, AUTH, 404),
    ("POST", "/v1/messages", {}, MESSAGE, {"x-api-key": "sk-wrong"}, 401),
    ("POST", "/v1/responses", {}, RESPONSE, AUTH, 200),
    ("POST", "/v1/responses", {}, {**RESPONSE, "stream": True, "instructions": "Be brief."}, AUTH, 200),
    ("POST", "/v1/responses", {}, {**RESPONSE, "previous_response_id": "resp_none"}, AUTH, 404),
    ("POST", "/v1/responses", {}, {**RESPONSE, "input": 7}, AUTH, 400),
    ("GET", "/v1/responses/resp_none", {}, None, AUTH, 404),
    ("DELETE", "/v1/responses/resp_none", {}, None, AUTH, 404),
]
PROBES = [
    ("POST", "/talaria/probe", {"kind": "chat"}, CHAT, {**AUTH, "x-session-id": "s1"}, 200),
    ("POST", "/talaria/probe", {}, COMPLETION, AUTH, 200),
    ("POST", "/talaria/probe", {"kind": "text"}, COMPLETION, AUTH, 400),  # FastAPI's 422, answered as 400
    ("POST", "/talaria/probe", {}, {**COMPLETION, "model": "gpt-9"}, AUTH, 404),
]


@pytest.mark.parametrize("name,calls", [("serve", CALLS + PROBES), ("route", CALLS)])
def test_real_answers_of_every_route_are_valid_under_the_document(servers, name, calls):
    url = servers[name]
    doc = httpx.get(f"{url}/openapi.json").json()
    for method, path, query, body, headers, status in calls:
        r = httpx.request(method, f"{url}{path}", params=query, json=body, headers=headers, timeout=120)
        assert r.status_code == status, (method, path, body, r.text[:300])
        conforms(doc, method, "/v1/responses/{response_id}" if path.startswith("/v1/responses/") else path, r)
        if status == 200 and body is not None:  # what the server took is valid under its request schema
            _validator(doc, f"/paths/{_escape(path)}/post/requestBody/content/application~1json/schema").validate(body)
    made = httpx.post(f"{url}/v1/responses", json=RESPONSE, headers=AUTH, timeout=120).json()
    for method in ("GET", "DELETE"):  # a stored response, read and deleted
        r = httpx.request(method, f"{url}/v1/responses/{made['id']}", headers=AUTH)
        assert r.status_code == 200, r.text[:300]
        conforms(doc, method, "/v1/responses/{response_id}", r)
    if name == "serve":  # a parameter FastAPI refuses is OpenAI's error naming it
        bad = httpx.post(f"{url}/talaria/probe", params={"kind": "text"}, json=COMPLETION, headers=AUTH)
        assert bad.json()["error"]["param"] == "kind"


def test_a_gateway_without_instances_answers_as_documented():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gateway = build_gateway([f"http://127.0.0.1:{port}"], api_keys=[KEY], policy=get_policy("talaria"))
    url, server = serve_in_thread(gateway)
    try:
        doc = httpx.get(f"{url}/openapi.json").json()
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["instances_up"] == 0
        conforms(doc, "GET", "/health", health)
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=AUTH)
        assert r.status_code == 404  # no instance lists the model
        conforms(doc, "POST", "/v1/completions", r)
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)


ACCEPTED_COMPLETIONS = [  # bodies the parser takes, at the edges of what it takes
    {"model": "tiny", "prompt": [0]},
    {"model": "tiny", "prompt": ["hi"], "stop": [], "echo": False, "seed": protocol.SEED_LIMIT - 1},
    {"model": "tiny", "prompt": [[1, 2]], "stop": "a", "n": None, "temperature": None, "logprobs": 0, "echo": 0},
    {"model": "", "prompt": "x", "presence_penalty": 0.0, "frequency_penalty": 0, "stream_options": {},
     "session_id": "s" * 256, "user": {"id": 1}, "best_of": 3},
    {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": False}, "max_tokens": 8,
     "top_p": 1, "temperature": 100, "stop": ["a" * 256] * 4},
]
ACCEPTED_CHATS = [
    {"model": "tiny", "messages": [{"role": "user", "content": ""}]},
    {"model": "tiny", "messages": [{"role": "system", "content": "", "name": 5},
                                   {"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c", "function": {"name": "f", "arguments": "{}"}, "x": 2}]},
                                   {"role": "tool", "content": "42", "tool_call_id": "c"},
                                   {"role": "developer", "content": ""}, {"role": "function", "content": "f"}],
     "tools": [{"type": "function", "function": {"name": "f"}},
               {"type": "function", "function": {"name": "g", "description": 3, "parameters": {}}, "x": 1}],
     "max_completion_tokens": 8, "max_tokens": None, "tool_choice": "auto", "response_format": {"type": "text"}},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": "ignored"},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20,
     "tools": None, "stop": None},
]


def test_bodies_the_parser_takes_are_valid_under_the_schema():
    """The schema is no stricter than the hand parser (for an instance with LIMITS)."""
    doc = {"components": {"schemas": schema.components(LIMITS)}}
    for name, parse, bodies in (("CompletionRequest", protocol.parse_completion, ACCEPTED_COMPLETIONS),
                                ("ChatCompletionRequest", protocol.parse_chat, ACCEPTED_CHATS)):
        validator = _validator(doc, f"/components/schemas/{name}")
        for body in bodies:
            parse(copy.deepcopy(body), LIMITS)  # raises ApiError if refused
            validator.validate(body)


# ---- schemathesis ----------------------------------------------------------------------------------
def stream_ends_with_done(ctx, response, case):
    """A 200 event stream ends with `data: [DONE]` and holds no error event (a failure after the
    status went out, which the status checks cannot see)."""
    if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", [""])[0]:
        return None
    events = [line[len("data: "):] for line in response.content.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream ends with {events[-1:]}, not [DONE]"
    errors = [e for e in events[:-1] if "error" in json.loads(e)]
    assert not errors, f"a 200 stream carries error events: {errors}"
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          stream_ends_with_done]


def fuzz(url: str) -> dict:
    """schemathesis over every operation of the document `url` serves: EXAMPLES positive cases (valid
    under the schema) and, where there is a body, EXAMPLES negative ones (invalid somewhere), each sent
    with the API key and checked with CHECKS. The counts, statuses and failures."""
    api = schemathesis.openapi.from_url(f"{url}/openapi.json")

    @api.hook("map_body")
    def served_model(ctx, body):  # a body that names a model names the served one, so valid ones get answered
        return {**body, "model": "tiny"} if isinstance(body, dict) and isinstance(body.get("model"), str) else body

    out = {"operations": 0, "examples": collections.Counter(), "statuses": collections.Counter(), "failures": []}
    for result in api.get_all_operations():
        op = result.ok()
        out["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.body else (GenerationMode.POSITIVE,):
            @given(case=op.as_strategy(generation_mode=mode, headers=AUTH))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=url, timeout=120)
                out["examples"][mode.value] += 1
                out["statuses"][response.status_code] += 1
                try:
                    case.validate_response(response, checks=CHECKS)
                except FailureGroup as e:
                    out["failures"].append(f"{op.label} ({mode.value} case):\n{e}")
            run()
    return out


def test_schemathesis_finds_no_failure_in_either_server(servers, record_property, capsys):
    t0 = time.perf_counter()
    runs = {name: fuzz(servers[name]) for name in ("serve", "route")}
    lines = [f"talaria-{name}: {r['operations']} operations, {sum(r['examples'].values())} examples "
             f"({dict(r['examples'])}), statuses {dict(sorted(r['statuses'].items()))}, {len(r['failures'])} failures"
             for name, r in runs.items()]
    summary = "schemathesis " + "; ".join(lines) + f"; {time.perf_counter() - t0:.1f} s"
    record_property("schemathesis", summary)
    with capsys.disabled():  # shown with -q too
        print(f"\n{summary}")
    failures = [f for r in runs.values() for f in r["failures"]]
    assert not failures, summary + "\n\n" + "\n\n".join(failures)
    for name, r in runs.items():  # the fuzzing reached the engine: some answers of every kind
        assert r["statuses"][200] and r["statuses"][400], (name, summary)
