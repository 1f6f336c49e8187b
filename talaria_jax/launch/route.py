"""talaria-route: the router gateway, one OpenAI-compatible endpoint over many instance servers.

  talaria-route --instances=http://10.0.0.1:8000,http://10.0.0.2:8000 --api_key=sk-...   # remote
  talaria-route --local_instances=2 --api_key=sk-local                                 # on this machine

Remote instances are `talaria-serve` processes (one per TP group; give them the same --api_key).
`--local_instances=N` starts N `talaria-serve` processes on 127.0.0.1 (`launch/local_servers.py`),
each on its own split of the local devices and hosting every model of --model, waits until they
answer, and routes over them the same way; they stop with the gateway. Calls are
placed by --policy's router and served by its multiplexer on each instance. Defaults run on one CPU
machine with no downloads (the embedded SmolLM2-135M-Instruct).
"""
from __future__ import annotations

import os
import secrets
import signal
import sys

import uvicorn
from absl import app, flags, logging

_INSTANCES = flags.DEFINE_list("instances", None, "Base URLs of instance servers (talaria-serve), comma-separated.")
_LOCAL = flags.DEFINE_integer("local_instances", 0, "Start this many talaria-serve processes on this machine instead.",
                              lower_bound=0)
_MODEL = flags.DEFINE_list("model", ["smollm2-135m-instruct"], "Local instances: the models each one hosts.")
_TP = flags.DEFINE_integer("tp", None, "Local instances: devices each (default: 1 on CPU, else the devices split "
                           "evenly).",
                           lower_bound=1)
_POLICY = flags.DEFINE_string("policy", "talaria", "Scheduling policy: talaria, round, load, sticky, composite, ... "
                              "(a numeric field changed: 'talaria[patience=0.5]').")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (127.0.0.1: this machine only).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
_KEY = flags.DEFINE_string("api_key", None, "Comma-separated API keys (each a tenant; the instances must take them "
                           "too); default $TALARIA_API_KEY, else one is made up and printed.")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body (bytes; larger: 413).",
                                 lower_bound=1024)
_PROBE = flags.DEFINE_float("probe_interval_s", 1.0, "Seconds between health checks of each instance.",
                            lower_bound=0.05)
_FAIL_AFTER = flags.DEFINE_integer("fail_after", 2, "Health checks missed in a row before an instance is taken out "
                                   "(a refused connection takes it out at once).", lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Local instances: context limit (tokens).", lower_bound=16)
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 16, "Local instances: requests decoding at once.", lower_bound=1)
_KV_MB = flags.DEFINE_integer("kv_mib_per_device", None, "Local instances: KV arena per device in MiB.", lower_bound=1)
_SPECULATE = flags.DEFINE_integer("speculate", 0, "Local instances: suffix-tree speculative decoding: draft tokens per request "
                                  "and step at most (0: off). Drafts come from the request's own text and its tenant's "
                                  "earlier and in-flight responses; how many a step verifies follows the step cost "
                                  "measured at start.", lower_bound=0, upper_bound=31)
_TOOL_PARSER = flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "hermes", "llama3_json"],
                                 "Local instances: how the models write tool calls (see talaria-serve).")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "Local instances: a Jinja chat template file for every "
                                     "model in place of its tokenizer's (see talaria-serve).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Local instances: compile every step shape before serving.")
_HOST_KV = flags.DEFINE_string("host_kv_bytes", "auto", "Local instances: host memory for session KV copies, per "
                               "instance: a size (8G, 512M, bytes; 0: none), 'auto' (20% of the host memory available "
                               "at start, split over the instances) or 'unbounded'.")
_INFERRED = flags.DEFINE_integer("inferred_calls", 65_536, "Calls kept to infer the sessions of calls that name "
                                 "none (no session_id, x-session-id or prompt_cache_key) from their prompts' token "
                                 "ids; the least recently used are forgotten past it. 0: no inference.", lower_bound=0)
_RESPONSES = flags.DEFINE_integer("responses_stored", 10_000, "Responses (of POST /v1/responses with store: true) "
                                  "kept for previous_response_id, GET and DELETE; the oldest go first.", lower_bound=0)
