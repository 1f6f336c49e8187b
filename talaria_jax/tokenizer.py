"""Tokenizers: a GGUF file's byte-level BPE (tokenizing as llama.cpp does, with its chat template),
HF `tokenizer.json` through the `tokenizers` library when a checkpoint has one, and a byte-level
tokenizer for the embedded tiny models (no downloads)."""
from __future__ import annotations

import functools
import heapq
import json
import pathlib
from typing import Any, Mapping, Protocol, Sequence

from talaria_jax import gguf_reader


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # whether a prompt starts with bos_id (the model's own convention)

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, folder: str | pathlib.Path) -> None:
        """Writes what `load_tokenizer(folder)` needs to rebuild this tokenizer."""


def joined(parts: list[str]) -> str:
    """The parts as one string, kept as the list's only part (joined once, however often read)."""
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoding only a short window at each step, so a whole
    output costs time linear in its length (decoding every token again at every step is quadratic).
    A trailing U+FFFD is held back while it may still become a character split over tokens (for up to
    `HOLD` tokens; after that it is a byte that is not UTF-8, and shown as U+FFFD, as a whole decode
    shows it). The window starts one decoded piece back, so tokenizers whose decode depends on the
    token before (a leading space) decode as the whole text would."""

    HOLD = 4  # tokens a partial UTF-8 character may span (4 bytes at most, a byte or more a token)

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []  # the text, as handed out (joined on reading `text`)
        self._prefix = self._read = 0  # the window is ids[_prefix:]; ids[_prefix:_read] were decoded whole
        self._shown = 0  # characters of the window's text already in `text`

    def add(self, ids: Sequence[int]) -> str:
        """Appends ids; returns the text they complete (possibly empty)."""
        self.ids.extend(ids)
        return self._advance(final=False)

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return joined(self._pieces)

    def flush(self) -> str:
        """At the end: the rest, a trailing incomplete character as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        window = decode(self.ids[self._prefix:])
        end = len(window)
        if not final and window.endswith("\ufffd"):  # a character that may still complete: hold its tokens
            for j in range(1, min(self.HOLD, len(self.ids) - self._prefix) + 1):
                head = decode(self.ids[self._prefix:len(self.ids) - j])
                if not head.endswith("\ufffd"):
                    end = len(head)
                    break
        delta = window[self._shown:end] if end > self._shown else ""
        if delta:
            self._pieces.append(delta)
        self._shown = max(self._shown, end)
        if end == len(window):  # all shown: the next window starts where this one's new tokens began
            self._prefix, self._read = self._read, len(self.ids)
            self._shown = len(self.tokenizer.decode(self.ids[self._prefix:self._read]))
        return delta


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; then BOS 256, EOS 257, PAD 258. Ids >= 259 decode to nothing."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    add_bos = True

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8", "surrogatepass"))  # lone surrogates as their 3 bytes, as the GGUF path does
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if 0 <= i < 256 else {256: b"<bos>", 257: b"<eos>", 258: b"<pad>"}.get(i, b"")

    def is_special(self, i: int) -> bool:
        return i >= 256

    def save(self, folder: str | pathlib.Path) -> None:
        """Nothing to write: a folder without a tokenizer file loads as the byte tokenizer."""


class HFTokenizer:
    """A checkpoint's tokenizer.json via the `tokenizers` library."""

    def __init__(self, path: str | pathlib.Path, bos_id: int | None = None, eos_id: int | None = None):
        from tokenizers import Tokenizer as _Tok

        self.path = pathlib.Path(path)
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = bos_id is not None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not text.isascii():  # lone surrogates (valid JSON, invalid UTF-8) become U+FFFD
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, folder: str | pathlib.Path) -> None:
        """Copies tokenizer.json into folder, with its bos/eos ids beside it (`HF_IDS_FILE`)."""
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_bytes(self.path.read_bytes())
        (folder / HF_IDS_FILE).write_text(json.dumps({"bos_id": self.bos_id, "eos_id": self.eos_id}))


HF_IDS_FILE = "talaria_tokenizer_ids.json"  # bos/eos of a saved HFTokenizer (tokenizer.json does not say)


# ---------------------------------------------------------------------------------------------
# GGUF byte-level BPE (llama.cpp's `gpt2` tokenizer model)
# ---------------------------------------------------------------------------------------------

