"""Host memory of an instance server stays bounded under session traffic: session KV copies within
--host_kv_bytes (least recently used evicted, an evicted session's prefix recomputed to the same
tokens), the session table within --max_sessions, and both visible in /metrics."""
import httpx
import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.launch.common import HOST_KV_SHARE, available_host_bytes, host_kv_bytes
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.local_cluster import LocalCluster
from talaria_jax.sharding import make_mesh

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

KEY = "sk-host"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, prefix_cache=True,
                      warmup=False)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"talaria:{name}") and not line.startswith("#"))


def call(url: str, session: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}", "x-session-id": session},
                   json={"model": "tiny-dense", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server():
    """One instance server over tiny-dense under talaria (named sessions' KV is copied to host when
    their calls end), keeping at most 6 sessions."""
    with LocalCluster.build(InstanceConfig({"tiny-dense": "tiny-dense"}, ServerConfig((KEY,), max_sessions=6), CONFIG,
                                           hardware="cpu")) as lc:
        yield lc.apps[0].state.backend, lc.urls[0]


def test_host_kv_and_sessions_stay_bounded_and_an_evicted_session_gets_the_same_tokens(server):
    ie, url = server
    rng = np.random.RandomState(0)
    prompts = {f"s{k}": rng.randint(0, 256, 40).tolist() for k in range(12)}
    call(url, "s0", prompts["s0"])
    one_copy = metric(url, "host_kv_bytes")
    assert one_copy > 0 and metric(url, "host_kv_copies") == 1
    ie.instance.kv.budget.capacity_bytes = int(3 * one_copy)  # what --host_kv_bytes sets: room for 3 copies
    for sid, prompt in list(prompts.items())[1:]:
        call(url, sid, prompt)
        assert metric(url, "host_kv_bytes") <= 3 * one_copy
    assert metric(url, "host_kv_capacity_bytes") == 3 * one_copy and metric(url, "host_kv_copies") == 3
    assert metric(url, "host_kv_evictions_total") == 12 - 3 and metric(url, "host_kv_refused_total") == 0
    assert metric(url, "sessions_held") <= 6 < 12 and metric(url, "sessions_forgotten_total") >= 6
    # s0's host copy went first: its next call computes what it lacks, to a full forward's tokens
    cont = prompts["s0"] + [7, 8, 9]
    again = call(url, "s0", cont, max_tokens=6)
    want = greedy_generate(init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=0),
                           [cont], 6)[0]
    tok = ie.engine_of("tiny-dense").tokenizer
    assert again["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in want]


def test_auto_takes_a_share_of_the_memory_there_is():
    avail = available_host_bytes()
    assert 0 < avail and host_kv_bytes("auto") == int(avail * HOST_KV_SHARE) or \
        abs(host_kv_bytes("auto") - avail * HOST_KV_SHARE) < 0.05 * avail
    assert host_kv_bytes("auto", instances=2) < host_kv_bytes("auto") and host_kv_bytes("unbounded") is None
    assert host_kv_bytes("512M") == 512 << 20 and host_kv_bytes("0") == 0
