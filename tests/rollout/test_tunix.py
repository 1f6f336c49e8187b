"""The Tunix rollout engine (rollout/tunix_rollout.py) against Tunix's own vanilla sampler and its
`compute_per_token_logps`, on the same tiny Llama3 and Qwen3 weights, and inside Tunix's GRPO learner."""
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix")
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

from talaria_jax.rollout import SpecConfig  # noqa: E402
from talaria_jax.rollout.tunix_rollout import TalariaRollout, config_from_tunix, params_from_tunix  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import tunix_grpo  # noqa: E402

TOK = tunix_grpo.CharTokenizer()
PROMPTS = ["q: 2+2=? a:", "abc", "hello world, again", "x", "abc"]
MAX_TOKENS = 12


def tiny(family, seed=0, vocab=tunix_grpo.VOCAB):
    if family == "llama3":  # rope_theta as Llama-3's config says; Tunix 0.1.7's forward ignores it
        cfg = llama3.ModelConfig(num_layers=2, vocab_size=vocab, embed_dim=32, hidden_dim=64, num_heads=4,
                                 head_dim=8, num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5, weight_tying=False)
        return tunix_grpo.randomize(llama3.Llama3(cfg, rngs=nnx.Rngs(seed)), seed, scale=0.2)
    cfg = qwen3.ModelConfig(num_layers=2, vocab_size=vocab, embed_dim=32, hidden_dim=64, num_heads=4,
                            head_dim=8, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True)
    return tunix_grpo.randomize(qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed)), seed, scale=0.2)


def config(kv_cache_size=64):
    # top_p=None: Tunix's sampler is greedy only without top_p (with it, temperature 0 divides by zero)
    return base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, max_prompt_length=32,
                                      kv_cache_size=kv_cache_size, temperature=0.0, top_p=None, return_logprobs=True)


def vanilla(model):
    c = model.config
    return vanilla_rollout.VanillaRollout(model, TOK, base_rollout.CacheConfig(64, c.num_layers, c.num_kv_heads,
                                                                               c.head_dim))


def ours(model, kv_cache_size=64, **kw):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    return TalariaRollout(model, TOK, mesh, config(kv_cache_size), replicas=2, max_seqs=4, **kw)


def padded(tokens):
    out = np.zeros((len(tokens), MAX_TOKENS), np.int32)
    for i, t in enumerate(tokens):
        out[i, :len(t)] = t
    return out


@pytest.mark.parametrize("family,seed,speculate", [("llama3", 1, False), ("llama3", 1, True), ("qwen3", 2, False)])
def test_greedy_tokens_and_logprobs_match_tunix(family, seed, speculate):
    model = tiny(family, seed)
    spec = SpecConfig(max_spec_tokens=4, policy="always") if speculate else None
    want = vanilla(model).generate(PROMPTS, config())
    # Tunix's sampler hides a sampled pad id from attention afterwards (llama3 seed 0 emits one), ours
    # does not: weights whose greedy outputs hold no pad (a trained model's never do)
    assert not any(TOK.pad_id() in t.tolist() for t in want.tokens)
    rollout = ours(model, speculation=spec)
    try:
        got = rollout.generate(PROMPTS, config())
        again = rollout.generate(PROMPTS, config())  # the second pass drafts from the first's outputs
        accepted = sum(r["accepted_tokens"] for r in rollout.service.stats()["replicas"])
        assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
        assert [t.tolist() for t in again.tokens] == [t.tolist() for t in want.tokens]
        assert got.text == want.text and any(got.text)
        # one str is one prompt, as Tunix's sampler takes it (its agentic learner passes a conversation so)
        assert rollout.generate(PROMPTS[2], config()).text == [want.text[2]]
        np.testing.assert_array_equal(got.left_padded_prompt_tokens, want.left_padded_prompt_tokens)
        assert (accepted > 0) == speculate
        # per-token logprobs: ours (engine forward), Tunix's compute_per_token_logps, and the sampled ones
        prompt, completion = jnp.asarray(want.left_padded_prompt_tokens), jnp.asarray(padded(want.tokens))
        theirs = np.asarray(vanilla(model).get_per_token_logps(prompt, completion))
        mine = np.asarray(rollout.get_per_token_logps(prompt, completion))
        mask = np.asarray(completion) != TOK.pad_id()
        assert mask.sum() > 20
        np.testing.assert_allclose(mine[mask], theirs[mask], atol=1e-4)
        for i, t in enumerate(want.tokens):
            np.testing.assert_allclose(got.logprobs[i], theirs[i, :len(t)], atol=1e-4)
            np.testing.assert_allclose(again.logprobs[i], theirs[i, :len(t)], atol=1e-4)
    finally:
        rollout.close()