# llama.cpp's whitespace set (unicode_set_whitespace); `regex`'s own \s also takes U+001C-U+001F.
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# The regex lists of llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe), applied in order.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS_RE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS_RE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS_RE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
_PRE_REGEXES = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2_RE,),
    "smollm": (r"\p{N}", _GPT2_RE),
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_QWEN2_RE,),
}
# tokenizer.ggml.pre -> (llama.cpp pre-type rules, ignore_merges, llama.cpp's add_bos default)
_PRE_TOKENIZERS = {
    "default": ("default", False, False),
    **{n: ("gpt2", False, False) for n in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    **{n: ("smollm", False, False) for n in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")},
    **{n: ("llama3", True, True) for n in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")},
    **{n: ("llama3", False, False) for n in ("dbrx", "smaug-bpe")},
    **{n: ("qwen2", False, False) for n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
}
SUPPORTED_GGUF_MODELS = ("gpt2",)
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp marks these as control even when a file says normal (its EOT/EOG/FIM detection by text).
_CONTROL_BY_TEXT = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "<|eom_id|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|fim_repo|>",
    "<|file_sep|>", "<fim-prefix>", "<fim-suffix>", "<fim-middle>", "<fim-pad>", "<fim_prefix>",
    "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<PRE>", "<SUF>", "<MID>", "<PAD>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>"])
# End-of-turn token by text when the file names none (first found, in llama.cpp's order).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>")
_PIECE_CACHE_MAX = 1 << 18  # pre-token pieces remembered; cleared when full


def _translate_regex(src: str) -> str:
    """llama.cpp's regex with \\s and \\S spelled as its own whitespace set."""
    out, inside, i = [], False, 0
    while i < len(src):
        c = src[i]
        if c == "\\" and i + 1 < len(src):
            e = src[i + 1]
            if e == "s":
                out.append(_WS if inside else f"[{_WS}]")
            elif e == "S":
                out.append(f"[^{_WS}]")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _compiled_rules(rules: str) -> tuple:
    import regex  # third-party: \p{..} classes

    return tuple(regex.compile(_translate_regex(r)) for r in _PRE_REGEXES[rules])


@functools.lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte (bytes_to_unicode)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return tuple(chars[b] for b in range(256))


def _split_keep_gaps(pattern, pieces: list[str]) -> list[str]:
    """Each piece cut at the pattern's matches; the text between matches stays as pieces too
    (llama.cpp's unicode_regex_split)."""
    out = []
    for piece in pieces:
        end = 0
        for m in pattern.finditer(piece):
            s, e = m.span()
            if s > end:
                out.append(piece[end:s])
            if e > s:
                out.append(piece[s:e])
            end = e
        if end < len(piece):
            out.append(piece[end:])
    return out


class GGUFTokenizer:
    """Byte-level BPE from a GGUF file's tokenizer metadata, tokenizing as llama.cpp does.

    Pre-tokenizer rules follow llama.cpp's `tokenizer.ggml.pre` table (see SUPPORTED_PRE_TOKENIZERS):
    its regexes run in sequence, each splitting the pieces the previous one left, with llama.cpp's
    whitespace set. Control (type 3), user-defined (4) and unknown (2) tokens are specials, matched
    whole in the text before BPE, longest first (user-defined ones even with parse_special off).
    Letter, number and punctuation classes come from the `regex` package, whose Unicode is newer
    than llama.cpp's tables (15.1): characters assigned after 15.1 may split differently there.

    Differs from transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`)
    on purpose: for `smollm` transformers skips the digit split (it runs the gpt-2 rules alone), so
    whitespace right before a number character can tokenize differently there: a run of two or more
    ("a  1": llama.cpp "a","  ","1"; transformers "a"," "," 1"), or one space before a digit the
    vocabulary merges with it (" ٦"). This class follows llama.cpp, as SmolLM2's tokenizer.json does.
    Also unlike llama.cpp, a file without bos/eos ids gets None, not llama.cpp's default 11.
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None, *,
                 model: str = "gpt2", pre: str | None = "default", bos_id: int | None = None,
                 eos_id: int | None = None, unk_id: int | None = None, pad_id: int | None = None,
                 eot_id: int | None = None, add_bos: bool | None = None, chat_template: str | None = None):
        if model not in SUPPORTED_GGUF_MODELS:
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported; "
                             f"supported: {list(SUPPORTED_GGUF_MODELS)}")
        pre = pre or "default"  # llama.cpp's fallback for a file without tokenizer.ggml.pre
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; "
                             f"supported: {list(SUPPORTED_PRE_TOKENIZERS)}")
        if token_types is not None and len(token_types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries, tokens has {len(tokens)}")
        self.model, self.pre = model, pre
        rules, self._ignore_merges, default_add_bos = _PRE_TOKENIZERS[pre]
        self._rules = _compiled_rules(rules)
        self._tokens = list(tokens)
        self._types = list(token_types) if token_types is not None else [_NORMAL] * len(tokens)
        self._merges = list(merges)
        self.vocab_size = len(self._tokens)
        self._vocab = {t: i for i, t in enumerate(self._tokens)}  # a repeated text keeps its last id, as in llama.cpp
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(self._merges):
            self._ranks.setdefault(self._merge_pair(merge), rank)  # a repeated merge keeps its first rank
        for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("unk_id", unk_id), ("pad_id", pad_id),
                        ("eot_id", eot_id)):
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"{name} {v} is outside the vocabulary (size {self.vocab_size})")
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.eot_id = eot_id if eot_id is not None else next(
            (self._vocab[t] for t in _EOT_TEXTS if t in self._vocab), None)
        self.eos_ids = tuple(dict.fromkeys(i for i in (eos_id, self.eot_id) if i is not None))
        self.add_bos = default_add_bos if add_bos is None else bool(add_bos)
        self.chat_template = chat_template
        self._special = self._special_ids()
        # llama.cpp tries longer specials first; equal lengths by id (its sort is unstable)
        self._specials = sorted(self._special, key=lambda i: (-len(self._tokens[i].encode()), i))
        self._to_byte_char = str.maketrans({i: c for i, c in enumerate(_byte_chars())})
        self._from_byte_char = {c: b for b, c in enumerate(_byte_chars())}
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        self._id_bytes: dict[int, bytes] = {}

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "GGUFTokenizer":
        """From GGUF metadata already read (key -> plain value, e.g. "tokenizer.ggml.tokens" -> list[str])."""
        def get(key, default=None):
            return metadata.get(f"tokenizer.ggml.{key}", default)

        for key in ("model", "tokens", "merges"):
            if get(key) is None:
                raise ValueError(f"GGUF metadata has no tokenizer.ggml.{key}")
        return cls(get("tokens"), get("merges"), get("token_type"), model=get("model"), pre=get("pre"),
                   bos_id=get("bos_token_id"), eos_id=get("eos_token_id"), unk_id=get("unknown_token_id"),
                   pad_id=get("padding_token_id"), eot_id=get("eot_token_id"), add_bos=get("add_bos_token"),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> "GGUFTokenizer":
        """From a .gguf file's tokenizer.* fields (read with gguf.GGUFReader)."""
        GGUFReader = gguf_reader.gguf_package().GGUFReader

        try:
            reader = GGUFReader(str(path))
        except Exception as e:  # the reader raises ValueError/struct/IndexError on truncated or corrupt files
            raise ValueError(f"GGUF file {str(path)!r} cannot be parsed (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from None
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        try:
            return cls.from_metadata(meta)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def metadata(self) -> dict[str, Any]:
        """The tokenizer.* metadata this tokenizer was built from (plain values, GGUF key names)."""
        meta = {"tokenizer.ggml.model": self.model, "tokenizer.ggml.pre": self.pre,
                "tokenizer.ggml.tokens": list(self._tokens), "tokenizer.ggml.merges": list(self._merges),
                "tokenizer.ggml.token_type": list(self._types), "tokenizer.ggml.add_bos_token": self.add_bos}
        for key, v in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id),
                       ("unknown_token_id", self.unk_id), ("padding_token_id", self.pad_id),
                       ("eot_token_id", self.eot_id)):
            if v is not None:
                meta[f"tokenizer.ggml.{key}"] = v
        if self.chat_template is not None:
            meta["tokenizer.chat_template"] = self.chat_template
        return meta

    def save(self, folder: str | pathlib.Path) -> pathlib.Path:
        """Writes the metadata as JSON (`GGUF_TOKENIZER_FILE`) into folder, which load_tokenizer(folder)
        reads back. JSON, not a vocab-only GGUF: gguf's reader takes ~2.7 s to parse SmolLM2's
        vocabulary, json ~0.1 s, and this file is read on every cached load."""
        path = pathlib.Path(folder) / GGUF_TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.metadata(), ensure_ascii=False), encoding="utf-8")
        return path

    # -- vocabulary ----------------------------------------------------------------------------

    @staticmethod
    def _merge_pair(merge: str) -> tuple[str, str]:
        # llama.cpp splits at the first space after the first character
        cut = merge.find(" ", 1)
        return (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")

    def _special_ids(self) -> frozenset[int]:
        kinds = (_CONTROL, _USER_DEFINED, _UNKNOWN)
        return frozenset(i for i, (t, k) in enumerate(zip(self._tokens, self._types))
                         if t and (k in kinds or (t in _CONTROL_BY_TEXT and self._vocab.get(t) == i)))

    def _is_control(self, i: int) -> bool:
        """Control or unknown: what parse_special=False and skip_special_tokens leave out."""
        return i in self._special and self._types[i] != _USER_DEFINED

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry for id i as stored (byte-level spelling, e.g. 'Ġthe')."""
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return self._tokens[i]

    @functools.cached_property
    def unspellable_bytes(self) -> frozenset[int]:
        """Bytes with no single-byte token: where BPE leaves one alone, encode drops it (as llama.cpp
        does), so text containing them does not round-trip. SmolLM2 lacks 0x04, 0x06, 0x13, 0x14,
        0x16, 0x1D and lead bytes of no or unassigned characters (0xC0, 0xC1, 0xF1, 0xF2, 0xF5-0xFF)."""
        return frozenset(b for b, c in enumerate(_byte_chars()) if c not in self._vocab)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry spelled as stored, or None."""
        return self._vocab.get(token)

    # -- encode --------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text, as llama.cpp's llama_tokenize(text, add_special=add_bos, parse_special).

        add_bos prepends bos_id (if the vocabulary has one). With parse_special, control tokens
        written in the text (e.g. "<|im_end|>") become their ids; without it they are tokenized as
        text. User-defined tokens are matched either way."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._encode_plain(fragment))
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Text cut around special tokens (llama.cpp's tokenizer_st_partition: each special in turn,
        longest first, splits the text fragments left so far)."""
        fragments: list[str | int] = [text] if text else []
        for sid in self._specials:
            if not parse_special and self._is_control(sid):
                continue
            piece = self._tokens[sid]
            if not any(isinstance(f, str) and piece in f for f in fragments):
                continue
            out: list[str | int] = []
            for f in fragments:
                if isinstance(f, int) or piece not in f:
                    out.append(f)
                    continue
                for n, part in enumerate(f.split(piece)):
                    if n:
                        out.append(sid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def _encode_plain(self, text: str) -> list[int]:
        pieces = [text]
        for pattern in self._rules:
            pieces = _split_keep_gaps(pattern, pieces)
        cache, ids = self._piece_cache, []
        for piece in pieces:
            got = cache.get(piece)
            if got is None:
                if len(cache) >= _PIECE_CACHE_MAX:
                    cache.clear()
                got = cache[piece] = self._bpe_ids(piece)
            ids.extend(got)
        return ids

    def _bpe_ids(self, piece: str) -> tuple[int, ...]:
        word = piece.encode("utf-8", "surrogatepass").decode("latin-1").translate(self._to_byte_char)
        if self._ignore_merges and word in self._vocab:
            return (self._vocab[word],)
        ids = []
        for sym in self._bpe(word):
            i = self._vocab.get(sym)
            if i is not None:
                ids.append(i)
            else:  # llama.cpp's fallback: single-byte tokens, dropping bytes it cannot spell
                ids.extend(self._vocab[c] for c in sym if ord(c) < 0x80 and c in self._vocab)
        return tuple(ids)

    def _bpe(self, word: str) -> list[str]:
        """word's symbols after merging, lowest rank first and leftmost on ties (llama.cpp's queue)."""
        n = len(word)
        if n < 2:
            return [word] if word else []
        text, nxt, prv = list(word), list(range(1, n + 1)), list(range(-1, n - 1))
        nxt[-1] = -1
        ranks, heap = self._ranks, []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((text[left], text[right]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, text[left] + text[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not text[left] or not text[right] or text[left] + text[right] != merged:
                continue  # stale: one side has changed since this pair was queued
            text[left], text[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        return [t for t in text if t]

    # -- decode --------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ids; decode(encode(s)) == s for every str s whose bytes the vocabulary can spell
        (see unspellable_bytes: encode drops those, as llama.cpp does).

        Byte-level tokens are joined as bytes and read as UTF-8 once, so a character split over
        several tokens comes back whole. Bytes that are not valid UTF-8 (e.g. ids cut in the middle
        of a character, as while streaming) each become U+FFFD. skip_special_tokens leaves out
        control and unknown tokens (user-defined ones stay)."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            if skip_special_tokens and self._is_control(i):
                continue
            data += self._token_bytes(i)
        try:
            return data.decode("utf-8", "surrogatepass")  # surrogatepass: lone surrogates round-trip
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes id i stands for in text (a special token: its text)."""
        return self._token_bytes(i)

    def is_special(self, i: int) -> bool:
        """Control or unknown: not text (a grammar never spells it)."""
        return self._is_control(i)

    def _token_bytes(self, i: int) -> bytes:
        got = self._id_bytes.get(i)
        if got is None:
            text = self._tokens[i]
            if i in self._special:
                got = text.encode("utf-8", "surrogatepass")
            elif self._types[i] == _BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                got = bytes([int(text[3:5], 16)])
            else:  # a character outside GPT-2's byte alphabet stands for itself
                table = self._from_byte_char
                got = b"".join(bytes([table[c]]) if c in table else c.encode("utf-8", "surrogatepass")
                               for c in text)
            self._id_bytes[i] = got
        return got

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """The conversation rendered with tokenizer.chat_template (or chat_template), as transformers'
        apply_chat_template(..., tokenize=False) renders it: bos_token, eos_token, unk_token and
        pad_token are template variables; kwargs are passed to the template and win over them."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is not in its GGUF)")
        return render_chat_template(template, messages, add_generation_prompt, tools,
                                    **{**self.template_variables(), **kwargs})

    def template_variables(self) -> dict[str, str]:
        """The special tokens a chat template may use: bos_token, eos_token, unk_token, pad_token."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id,
                 "pad_token": self.pad_id}
        return {k: self._tokens[v] for k, v in names.items() if v is not None}


