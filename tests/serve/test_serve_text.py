"""The instance server's per-choice text (`serve.app._Choice`) against whole-text reference: stop
strings cut where a whole-text search cuts, whatever the update sizes, and the deltas a stream sends
add up to the final text without ever showing a stop string. No model: outputs built by hand."""
import asyncio
import random

import pytest

from talaria_jax.engine.engine import RequestOutput
from talaria_jax.serve import app, protocol
from talaria_jax.tokenizer import ByteTokenizer

TEXTS = ["The answer is 42. Done.\nNext line", "aaaaabaaaab", "héllo wörld ✓ ok", "no stop here at all"]
STOPS = [[], ["."], ["Done", "\n"], ["aab"], ["ab", "aaaab"], ["wörld"], ["✓ ok"], ["zzz"], ["o w", "l"]]


def _reference(text: str, stops: list[str], steps: list[int]) -> str:
    """The text at the first update where some stop string is in it, cut at its earliest match."""
    seen = 0
    for end in steps:
        seen = end
        found = [k for k in (text[:end].find(s) for s in stops) if k >= 0]
        if found:
            return text[:min(found)]
    return text[:seen]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stops", STOPS)
def test_stop_strings_cut_like_a_whole_text_search(text, stops):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    rng = random.Random(hash((text, tuple(stops))) % 1000)
    p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                             **({"stop": stops} if stops else {})}, protocol.Limits())
    for _ in range(5):
        c = app._Choice(0, "r", asyncio.Queue(), p, tok)
        i, sent, char_ends = 0, "", []
        while not c.done:
            i = min(len(ids), i + rng.choice([1, 1, 2, 3, 7]))
            out = RequestOutput("r", (1,), ids[:i], [0.0] * i, [], "length" if i == len(ids) else None, [], ids[:i], tok)
            c.update(out)
            char_ends.append(len(tok.decode(ids[:i]).rstrip("\ufffd")))  # whole characters only
            d = c.delta()
            sent += d
            assert not any(s in sent for s in stops), (sent, stops)
        assert c.text == _reference(text, stops, char_ends)
        assert sent == c.text  # what a stream sends adds up to the final text
        assert c.finish_reason == ("stop" if c.stopped else "length")
        assert c.stopped == any(s in c.text + text[len(c.text):char_ends[-1]] for s in stops)
