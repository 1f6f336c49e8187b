"""One typed configuration of a served instance: read from YAML with errors naming the file and the
field, its keys filled from the flags where the file names none, and `talaria-serve --config`
refusing instance flags given beside it."""
import subprocess
import sys

import pytest

from talaria_jax.config_io import ConfigError
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.serve.config import InstanceConfig, ServerConfig
from talaria_jax.serve.protocol import Limits

FILE = """
models: {tiny: tiny-dense, moe: tiny-moe}
policy: round
engine: {max_seqs: 4, max_model_len: 256, page_size: 8, warmup: false}
kv_bytes_per_device: 8388608
host_kv_bytes: 0
server: {limits: {max_tokens: 64}, max_sessions: 5}
"""


def test_a_file_gives_the_whole_instance_typed(tmp_path):
    path = tmp_path / "instance.yaml"
    path.write_text(FILE)
    c = InstanceConfig.from_file(path, api_keys=("sk-a",))
    assert c == InstanceConfig({"tiny": "tiny-dense", "moe": "tiny-moe"},
                               ServerConfig(("sk-a",), Limits(max_tokens=64), max_sessions=5),
                               EngineConfig(max_seqs=4, max_model_len=256, page_size=8, warmup=False),
                               policy="round", kv_bytes_per_device=8 << 20, host_kv_bytes=0)
    assert c.policy_config().name == "round" and c.hardware_config("cpu").name == "cpu"
    path.write_text(FILE.replace("host_kv_bytes: 0\n", ""))
    assert InstanceConfig.from_file(path, api_keys=("sk-a",), host_kv_bytes=5).host_kv_bytes == 5  # absent: given
    path.write_text(FILE.replace("host_kv_bytes: 0", "host_kv_bytes: null"))
    assert InstanceConfig.from_file(path, api_keys=("sk-a",), host_kv_bytes=5).host_kv_bytes is None  # unbounded
    path.write_text(FILE.replace("policy: round", "policy: round\nweight_budget: largest"))
    assert InstanceConfig.from_file(path, api_keys=("sk-a",)).weight_budget == "largest"
    path.write_text(FILE.replace("policy: round", "policy: round\nweight_budget: 2000000000"))
    assert InstanceConfig.from_file(path, api_keys=("sk-a",)).weight_budget == 2000000000  # a number of bytes
    path.write_text(FILE.replace("server: {", "server: {api_keys: [sk-file], "))
    assert InstanceConfig.from_file(path, api_keys=("sk-a",)).server.api_keys == ("sk-file",)  # the file's win


@pytest.mark.parametrize("change,says", [
    (("policy: round", "policy: nope"), "instance.yaml: InstanceConfig: unknown policy 'nope'"),
    (("max_seqs: 4", "max_seqs: 0"), "EngineConfig.max_seqs must be >= 1"),
    (("max_sessions: 5", "max_sessions: 0"), "ServerConfig.max_sessions must be >= 1"),
    (("host_kv_bytes: 0", "host_kv_bytes: -1"), "InstanceConfig.host_kv_bytes must be a non-negative int"),
    (("policy: round", "polcy: round"), "unknown field(s) ['polcy']"),
    (("max_seqs: 4", "max_seqs: four"), "instance.yaml.engine.max_seqs: expected int"),
    (("models: {tiny: tiny-dense, moe: tiny-moe}", "models: {}"), "InstanceConfig.models"),
    (("policy: round", "policy: round\nweight_budget: most"),
     "InstanceConfig.weight_budget: weight budget must be one of ['all', 'largest'] or a number of bytes"),
])
def test_a_bad_field_is_named(tmp_path, change, says):
    path = tmp_path / "instance.yaml"
    path.write_text(FILE.replace(*change))
    with pytest.raises(ConfigError) as e:
        InstanceConfig.from_file(path, api_keys=("sk-a",))
    assert says in str(e.value)
    with pytest.raises(ConfigError, match="api_keys: give at least one"):
        ServerConfig(())


def test_talaria_serve_takes_a_config_file_or_flags_not_both(tmp_path):
    path = tmp_path / "instance.yaml"
    path.write_text(FILE)
    cmd = [sys.executable, "-m", "talaria_jax.launch.serve", f"--config={path}", "--max_seqs=8", "--api_key=sk-a"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "gives the whole instance; drop --max_seqs" in r.stderr
    path.write_text(FILE.replace("policy: round", "policy: nope"))
    r = subprocess.run(cmd[:-2] + ["--api_key=sk-a"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown policy 'nope'" in r.stderr and "Traceback" not in r.stderr
