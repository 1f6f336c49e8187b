"""One request id end to end: the id a call arrives with (`x-request-id`), or the one the front door
makes, is the id of the call at every instance it is probed and served on, of its engine request,
of its answer (header, and the body's `cmpl-<id>`), and the exemplar of its latency metrics."""
import re

import httpx
import openai
import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.local_cluster import LocalCluster

KEY = "sk-rid"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, prefix_cache=True,
                      warmup=False)


@pytest.fixture(scope="module")
def served():
    """Two instance servers of tiny-dense, the gateway over them, and the ids of every request each
    instance's engine stepped."""
    with LocalCluster.build(InstanceConfig({"tiny-dense": "tiny-dense"}, ServerConfig((KEY,)), CONFIG, hardware="cpu",
                                           kv_bytes_per_device=8 << 20), instances=2) as lc:
        stepped = [set() for _ in lc.engines]
        for seen, backend in zip(stepped, lc.engines):
            for engine in backend.engines:
                engine.before_step = lambda plan, seen=seen: seen.update(c.request_id for c in plan.chunks)
        with lc.gateway(get_policy("talaria"), probe_interval_s=0.5) as url:
            yield url, lc.urls, stepped


def exemplars(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}",
                                                "Accept": "application/openmetrics-text"}).text
    return set(re.findall(r'# \{request_id="([^"]+)"\}', text))


def test_the_callers_id_names_the_call_at_the_gateway_the_instance_the_engine_and_the_metrics(served):
    url, instances, stepped = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    raw = c.completions.with_raw_response.create(model="tiny-dense", prompt=[3, 1, 4, 1, 5], max_tokens=4,
                                                 temperature=0, extra_headers={"x-request-id": "trace-7.a:b"})
    assert raw.headers["x-request-id"] == "trace-7.a:b" and raw.parse().id == "cmpl-trace-7.a:b"
    at = [k for k, seen in enumerate(stepped) if "trace-7.a:b" in seen]
    assert len(at) == 1  # one engine ran it, under the caller's id
    assert "trace-7.a:b" in exemplars(instances[at[0]])
    # no id given: the gateway makes one, and it is the instance's and the engine's too
    stream = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                        json={"model": "tiny-dense", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True})
    rid = stream.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and f'"id": "cmpl-{rid}"' in stream.text.replace('":"', '": "')
    assert any(rid in seen for seen in stepped)
    # n choices: one engine request each, `<id>-<i>`
    c.completions.create(model="tiny-dense", prompt=[1, 2], max_tokens=2, n=2, extra_headers={"x-request-id": "two"})
    assert any({"two-0", "two-1"} <= seen for seen in stepped)


def test_an_id_that_is_not_a_plain_token_is_refused_naming_the_header(served):
    url, instances, _ = served
    for at in (url, instances[0]):
        r = httpx.post(f"{at}/v1/completions", headers={"Authorization": f"Bearer {KEY}", "x-request-id": "a b"},
                       json={"model": "tiny-dense", "prompt": [1], "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


def test_two_calls_a_client_sent_under_one_id_are_both_served(served):
    """The second call under an id in flight is served under the id with a suffix (`<id>.<hex>`), named
    in its answer; neither is refused."""
    _, instances, _ = served
    auth = {"Authorization": f"Bearer {KEY}", "x-request-id": "twice"}
    body = {"model": "tiny-dense", "prompt": [1, 2, 3], "max_tokens": 48, "logit_bias": {"257": -100}}  # no EOS
    with httpx.stream("POST", f"{instances[0]}/v1/completions", headers=auth, json={**body, "stream": True},
                      timeout=120) as first:
        assert first.headers["x-request-id"] == "twice"
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the first is running
        second = httpx.post(f"{instances[0]}/v1/completions", headers=auth, json=body, timeout=120)
        rest = list(lines)
    assert second.status_code == 200 and re.fullmatch(r"twice\.[0-9a-f]{8}", second.headers["x-request-id"])
    assert second.json()["id"] == f"cmpl-{second.headers['x-request-id']}"
    assert second.json()["usage"]["completion_tokens"] == 48 and "data: [DONE]" in rest


def test_a_request_is_checked_once_by_each_instance_it_reaches(served, monkeypatch):
    """An instance checks a call once, when it arrives (its engine's `check_request`): the checked
    request is what its scheduler holds and its engine admits. Through the gateway, each instance
    checks at the probe, and the one the call is forwarded to takes the probed request as it is."""
    url, instances, _ = served
    validate, seen = SamplingParams.validate, []

    def counted(params, vocab_size):
        if params.seed == 424242:  # (this test's calls only: nothing else the servers run)
            seen.append(params)
        return validate(params, vocab_size)
    monkeypatch.setattr(SamplingParams, "validate", counted)
    body = {"model": "tiny-dense", "prompt": [2, 7, 1, 8], "max_tokens": 3, "seed": 424242}
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{instances[0]}/v1/completions", headers=auth, json=body, timeout=120)
    assert r.status_code == 200 and len(seen) == 1  # at arrival: not again when the engine admits it
    seen.clear()
    r = httpx.post(f"{url}/v1/completions", headers=auth, json=body, timeout=120)
    assert r.status_code == 200 and 1 <= len(seen) <= len(instances)  # one probe an instance, and no more
    seen.clear()
    r = httpx.post(f"{url}/v1/completions", headers=auth, json={**body, "n": 2}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert 2 <= len(seen) <= 2 * len(instances)  # a choice each (its own seed is checked), once
