"""The compiled suffix drafter against the Python one, its reference: the same drafts (tokens, parents,
probabilities as float32, score, match length, all bit for bit) over random extends, removals, requests
finished and evicted, chain and tree drafts, several configurations and floors. Small vocabularies, so
substrings repeat and counts tie."""
import copy
import os
import pickle

import numpy as np
import pytest

from talaria_jax.engine.spec import suffix
from talaria_jax.engine.spec.suffix import SpecConfig, SuffixDrafter, SuffixTree, TokenScan

native = suffix.native
# `make test` requires the build (TALARIA_REQUIRE_NATIVE=1): a failed build then fails here, not skips
REQUIRED = os.environ.get("TALARIA_REQUIRE_NATIVE") == "1"
pytestmark = pytest.mark.skipif(native is None and not REQUIRED, reason="the compiled suffix drafter (talaria_jax."
                                f"engine.spec._suffix_native) is not built: {suffix.NATIVE_ERROR}")


def test_the_compiled_drafter_is_built_where_required():
    assert native is not None, f"the compiled suffix drafter did not build: {suffix.NATIVE_ERROR}"


def test_bad_input_is_an_error_not_a_crash():
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        native.Tree(0)
    d = SuffixDrafter(SpecConfig())
    d.start("r", [1, 2])
    with pytest.raises(ValueError, match="int32"):
        d.extend("r", [2**40])
    with pytest.raises(ValueError, match="finite"):
        SpecConfig(max_spec_factor=float("inf")).validate()
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(d)
    py = SuffixDrafter(SpecConfig(), backend="python")
    py.start("r", [1, 2, 3, 1, 2])
    assert type(pickle.loads(pickle.dumps(py))) is SuffixDrafter  # keeps its backend

CONFIGS = [SpecConfig(),
           SpecConfig(tree=True),
           SpecConfig(max_depth=4, min_token_prob=0.0, max_spec_factor=4.0, max_spec_tokens=31),
           SpecConfig(max_depth=6, tree=True, min_token_prob=0.0, max_spec_factor=2.0, max_spec_offset=1.0),
           SpecConfig(max_depth=8, tree=True, min_token_prob=0.1, max_spec_factor=3.0, max_spec_tokens=12),
           SpecConfig(max_depth=5, min_token_prob=0.1, max_spec_factor=0.5, max_spec_offset=2.0),
           SpecConfig(max_depth=64, tree=True, min_token_prob=0.0, max_spec_factor=1.5, max_spec_tokens=31)]


def as_tuple(d):
    """A draft's fields, exactly (probs as their float32 bits)."""
    return (d.tokens.astype(np.int32).tolist(), d.parents.astype(np.int32).tolist(),
            np.asarray(d.probs, np.float32).view(np.int32).tolist(), float(d.score), int(d.match_len))


def native_tuple(t):
    toks, parents, probs, score, match_len = t
    return toks.tolist(), parents.tolist(), probs.view(np.int32).tolist(), score, match_len


def cfg_args(cfg):
    return dict(max_spec_tokens=cfg.max_spec_tokens, max_spec_factor=cfg.max_spec_factor,
                max_spec_offset=cfg.max_spec_offset, min_token_prob=cfg.min_token_prob, tree=cfg.tree)


def patterns(rng, seqs, vocab):
    """Patterns to draft after: ends of sequences (the usual case), their middles, random tokens, and a
    sequence's end behind tokens from elsewhere."""
    out = []
    for toks in seqs:
        if toks:
            k = int(rng.integers(1, 12))
            out.append(toks[-k:])
            i = int(rng.integers(0, len(toks)))
            out.append(toks[max(0, i - k):i + 1])
            out.append(rng.integers(0, vocab, int(rng.integers(1, 5))).tolist() + toks[-int(rng.integers(1, 70)):])
    out.append(rng.integers(0, vocab, int(rng.integers(1, 80))).tolist())
    return out


@pytest.mark.parametrize("cfg", CONFIGS)
def test_the_trie_drafts_like_the_python_one(cfg):
    rng = np.random.default_rng(abs(hash((cfg.max_depth, cfg.tree, cfg.min_token_prob))) % 2**32)
    cases = 0
    for trial in range(12):
        vocab = int(rng.integers(2, 7))
        py, nat, seqs = SuffixTree(cfg.max_depth), native.Tree(cfg.max_depth), {}
        for step in range(60):
            op = rng.random()
            if op < 0.1 and seqs:  # a removal
                sid = int(rng.choice(list(seqs)))
                py.remove(sid)
                nat.remove(sid)
                del seqs[sid]
            else:  # an extend: a new sequence or more of one, often repeating text seen before
                sid = int(rng.integers(0, 6))
                n = int(rng.integers(1, 4 if rng.random() < 0.7 else 40))
                if seqs and rng.random() < 0.4:
                    src = seqs[int(rng.choice(list(seqs)))]
                    i = int(rng.integers(0, max(1, len(src))))
                    toks = (src[i:i + n] or [0])
                else:
                    toks = rng.integers(0, vocab, n).tolist()
                py.extend(sid, toks)
                nat.extend(sid, np.asarray(toks) if rng.random() < 0.5 else toks)
                seqs.setdefault(sid, []).extend(toks)
            assert py.num_tokens == nat.num_tokens and py.num_nodes == nat.num_nodes
            assert all((s in py) == (s in nat) for s in range(7))
            for pattern in patterns(rng, list(seqs.values()), vocab):
                assert [(py.depth(m), py.ops.count(m)) for m in py.match(pattern)] == nat.match(pattern)
                limit = int(rng.integers(1, cfg.max_spec_tokens + 1))
                floor = float(rng.choice([0.0, 0.0, 0.3, 1.0, 2.5]))
                sid = int(rng.integers(0, 7)) if rng.random() < 0.5 else None  # match_own's seq_id, or none
                a = py.draft(pattern, limit, cfg, sid, floor)
                b = nat.draft(pattern, limit, seq_id=sid, floor=floor, **cfg_args(cfg))
                assert as_tuple(a) == native_tuple(b), (trial, step, pattern, limit, sid, floor)
                cases += 1
    assert cases > 2000


