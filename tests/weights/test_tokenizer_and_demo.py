"""Byte tokenizer round trip and the demo entry point."""
import subprocess
import sys

from talaria_jax.tokenizer import ByteTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo ✓", add_bos=True)
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids) == "héllo ✓"


def test_generate_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "talaria_jax.launch.generate", "--model=tiny-dense", "--max_tokens=4",
                          "--tp=2", "--prompt=hi", "--show_ids", "--compilation_cache=off"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokens: [" in out.stdout and "tiny-dense" in out.stdout and "time to first token" in out.stdout


def test_hf_tokenizer_json_is_used_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the agent calls the tool", "the tool answers the agent"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, bos_id=1, eos_id=2)
    assert not isinstance(loaded, ByteTokenizer)
    ids = loaded.encode("the agent calls", add_bos=True)
    assert ids[0] == 1 and ids[1:] == tok.encode("the agent calls").ids
    assert loaded.decode(ids[1:]).replace(" ", "") == "theagentcalls"
