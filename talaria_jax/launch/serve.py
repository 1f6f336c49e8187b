"""talaria-serve: one instance's OpenAI-compatible server (FastAPI + uvicorn): one or several models on
one group of devices, switched and admitted by the scheduler's policy (`--policy`).

Defaults run on one CPU with no downloads: the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000.
Several models share the instance's weight slot and KV arena (`--model=smollm2-135m-instruct,tiny-moe`);
a router gateway (`talaria-route --instances=http://host:8000,...`) places calls over many of them.

  talaria-serve --api_key=sk-local                          # or TALARIA_API_KEY=sk-local talaria-serve
  curl -s 127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer sk-local" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Without a key one is made up and printed: every route but /health wants one. SIGTERM drains: new
requests get 503 while the running ones finish (at most --drain_timeout_s), then the server exits; a
second SIGTERM exits at once.
"""
from __future__ import annotations

import os
import secrets
import sys
import threading

import uvicorn
from absl import app, flags, logging

FLAGS = flags.FLAGS

_MODEL = flags.DEFINE_list("model", ["smollm2-135m-instruct"], "Models of the instance, comma-separated: each a named "
                           "model, .gguf file, HF or Orbax checkpoint folder, or config name (random weights).")
_NAME = flags.DEFINE_list("served_model_name", None, "The models' names in requests, one per --model (default: "
                          "--model).")
_POLICY = flags.DEFINE_string("policy", "talaria", "Scheduling policy of the instance's models (talaria, round, ...; "
                              "a numeric field changed: 'talaria[patience=0.5]'; see talaria_jax/scheduler/policies.py).")
_HARDWARE = flags.DEFINE_string("hardware", None, "Hardware profile of the scheduler's estimates (configs/hardware/ "
                                "name or YAML; default: cpu on the CPU backend, else h200x8).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (127.0.0.1: this machine only).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
_KEY = flags.DEFINE_string("api_key", None, "Comma-separated API keys (each a tenant); default $TALARIA_API_KEY, "
                           "else one is made up and printed.")
_TP = flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (the first tp devices are used).", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype (default: the checkpoint's).")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Context limit (tokens).", lower_bound=16)
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 16, "Requests decoding at once.", lower_bound=1)
_KV_MB = flags.DEFINE_integer("kv_mib_per_device", None, "KV pool per device in MiB (default: room for max_seqs "
                              "sequences of max_model_len).", lower_bound=1)
_WEIGHTS = flags.DEFINE_string("weight_budget", "largest", "Models in arrays of their own, taking turns on the "
                               "devices under a budget of weight bytes over the instance's devices: 'largest' (the "
                               "largest model's), a number of bytes, or 'all' (every model stays); a switch to an "
                               "evicted model copies it from host memory. 'slot': one weight slot the models share, "
                               "carved inside each step (on a CPU a copy of every parameter each step).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens_limit", 4096, "Largest max_tokens a request may ask.", lower_bound=1)
_MAX_N = flags.DEFINE_integer("max_n", 8, "Largest n a request may ask.", lower_bound=1)
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body (bytes; larger: 413).",
                                 lower_bound=1024)
_DRAIN = flags.DEFINE_float("drain_timeout_s", 30.0, "On SIGTERM, how long running requests may finish.",
                            lower_bound=0.0)
_SECRET = flags.DEFINE_string("tenant_secret", None, "Key of the tenant salts (HMAC of each API key); default "
                              "$TALARIA_TENANT_SECRET, else random for this process.")
_SPECULATE = flags.DEFINE_integer("speculate", 0, "Suffix-tree speculative decoding: draft tokens per request "
                                  "and step at most (0: off). Drafts come from the request's own text and its tenant's "
                                  "earlier and in-flight responses; how many a step verifies follows the step cost "
                                  "measured at start.", lower_bound=0, upper_bound=31)