def test_update_params_takes_effect_and_reuses_nothing_stale():
    old, new = tiny("llama3", seed=0), tiny("llama3", seed=7)
    rollout = ours(old, speculation=SpecConfig(max_spec_tokens=4, policy="always"))
    try:
        before = rollout.generate(PROMPTS, config())
        rollout.update_params(nnx.state(new, nnx.Param))
        after = rollout.generate(PROMPTS, config())
        want = vanilla(new).generate(PROMPTS, config())
        assert [t.tolist() for t in after.tokens] == [t.tolist() for t in want.tokens]
        assert [t.tolist() for t in after.tokens] != [t.tolist() for t in before.tokens]
        assert rollout.weight_version == 1
        # a part of the parameters (Tunix's learner may sync a filtered state) keeps the rest
        rollout.update_params({"final_norm": {"w": jnp.full((32,), 2.0)}})
        assert rollout.weight_version == 2
        np.testing.assert_array_equal(rollout._engines[1].model.param_arrays()["final_norm"], 2.0)
    finally:
        rollout.close()


def test_multi_turn_calls_find_their_trajectory_kv():
    """Tunix's agentic learner calls generate with one conversation at a time, each turn's prompt the
    whole conversation so far, from many trajectories at once: placement by cached prefix sends each
    turn where its earlier turns' KV is, so a later turn reuses every full page of what came before."""
    # a vocabulary the tokenizer spells whole (BOS, EOS and pad aside): the text of a turn tokenizes back
    # to its ids, as a real tokenizer's does
    rollout = ours(tiny("llama3", 1, vocab=3 + len(tunix_grpo.CHARS)), kv_cache_size=256)
    page = rollout._engines[0].page_size
    try:
        convs = [f"q: {a}+{b}=? a:" for a, b in [(1, 2), (30, 4), (5, 60), (7, 8)]]
        expected = 0
        for turn in range(3):
            cached = rollout.service.counts["cached_tokens"]
            outs = {}
            threads = [threading.Thread(target=lambda i=i: outs.update({i: rollout.generate([convs[i]], config(256))}))
                       for i in range(len(convs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            if turn:
                got = rollout.service.counts["cached_tokens"] - cached
                assert got >= 0.9 * expected > 0, (turn, got, expected)
            expected = 0
            for i, out in outs.items():
                done = rollout._tokenize(convs[i]) + out.tokens[0].tolist()
                convs[i] += out.text[0] + " tool: ok. a:"
                # the next prompt starts with `done` up to any id the text does not spell; every full page
                # of that (short of the last token, whose KV may not exist) was computed on one replica
                nxt = rollout._tokenize(convs[i])
                common = next((k for k, (a, b) in enumerate(zip(done, nxt)) if a != b), min(len(done), len(nxt)))
                expected += min(common, len(done) - 1) // page * page
    finally:
        rollout.close()


def test_unmapped_models_and_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="mapped families are Llama3 and Qwen3"):
        config_from_tunix(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="'layers.0.attn.q_proj.lora_a' has no counterpart"):
        params_from_tunix({"layers": {0: {"attn": {"q_proj": {"lora_a": np.zeros(2)}}}}})
    cfg = config_from_tunix(tiny("llama3"))
    assert (cfg.rope_theta, cfg.hidden_size, cfg.ffn_size, cfg.tie_embeddings) == (1e6, 32, 64, False)


@pytest.mark.slow
def test_tunix_grpo_learner_learns_with_this_rollout_engine():
    rewards = tunix_grpo.train("talaria", steps=6, log=lambda *a: None)
    assert len(rewards) == 6
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.2, rewards


