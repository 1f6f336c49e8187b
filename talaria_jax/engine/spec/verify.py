"""Lossless verification of model-free drafts, vectorised over the batch (runs inside the jitted step).

Each sequence of a step brings its last known token (the root, node 0) and a draft tree (nodes 1..K,
a chain being a tree with one child per node) as query tokens; the step computes the target's
logits at every node. Verification then draws, at each node, the token the target would sample
there: the same key as a step without drafts (`fold_in(seed, output index)`, the output index being
the root's plus the node's depth), so greedy and seeded outputs are identical with or without
speculation. Walking from the root, a drawn token that equals one of the node's draft children is
accepted and the walk moves to that child; otherwise the drawn token is emitted and the walk stops;
at a leaf the drawn token is the bonus token.

Why this is lossless: a draft here is a point mass (no draft distribution q), so the classic rule,
accept draft d with probability min(1, p(d)/q(d)) = p(d) and on rejection sample from p with d
removed and renormalised, is the same process as drawing x ~ p and accepting iff x == d: P(accept)
= p(d), and given a rejection x is distributed as p restricted to the other tokens. With several
draft children c1..cm (a tree), drawing x ~ p and moving to the child equal to x accepts ci with
probability p(ci) and emits, on rejection, p restricted to the non-draft tokens: exactly
sequential rejection over c1..cm. Every emitted token is thus a draw from the target at its
context. The logprobs returned are the target's, of the model's distribution (as without drafts).
"""
from __future__ import annotations

import jax.numpy as jnp

from talaria_jax.engine.sampling import sample


def verify(logits, tokens, row, draw_step, node_idx, parent, active, temperature, top_k, top_p, seed,
           draw_logits=None):
    """logits: [T, V] fp32, the target's logits at each of the step's tokens; tokens: [T], the step's
    tokens (a draft node's token is its draft); row: [T], each token's sequence row; draw_step: [T],
    the output index a draw at that token gets (its root's plus its depth); node_idx: [B, K1] token
    index of each sequence's nodes (node 0 the root); parent: [B, K1] each node's parent node (-1 for
    the root, -2 for padding: neither is anyone's child); active: [B] bool, rows that sample;
    temperature, top_k, top_p: [B]; seed: [B, 2]; draw_logits: what the draws read instead of logits
    (logit bias and grammar masks applied: sampling.constrain).

    Returns (tokens [B, K1], logprobs [B, K1], top ids [B, K1, N], top logprobs [B, K1, N], path
    [B, K1] the node whose logits gave each token, count [B] tokens emitted: accepted drafts + 1, 0
    for inactive rows). Entries past count are meaningless."""
    b, k1 = node_idx.shape
    # one draw per token (T rows: B x K1 node slots are mostly padding at small batches)
    drawn, chosen, top_ids, top_lp = sample(logits, temperature[row], top_k[row], top_p[row], seed[row], draw_step,
                                            draw_logits)
    drawn, chosen = drawn[node_idx], chosen[node_idx]
    draft = tokens[node_idx]
    cur = jnp.zeros(b, jnp.int32)
    alive = active
    out_tok, out_node = [], []
    count = jnp.zeros(b, jnp.int32)
    for _ in range(k1):
        x = jnp.take_along_axis(drawn, cur[:, None], axis=1)[:, 0]
        out_tok.append(x)
        out_node.append(cur)
        count += alive
        hit = (parent == cur[:, None]) & (draft == x[:, None])  # draft children equal to the draw
        alive = alive & hit.any(-1)
        cur = jnp.where(alive, jnp.argmax(hit, -1).astype(jnp.int32), cur)
    path = jnp.stack(out_node, 1)
    lp = jnp.take_along_axis(chosen, path, axis=1)
    tok = jnp.take_along_axis(node_idx, path, axis=1)  # the token whose logits gave each emitted token
    return jnp.stack(out_tok, 1), lp, top_ids[tok], top_lp[tok], path, count