@pytest.mark.parametrize("cfg", CONFIGS)
def test_the_scan_drafts_like_the_python_one(cfg):
    rng = np.random.default_rng(cfg.max_depth * 7 + cfg.tree)
    for trial in range(40):
        vocab = int(rng.integers(2, 6))
        text = rng.integers(0, vocab, int(rng.integers(1, 300))).tolist()
        py, nat = TokenScan(text, cfg.max_depth), native.Scan(text, cfg.max_depth)
        for step in range(8):
            more = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
            if rng.random() < 0.5 and len(text) > 10:  # a repeat: long matches
                i = int(rng.integers(0, len(text) - 5))
                more += text[i:i + int(rng.integers(1, 80))]
            py.extend(more)
            nat.extend(more)
            text += more
            for pattern in patterns(rng, [text], vocab):
                limit = int(rng.integers(1, cfg.max_spec_tokens + 1))
                floor = float(rng.choice([0.0, 0.0, 0.5, 2.0]))
                a = py.draft(pattern, limit, cfg, floor)
                b = nat.draft(pattern, limit, floor=floor, **cfg_args(cfg))
                assert as_tuple(a) == native_tuple(b), (trial, step, pattern, limit, floor)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS] + [SpecConfig(max_depth=6, max_cached_tokens=40, tree=True,
                                                                   min_token_prob=0.0, max_prompt_tokens=20)])
def test_the_drafter_drafts_like_the_python_one(cfg):
    """Requests of several tenants started, extended (one token or several), drafted in batches with
    per-request caps, finished; the finished ones evicted past a small max_cached_tokens."""
    cfg = SpecConfig(**{**cfg.__dict__, "max_cached_tokens": min(cfg.max_cached_tokens, 300)})
    rng = np.random.default_rng(cfg.max_depth + 100 * cfg.tree)
    py, nat = SuffixDrafter(cfg, backend="python"), SuffixDrafter(cfg, backend="native")
    assert py.backend == "python" and nat.backend == "native"
    texts: dict[str, list[int]] = {}
    tenants = ["a", "b", None]
    vocab, n_ids, cases = 4, 0, 0
    for step in range(400):
        op = rng.random()
        if op < 0.08 or not texts:
            rid, n_ids = f"r{n_ids}", n_ids + 1
            if rng.random() < 0.1 and n_ids > 2:  # an id used before (finished, maybe still cached)
                rid = f"r{int(rng.integers(0, n_ids - 1))}"
            prompt = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
            tenant = tenants[int(rng.integers(0, 3))]
            py.start(rid, prompt, tenant=tenant)
            nat.start(rid, prompt, tenant=tenant)
            texts[rid] = list(prompt)
        elif op < 0.14:
            rid = list(texts)[int(rng.integers(0, len(texts)))]
            py.finish(rid)
            nat.finish(rid)
            del texts[rid]
            assert py.num_cached_tokens() == nat.num_cached_tokens()
            for t in py.global_trees:
                assert all((r in py.global_trees[t]) == (r in nat.global_trees[t]) for r in
                           (f"r{i}" for i in range(n_ids)))
        else:
            rids = list(texts)
            if rng.random() < 0.5:  # a decode step: a token for each
                toks = []
                for rid in rids:  # mostly what an earlier text had after the same token
                    src = texts[list(texts)[int(rng.integers(0, len(texts)))]]
                    tok = int(rng.integers(0, vocab))
                    if src and rng.random() < 0.7:
                        i = int(rng.integers(0, len(src)))
                        tok = src[i]
                    toks.append(tok)
                    py.extend(rid, (tok,))
                    texts[rid].append(tok)
                nat.extend_batch(rids, toks)
            else:
                for rid in rids:
                    more = rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
                    py.extend(rid, more)
                    nat.extend(rid, more)
                    texts[rid] += more
            caps = rng.integers(-1, cfg.max_spec_tokens + 3, len(rids)).tolist() if rng.random() < 0.5 else None
            a, b = py.draft(rids, caps), nat.draft(rids, caps)
            assert len(a) == len(b) == len(rids)
            for rid, x, y in zip(rids, a, b):
                assert as_tuple(x) == as_tuple(y), (step, rid)
            cases += len(rids)
    assert cases > 500
    assert py.num_cached_tokens() == nat.num_cached_tokens()


def test_the_backends_are_chosen_and_checked():
    assert isinstance(SuffixDrafter(SpecConfig()), suffix.NativeSuffixDrafter)  # auto: native where built
    assert type(SuffixDrafter(SpecConfig(), backend="python")) is SuffixDrafter
    with pytest.raises(ValueError):
        SuffixDrafter(SpecConfig(), backend="cuda")
    d = SuffixDrafter(SpecConfig(max_cached_tokens=12, max_spec_factor=4.0))
    d.start("a", [1, 2], tenant="t1")
    with pytest.raises(KeyError):
        d.draft(["a", "nope"])
    assert [len(x) for x in d.draft(["a", "nope"], [4, 0])] == [0, 0]  # no draft asked for: no lookup
