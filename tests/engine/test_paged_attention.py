"""Query tiles of the paged attention: host-side grouping by hand, and equal outputs for any tile size."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine.paged_attention import AttentionMetadata, ragged_paged_attention
from talaria_jax.engine.runner import TileRules, query_tiles, seq_runs, single_token_tiles


def test_query_tiles_by_hand():
    seq = np.array([0, 0, 0, 0, 0, 2, 1, 1, 0, 0], np.int32)  # 8 real tokens: runs of 5, 1, 2; 2 padding
    runs = seq_runs(seq, 8)
    assert runs == [(0, 0, 5), (2, 5, 6), (1, 6, 8)]
    tile_tok, tile_seq, tok_slot = query_tiles(runs, 10, 2, 6)
    assert tile_tok.tolist() == [[0, 1], [2, 3], [4, 10], [5, 10], [6, 7], [10, 10]]
    assert tile_seq.tolist() == [0, 0, 0, 2, 1, 0]
    assert tok_slot.tolist() == [0, 1, 2, 3, 4, 6, 8, 9, 12, 12]  # padding -> slot 6 x 2, the zero row
    with pytest.raises(ValueError, match="more than 4 query tiles of 2"):
        query_tiles(runs, 10, 2, 4)
    for got, want in zip(single_token_tiles(seq, 8), query_tiles(runs, 10, 1, 10)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rules", [
    TileRules(256, 16, 16),  # talaria-serve's: no step of 17+ tokens is all one-token runs
    TileRules(64, 6, 8, query_tile=8),
    TileRules(256, 64, 16),  # more sequences than a bucket's tokens: one-token tiles up to 64
    TileRules(100, 7, 8, query_tile=8),  # a budget that is no power of two nor a multiple of the tile
    TileRules(128, 16, 16, whole_step_tile=False, smallest_bucket=2),  # the Pallas kernel's, on a GPU
])
def test_every_step_takes_a_compiled_shape(rules):
    """`TileRules.shapes` (what warm-up compiles) holds the shape of every step a runner can take, and
    only those: a shape no step takes is a program compiled for nothing."""
    rng, shapes, taken = np.random.RandomState(0), rules.shapes(), set()
    for i in range(20000):
        cap = rng.choice(rules.buckets)  # steps of every bucket, with few sequences or many
        seqs = rng.randint(1, min(rules.max_seqs, cap) + 1)
        total = seqs if i % 4 == 0 else cap if i % 4 == 1 else rng.randint(seqs, cap + 1)
        runs = 1 + rng.multinomial(total - seqs, rng.dirichlet(np.ones(seqs) * rng.choice([0.05, 0.3, 1, 5])))
        taken.add(rules.shape(runs.tolist()))
    assert taken <= set(shapes) and len(shapes) == len(set(shapes))
    assert taken == set(shapes)
    if rules.max_seqs == 16 and rules.whole_step_tile:
        assert len(shapes) == 20 and (32, 1, 32) not in shapes and (16, 1, 16) in shapes


@pytest.mark.parametrize("window", [0, 5])
def test_any_tile_size_gives_the_same_attention(window):
    rng = np.random.RandomState(0)
    pages, ps, kvh, g, d = 12, 4, 2, 2, 8
    pool_k = jnp.asarray(rng.randn(pages, ps, kvh, d), jnp.float32)
    pool_v = jnp.asarray(rng.randn(pages, ps, kvh, d), jnp.float32)
    page_tables = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 8, 10]], jnp.int32)
    # seq 1: a 7-token chunk at positions 6..12; seq 0: one decode token at 9; seq 2: 3 tokens at 0..2; 3 padding
    seq = np.array([1] * 7 + [0] + [2] * 3 + [0] * 3, np.int32)
    pos = jnp.asarray(list(range(6, 13)) + [9] + [0, 1, 2] + [0] * 3, jnp.int32)
    q = jnp.asarray(rng.randn(len(seq), kvh * g, d), jnp.float32)
    runs = seq_runs(seq, 11)
    outs = []
    for tile, n in [(1, 14), (3, 6), (4, 5), (7, 3)]:
        tt, ts, slot = query_tiles(runs, len(seq), tile, n)
        meta = AttentionMetadata(page_tables, pos, jnp.asarray(tt), jnp.asarray(ts), jnp.asarray(slot), jnp.int32(2))
        outs.append(np.asarray(ragged_paged_attention(q, lambda p: (pool_k[p], pool_v[p]), kvh, ps, meta, 2, window)))
    # a direct softmax for one token: seq 1 at position 12 sees keys 0..12 of its pages (5, 2, 9, 11)
    keys = np.asarray(pool_k)[[5, 2, 9, 11]].reshape(16, kvh, d)[:13]
    vals = np.asarray(pool_v)[[5, 2, 9, 11]].reshape(16, kvh, d)[:13]
    if window:
        keys, vals = keys[13 - window:], vals[13 - window:]
    qh = np.asarray(q)[6].reshape(kvh, g, d) / np.sqrt(d)
    s = np.einsum("kgd,skd->kgs", qh, keys)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("kgs,skd->kgd", p / p.sum(-1, keepdims=True), vals).reshape(kvh * g, d)
    for out in outs:
        np.testing.assert_allclose(out[:11], outs[0][:11], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[6], want, rtol=1e-5, atol=1e-5)
        assert np.all(out[11:] == 0)  # padding tokens get zeros


def test_a_single_chunk_runs_as_one_tile():
    """A step that is one sequence's chunk runs as one tile of the whole step (TileRules.whole_step_tile),
    a step mixing sequences in tiles of query_tile; the greedy output is the reference's either way."""
    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.models import greedy_generate, init_model, load_model_config
    from talaria_jax.sharding import make_mesh

    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    eng = Engine(model, EngineConfig(warmup=False, query_tile=4, max_tokens_per_step=32, max_seqs=4))
    shapes, tiling = [], eng.runner.tiling

    def spy(b):
        tiles = tiling(b)
        shapes.append((len(b.tokens), *tiles[0].shape))
        return tiles

    eng.runner.tiling = spy
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 256, n).tolist() for n in (45, 9, 12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in eng.generate(prompts[:1], params)]  # alone: chunks of 32 and 13 tokens
    assert shapes[:2] == [(32, 1, 32), (16, 1, 16)]  # (bucket, tiles, tokens per tile): one tile each
    shapes.clear()
    got += [o.token_ids for o in eng.generate(prompts[1:], params)]  # 21 tokens of two sequences: tiles of 4
    assert shapes[0][0] == 32 and shapes[0][2] == 4
    assert got == greedy_generate(model, prompts[:1], 6) + greedy_generate(model, prompts[1:], 6)
    assert all(s in eng.runner.step_shapes() for s in [(32, 32, 1), (16, 16, 1)])