_RESPONSES_TTL = flags.DEFINE_float("responses_ttl_s", 3600.0, "Seconds a stored response is kept.", lower_bound=1.0)
_MAX_SESSIONS = flags.DEFINE_integer("max_sessions", 10_000, "Local instances: sessions each keeps at most.",
                                     lower_bound=1)
_SESSION_TTL = flags.DEFINE_float("session_ttl_s", 3600.0, "Local instances: seconds a session is kept after its "
                                  "last call.", lower_bound=0.0)
_START_TIMEOUT = flags.DEFINE_float("start_timeout_s", 3600.0, "Local instances: how long they may take to load and "
                                    "compile.", lower_bound=1.0)

def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if bool(_INSTANCES.value) == bool(_LOCAL.value):
        raise app.UsageError("give either --instances=URL,... or --local_instances=N")
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.gateway import build_gateway
    from talaria_jax.serve.responses import Store

    keys = [k.strip() for k in (_KEY.value or os.environ.get("TALARIA_API_KEY", "")).split(",") if k.strip()]
    if not keys:
        keys = ["sk-" + secrets.token_urlsafe(24)]
        print(f"no --api_key or $TALARIA_API_KEY: this gateway's key is {keys[0]}", file=sys.stderr)
    try:
        policy = get_policy(_POLICY.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    local = start_local_instances(keys) if _LOCAL.value else None
    try:
        urls = local.urls if local is not None else _INSTANCES.value
        gateway = build_gateway(urls, api_keys=keys, policy=policy, max_body_bytes=_MAX_BODY.value,
                                probe_interval_s=_PROBE.value, fail_after=_FAIL_AFTER.value,
                                inferred_calls=_INFERRED.value,
                                response_store=Store(_RESPONSES.value, _RESPONSES_TTL.value))
        print(f"routing ({policy.name}) over {', '.join(urls)} on http://{_HOST.value}:{_PORT.value}/v1",
              file=sys.stderr)
        # uvicorn re-raises the signal that stopped it: exit through the finally below, which stops the instances
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        uvicorn.run(gateway, host=_HOST.value, port=_PORT.value, log_level="warning")
    finally:
        if local is not None:
            local.close()


def start_local_instances(keys: list[str]):
    """--local_instances `talaria-serve` processes (`LocalServers`) with this command's flags, started."""
    from talaria_jax.launch.common import chat_template_text, host_kv_bytes
    from talaria_jax.launch.local_servers import LocalServers, StartError

    n = _LOCAL.value
    host_kv = host_kv_bytes(_HOST_KV.value, instances=n)
    args = [f"--model={','.join(_MODEL.value)}", f"--policy={_POLICY.value}", f"--max_model_len={_MAX_LEN.value}",
            f"--max_seqs={_MAX_SEQS.value}", f"--speculate={_SPECULATE.value}", f"--max_body_bytes={_MAX_BODY.value}",
            f"--max_sessions={_MAX_SESSIONS.value}", f"--session_ttl_s={_SESSION_TTL.value}",
            f"--tool_call_parser={_TOOL_PARSER.value}",
            "--warmup" if _WARMUP.value else "--nowarmup",
            f"--host_kv_bytes={'unbounded' if host_kv is None else host_kv}"]
    if chat_template_text(_CHAT_TEMPLATE.value) is not None:  # a file it cannot read: the usage error here
        args.append(f"--chat_template={os.path.abspath(_CHAT_TEMPLATE.value)}")
    if _KV_MB.value:
        args.append(f"--kv_mib_per_device={_KV_MB.value}")
    print(f"starting {n} instance processes ({', '.join(_MODEL.value)} each) ...", file=sys.stderr)
    try:
        local = LocalServers(n, args, keys, tp=_TP.value)
    except StartError as e:
        raise app.UsageError(str(e)) from None
    try:
        local.wait_ready(_START_TIMEOUT.value)
    except (StartError, KeyboardInterrupt) as e:
        local.close(timeout_s=5)
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"talaria-route: {e}", file=sys.stderr)
        sys.exit(1)
    return local


def run():
    app.run(main)


if __name__ == "__main__":
    run()
