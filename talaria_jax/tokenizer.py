"""Tokenizers: HF `tokenizer.json` through the `tokenizers` library when a checkpoint has one, and a
byte-level tokenizer for the embedded tiny models (no downloads)."""
from __future__ import annotations

import pathlib
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; then BOS 256, EOS 257, PAD 258. Ids >= 259 decode to nothing."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json via the `tokenizers` library."""

    def __init__(self, path: str | pathlib.Path, bos_id: int | None = None, eos_id: int | None = None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str | pathlib.Path | None = None, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer:
    """The checkpoint's tokenizer.json if present, else the byte-level tokenizer."""
    if checkpoint_dir is not None and (pathlib.Path(checkpoint_dir) / "tokenizer.json").exists():
        return HFTokenizer(pathlib.Path(checkpoint_dir) / "tokenizer.json", bos_id, eos_id)
    return ByteTokenizer()