_HOST_KV = flags.DEFINE_string("host_kv_bytes", "auto", "Host memory for session KV copies (restored when a session "
                               "returns), all models together: a size (8G, 512M, bytes; 0: none), 'auto' (20% of the "
                               "host memory available at start) or 'unbounded'. Past it the least recently used copies "
                               "are evicted; their sessions' prefixes are recomputed.")
_MAX_SESSIONS = flags.DEFINE_integer("max_sessions", 10_000, "Sessions kept at most (their KV protection, history and "
                                     "host copy); past it the least recently active idle ones are forgotten.",
                                     lower_bound=1)
_SESSION_TTL = flags.DEFINE_float("session_ttl_s", 3600.0, "Seconds a session is kept after its last call.",
                                  lower_bound=0.0)
_INFERRED = flags.DEFINE_integer("inferred_calls", 65_536, "Calls kept to infer the sessions of calls that name "
                                 "none (no session_id, x-session-id or prompt_cache_key) from their prompts' token "
                                 "ids; the least recently used are forgotten past it. 0: no inference (each such "
                                 "call is a session of its own).", lower_bound=0)
_RESPONSES = flags.DEFINE_integer("responses_stored", 10_000, "Responses (of POST /v1/responses with store: true) "
                                  "kept for previous_response_id, GET and DELETE; the oldest go first.", lower_bound=0)
_RESPONSES_TTL = flags.DEFINE_float("responses_ttl_s", 3600.0, "Seconds a stored response is kept.", lower_bound=1.0)
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every step shape before serving.")
_TOOL_PARSER = flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "hermes", "llama3_json"],
                                 "How the models write tool calls (auto: read from each chat template; a template "
                                 "without a tools section gets the hermes fallback). See docs/agents.md.")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "A Jinja chat template file used for every model of the "
                                     "instance in place of its tokenizer's (a model without one serves chats with "
                                     "it).")
_CONFIG = flags.DEFINE_string("config", None, "A YAML file of the whole instance (talaria_jax.serve.config."
                              "InstanceConfig: models, engine, policy, KV and host budgets, server); it replaces the "
                              "instance's flags, and --api_key (or $TALARIA_API_KEY) and $TALARIA_TENANT_SECRET give "
                              "its keys and tenant secret where it names none (host_kv_bytes absent: as "
                              "--host_kv_bytes=auto).")
# the flags an InstanceConfig replaces (--config gives them all at once)
_INSTANCE_FLAGS = ("model", "served_model_name", "policy", "hardware", "tp", "dtype", "max_model_len", "max_seqs",
                   "kv_mib_per_device", "weight_budget", "max_tokens_limit", "max_n", "max_body_bytes", "tenant_secret", "speculate",
                   "host_kv_bytes", "max_sessions", "session_ttl_s", "inferred_calls", "responses_stored",
                   "responses_ttl_s", "warmup", "tool_call_parser", "chat_template")
