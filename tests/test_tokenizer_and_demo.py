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
    out = subprocess.run([sys.executable, "-m", "talaria_jax.launch.generate", "--max_new_tokens=4", "--tp=1",
                          "--prompt=hi"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokens: [" in out.stdout and "tiny-dense" in out.stdout