GGUF_TOKENIZER_FILE = "tokenizer_gguf.json"  # GGUF tokenizer.* metadata, key -> plain value


# ---------------------------------------------------------------------------------------------
# chat templates (jinja2, set up the way transformers' chat_template_utils does)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _compiled_chat_template(template: str):
    import datetime
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, and the json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages as plain dicts, None-valued keys dropped (as transformers does); ValueError names
    the message index and the field at fault."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message (as in transformers)")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{n}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = "missing" if m.get(field) is None else type(m[field]).__name__
                raise ValueError(f"messages[{n}]['{field}'] must be a str, got {got}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                         tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
    """template rendered for messages with jinja2 the way transformers renders chat templates
    (sandboxed, trim_blocks, lstrip_blocks, raise_exception, strftime_now, its tojson)."""
    if tools is not None:
        tools = list(tools)
        for n, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools[{n}] must be a JSON-schema dict, got {type(tool).__name__}")
    variables.setdefault("documents", None)
    import jinja2

    try:
        return _compiled_chat_template(template).render(messages=_checked_messages(messages), tools=tools,
                                                        add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:  # e.g. the template's raise_exception("...roles must alternate...")
        raise ValueError(f"chat template: {e}") from None


def chat_text(tok: Tokenizer, template: str, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt text of a chat under `template`: the tokenizer's own apply_chat_template when it is
    the tokenizer's own template, else render_chat_template (with the tokenizer's special tokens as
    variables where it names them: `template_variables`). ValueError when the template refuses the
    messages."""
    if hasattr(tok, "apply_chat_template") and template == getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    variables = tok.template_variables() if hasattr(tok, "template_variables") else {}
    return render_chat_template(template, messages, True, tools, **variables)


def load_tokenizer(checkpoint_dir: str | pathlib.Path | None = None, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer:
    """A .gguf file's tokenizer; else the folder's tokenizer.json, else its GGUF tokenizer metadata
    (what GGUFTokenizer.save writes); else the byte-level tokenizer."""
    if checkpoint_dir is None:
        return ByteTokenizer()
    path = pathlib.Path(checkpoint_dir)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFTokenizer.from_gguf(path)
    if (path / "tokenizer.json").exists():
        saved = json.loads((path / HF_IDS_FILE).read_text()) if (path / HF_IDS_FILE).exists() else {}
        return HFTokenizer(path / "tokenizer.json", saved.get("bos_id", bos_id), saved.get("eos_id", eos_id))
    if (path / GGUF_TOKENIZER_FILE).exists():
        return GGUFTokenizer.from_metadata(json.loads((path / GGUF_TOKENIZER_FILE).read_text(encoding="utf-8")))
    return ByteTokenizer()