_XLA_CACHE = flags.DEFINE_string("compilation_cache", None, "Persistent compilation cache folder (default "
                                 "$TALARIA_COMPILATION_CACHE or ~/.cache/talaria_jax/xla); 'off' disables it.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.launch.common import instance_apps

    keys = [k.strip() for k in (_KEY.value or os.environ.get("TALARIA_API_KEY", "")).split(",") if k.strip()]
    made = "sk-" + secrets.token_urlsafe(24)  # the key where neither the flags nor a --config file give one
    config = instance_config(tuple(keys) or (made,))
    if config.server.api_keys == (made,):
        print(f"no --api_key or $TALARIA_API_KEY: this server's key is {made}", file=sys.stderr)
    [api] = instance_apps(config, compilation_cache=_XLA_CACHE.value)
    names = list(config.models)
    server = DrainingServer(uvicorn.Config(api, host=_HOST.value, port=_PORT.value, log_level="warning",
                                           timeout_graceful_shutdown=max(1, int(_DRAIN.value))),
                            api.state.engine, _DRAIN.value)
    cap = api.state.backend.instance.kv.budget.capacity_bytes
    print(f"serving {', '.join(names)} on http://{_HOST.value}:{_PORT.value}/v1 (host KV: "
          f"{'unbounded' if cap is None else f'{cap / 2**30:.2f} GiB'})", file=sys.stderr)
    server.run()
    api.state.engine.close()


def instance_config(keys: tuple[str, ...]):
    """The instance, typed: --config's file (its API keys, else `keys`), or the flags (and `keys`). A
    bad value is a usage error naming it."""
    from talaria_jax.config_io import ConfigError
    from talaria_jax.engine import EngineConfig
    from talaria_jax.launch.common import chat_template_text, host_kv_bytes, spec_config
    from talaria_jax.serve.config import InstanceConfig, ServerConfig
    from talaria_jax.serve.protocol import Limits

    try:
        if _CONFIG.value:
            given = [f"--{name}" for name in _INSTANCE_FLAGS if FLAGS[name].present]
            if given:
                raise app.UsageError(f"--config={_CONFIG.value} gives the whole instance; drop {', '.join(given)}")
            return InstanceConfig.from_file(_CONFIG.value, api_keys=keys,
                                            tenant_secret=os.environ.get("TALARIA_TENANT_SECRET") or None,
                                            host_kv_bytes=host_kv_bytes("auto"))
        names = _NAME.value or _MODEL.value
        if len(names) != len(_MODEL.value):
            raise app.UsageError(f"--served_model_name has {len(names)} names for {len(_MODEL.value)} models")
        if not names:
            raise app.UsageError("--model: give at least one model")
        server = ServerConfig(
            keys, Limits(max_body_bytes=_MAX_BODY.value, max_tokens=_MAX_TOKENS.value, max_n=_MAX_N.value),
            tenant_secret=_SECRET.value or os.environ.get("TALARIA_TENANT_SECRET") or None,
            max_sessions=_MAX_SESSIONS.value, session_ttl_s=_SESSION_TTL.value, tool_call_parser=_TOOL_PARSER.value,
            chat_template=chat_template_text(_CHAT_TEMPLATE.value), inferred_calls=_INFERRED.value,
            responses_stored=_RESPONSES.value, responses_ttl_s=_RESPONSES_TTL.value)
        engine = EngineConfig(max_seqs=_MAX_SEQS.value, max_tokens_per_step=max(256, _MAX_SEQS.value),
                              max_model_len=_MAX_LEN.value, prefix_cache=True, warmup=_WARMUP.value,
                              speculation=spec_config(_SPECULATE.value))
        return InstanceConfig(dict(zip(names, _MODEL.value)), server, engine, policy=_POLICY.value,
                              hardware=_HARDWARE.value, devices=_TP.value, dtype=_DTYPE.value,
                              kv_bytes_per_device=_KV_MB.value * 2**20 if _KV_MB.value else None,
                              host_kv_bytes=host_kv_bytes(_HOST_KV.value), weight_budget=_WEIGHTS.value)
    except ConfigError as e:
        raise app.UsageError(str(e)) from None


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM (or SIGINT) drains the engine (503 to new requests, running
    ones finish within `drain_s`) before it exits; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, async_engine, drain_s: float):
        super().__init__(config)
        self.async_engine, self.drain_s, self.draining = async_engine, drain_s, False

    def handle_exit(self, sig, frame):
        if self.draining:  # a second signal: exit now
            self.force_exit = True
            return super().handle_exit(sig, frame)
        self.draining = True
        threading.Thread(target=self._drain_then_exit, args=(sig, frame), daemon=True).start()

    def _drain_then_exit(self, sig, frame):
        if not self.async_engine.drain(self.drain_s):
            logging.warning("drain timeout (%.0f s): %d requests still running", self.drain_s,
                            self.async_engine.num_in_flight())
        super().handle_exit(sig, frame)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
