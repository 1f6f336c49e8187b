"""Instance servers and a gateway in one process, on 127.0.0.1: `make demo`, `benchmarks/serve_load.py`
and the serving tests run on it (`talaria-route --local_instances` starts processes instead:
`launch/local_servers.py`).

`LocalCluster` starts one instance server per group of local devices, each hosting every model given
(an `InstanceEngine` under a policy), over HTTP on free ports. `gateway(policy)` puts every instance
under `policy` (emptied first, compiled programs kept) and serves a gateway over them, so several
policies can be compared on the same instances.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import jax

from talaria_jax.engine import enable_compilation_cache
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.instance import LOCAL_KV_BYTES, build_instances
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.serve.app import ServedModel, build_app, serve_in_thread
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.gateway import build_gateway
from talaria_jax.serve.instance_engine import InstanceEngine
from talaria_jax.serve.load import AgentSession, SessionResult, agent_sessions, run_sessions
from talaria_jax.serve.responses import Store
from talaria_jax.sharding import simulate_cpu_devices

__all__ = ["LocalCluster", "demo_cluster", "demo_sessions", "instance_apps"]


def instance_apps(config: InstanceConfig, instances: int = 1) -> list:
    """`instances` instance servers as `config` says (FastAPI apps, not started), each on its own
    `config.devices` devices: an `Instance` of `config.models`, an `InstanceEngine` running
    `config.policy` over it, and its server; `app.state.backend` is the InstanceEngine."""
    s = config.server
    insts = build_instances(config.models, config.hardware_config(jax.default_backend()), instances=instances,
                            devices_per_instance=config.devices, engine_config=config.engine, tokens=None,
                            kv_bytes_per_device=config.kv_bytes_per_device, dtype=config.dtype,
                            host_kv_bytes=config.host_kv_bytes, resident=config.resident,
                            weight_budget=config.weight_budget)
    apps = []
    for inst in insts:
        ie = InstanceEngine(inst, config.policy_config(), session_ttl_s=s.session_ttl_s, max_sessions=s.max_sessions)
        served = [ServedModel(m, ie.engine_of(m), s.tool_call_parser, s.chat_template) for m in ie.models]
        a = build_app(served, api_keys=s.api_keys, limits=s.limits, backend=ie,
                      tenant_secret=s.tenant_secret.encode() if s.tenant_secret else None,
                      inferred_calls=s.inferred_calls, response_store=Store(s.responses_stored, s.responses_ttl_s))
        a.state.backend = ie
        apps.append(a)
    return apps


class LocalCluster:
    """See the module docstring: the instance servers `apps` (`instance_apps`), which take
    `api_keys`, started. Close it (or use it as a context manager) to stop them."""

    @classmethod
    def build(cls, config: InstanceConfig, instances: int = 1) -> "LocalCluster":
        """The cluster of `instance_apps(config, instances)`."""
        return cls(instance_apps(config, instances), config.server.api_keys)

    def __init__(self, apps: Sequence, api_keys: Sequence[str]):
        self.api_keys = list(api_keys)
        self.apps = list(apps)
        self.engines = [a.state.backend for a in self.apps]
        self.stats: dict[str, dict] = {}
        self.servers = []
        self.urls = []
        for a in self.apps:
            url, server = serve_in_thread(a)
            self.urls.append(url)
            self.servers.append(server)

    def use(self, policy: PolicyConfig, timeout_s: float = 60.0) -> None:
        """Every instance under `policy`, emptied (waits up to `timeout_s` for calls in flight)."""
        for a, ie in zip(self.apps, self.engines):
            ae = a.state.engine
            deadline = time.monotonic() + timeout_s
            while ae.num_in_flight() and time.monotonic() < deadline:
                time.sleep(0.02)
            with ae.locked():
                ie.reset(policy)

    @contextlib.contextmanager
    def gateway(self, policy: PolicyConfig, **gateway_kw) -> Iterator[str]:
        """A gateway under `policy` over the instances (put under it first); yields its base URL."""
        self.use(policy)
        self.router = build_gateway(self.urls, api_keys=self.api_keys, policy=policy, **gateway_kw)
        url, server = serve_in_thread(self.router)
        try:
            yield url
        finally:
            server.should_exit = True
            server.thread.join(timeout=30)

    def compare(self, policies: Sequence[PolicyConfig], sessions: Sequence[AgentSession], *, runs: int = 1,
                on_run: Callable[[str, int, list[SessionResult]], object] | None = None,
                **run_kw) -> dict[str, list[list[SessionResult]]]:
        """The same agent sessions through a gateway under each policy in turn (`load.run_sessions`,
        whose arguments `run_kw` are), `runs` times, interleaved (p1, p2, p1, p2, ...) so that a drift
        of the machine's load falls on every policy alike; each policy's results per run.
        `on_run(policy, run, results)` is called after each. `self.stats[policy]`: the instances'
        model switches, switch seconds (and the longest switch) and KV tokens restored from host and
        recomputed, over its last run."""
        out: dict[str, list[list[SessionResult]]] = {p.name: [] for p in policies}
        for k in range(runs):
            for policy in policies:
                with self.gateway(policy) as url:
                    res = run_sessions(url, self.api_keys[0], sessions, **run_kw)
                out[policy.name].append(res)
                st = [ie.instance.stats for ie in self.engines]
                self.stats[policy.name] = {"switches": sum(s.switches for s in st),
                                           "switch_s": sum(s.switch_s for s in st),
                                           "switch_max_s": max((d for s in st for _, _, d in s.switch_log), default=0.0),
                                           "restored_tokens": sum(s.restored_tokens for s in st),
                                           "recomputed_tokens": sum(s.recomputed_tokens for s in st)}
                if on_run is not None:
                    on_run(policy.name, k, res)
        return out

    def close(self) -> None:
        for server in self.servers:
            server.should_exit = True
        for server, a in zip(self.servers, self.apps):
            server.thread.join(timeout=30)
            a.state.engine.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


MODELS = ("smollm2-135m-instruct", "tiny-dense", "tiny-moe")
RANDOM = {"tiny-dense", "tiny-moe"}  # random weights: their replies are noise
KEY = "sk-demo"


def demo_cluster(policy: str, weight_budget: str = "largest") -> LocalCluster:
    """`make demo`'s and `benchmarks/serve_load.py`'s cluster: two local instances (one device each)
    hosting `MODELS` under `policy`, with the compilation cache on (the second instance loads what the
    first compiled). Each model keeps arrays of its own (a step over a weight slot copies every parameter
    on a CPU), and they take turns on the devices under `weight_budget` (``instance.resolve_weight_budget``:
    by default the largest model's bytes, so SmolLM2 and the others cannot all stay, and a switch to an
    evicted model copies it from host memory; "all" keeps every model). Call it before JAX starts (it asks
    for two CPU devices). Programs compile as step shapes first occur (warming every shape of 3 models x 2
    instances up front takes minutes here and more executables than a CPU process maps)."""
    config = InstanceConfig({m: m for m in MODELS}, ServerConfig((KEY,)), policy=policy, hardware="cpu",
                            engine=EngineConfig(page_size=16, max_seqs=8, max_tokens_per_step=256, max_model_len=4096,
                                                prefix_cache=True, warmup=False),
                            kv_bytes_per_device=LOCAL_KV_BYTES, resident=True,
                            weight_budget=weight_budget)  # (a bad policy or budget fails here)
    simulate_cpu_devices(2)
    enable_compilation_cache()
    return LocalCluster.build(config, instances=2)


def demo_sessions(sessions: int, calls: int, *, max_tokens: int, tool_gap_s: float, seed: int) -> list[AgentSession]:
    """Scripted agent sessions over `MODELS` (`load.agent_sessions`; SmolLM2's as chats)."""
    return agent_sessions(sessions, calls, MODELS, chat_models={MODELS[0]}, seed=seed, max_tokens=max_tokens,
                          tool_gap_s=tool_gap_s)
