"""The model runner: one jitted ragged step over a paged KV pool held in donated device buffers.

A step takes a flat batch of tokens in which each sequence contributes some query tokens (a
prefill chunk, one decode token, later k draft tokens), writes their K/V into the pool, attends
over each sequence's pages, and samples at the rows asked for. The pool is a `KVArena` (maybe
shared with other models' runners), donated into the step and re-bound from its output, so its
device buffers keep their addresses. Token counts are padded to a few buckets, and a step with a
prefill chunk groups its query tokens in tiles of one sequence (`query_tile`, a few tile counts per
bucket) so the chunk reads its context once per tile, not once per token. `step_shapes()` lists every shape, `warmup()` compiles them, and `compilations` counts
traces, so a steady workload can be checked to add none. After `use_slot`, the step reads its parameters
from a shared `WeightSlot` (talaria_jax.weights.slot), carved by the model's `SlotLayout`, instead of
the model's own state. The attention is the jnp reference (engine/paged_attention.py) or, with
`attention="pallas"`, the Pallas kernel (engine/kernels/), which reads the pages from the arena itself.
With `layers_per_program` (the default on CPUs) a step runs as a chain of smaller programs: the
embedding, runs of that many layers, each run's program compiled once and called for every run like
it (the layer index is an argument, the arena donated through each), and the head; XLA:CPU compiles
and maps an unrolled decoder's program in time and memory maps that grow with its depth.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from talaria_jax.engine import kernels
from talaria_jax.engine.grammar import mask_words
from talaria_jax.engine.memory_maps import MapBudget
from talaria_jax.engine.paged_attention import AttentionMetadata, ragged_paged_attention
from talaria_jax.engine.plan import Drawn, StepPlan, StepResult
from talaria_jax.engine.sampling import SamplingBatch, constrain, sample
from talaria_jax.kvcache.pool import KVArena, PoolSpec, arena_sharding, read_kv, write_kv
from talaria_jax.models.decoder import run_blocks
from talaria_jax.models.model import ShardedModel
from talaria_jax.engine.spec.verify import verify
from talaria_jax.sharding import mesh_platform, replicated


@dataclasses.dataclass
class StepBatch:
    """Host arrays for one step, already padded to the runner's static shapes except `tokens`' bucket."""
    tokens: np.ndarray       # i32 [T]
    positions: np.ndarray    # i32 [T]
    seq: np.ndarray          # i32 [T], row of page_tables each token belongs to
    slots: np.ndarray        # i32 [T], flat KV slot to write; num_slots for padding (dropped)
    page_tables: np.ndarray  # i32 [B, MP]
    num_blocks: int          # page blocks the longest sequence needs
    num_tokens: int          # real tokens (the rest is padding); each sequence's tokens are consecutive
    logits_idx: np.ndarray   # i32 [R], token index whose logits each sampling row uses
    sampling: SamplingBatch
    allowed: np.ndarray      # i32 [M, W], grammar masks of draws (engine/grammar.py); -1 words: all allowed
    allowed_at: np.ndarray   # i32 [M], the logits row each mask is for (a sampling row, or a verifying
    #                          step's token); NO_MASK for unused rows


@dataclasses.dataclass
class DraftBatch:
    """The draft trees of a speculative step (engine/spec/verify.py), beside a StepBatch whose `positions`
    are the RoPE positions (a node's: its root's plus its depth) and whose sampling rows are the
    step's sequences. K1 = 1 + the most draft tokens a sequence may bring."""
    mask_pos: np.ndarray  # i32 [T], position in the sequence's pages (a node's: its root's plus its index)
    base: np.ndarray      # i32 [T], position of the token's first tree node (past every position outside a tree)
    anc: np.ndarray       # i32 [T], bit j set: the token sees tree node j + 1 (its ancestors and itself)
    node_idx: np.ndarray  # i32 [B, K1], token index of each sequence's root (node 0) and draft nodes
    parent: np.ndarray    # i32 [B, K1], parent node; -1 for the root, -2 for padding
    draw_step: np.ndarray  # i32 [T], output index of a draw at the token (its root's plus its depth)
    active: np.ndarray    # bool [B], sequences whose chunk ends their known tokens (they sample)

    @classmethod
    def empty(cls, num_tokens: int, rows: int, k1: int) -> "DraftBatch":
        return cls(np.zeros(num_tokens, np.int32), np.full(num_tokens, NO_TREE, np.int32),
                   np.zeros(num_tokens, np.int32), np.zeros((rows, k1), np.int32), np.full((rows, k1), -2, np.int32),
                   np.zeros(num_tokens, np.int32), np.zeros(rows, bool))


# Programs `Runner.warmup` compiles at once (at most one per CPU; each holds its own compiler memory).
# XLA:CPU already spreads one program's kernels over the cores: on a 2-core machine no gain shows
# (16 SmolLM2 step programs, one run each: 89.0 s two at a time, 92.7 s one at a time).
COMPILE_WORKERS = 4
NO_TREE = 2**30  # DraftBatch.base of a token outside any draft tree
NO_MASK = 2**30  # StepBatch.allowed_at of an unused mask row (dropped)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything a step's jitted function takes besides the weights and the pool: one pytree."""
    tokens: np.ndarray
    positions: np.ndarray
    attn: AttentionMetadata  # (a verifying step replaces its pos and tree with the DraftBatch's)
    slots: np.ndarray
    seq: np.ndarray
    logits_idx: np.ndarray
    sampling: SamplingBatch
    allowed: np.ndarray
    allowed_at: np.ndarray


jax.tree_util.register_dataclass(SamplingBatch, data_fields=[f.name for f in dataclasses.fields(SamplingBatch)],
                                 meta_fields=[])
jax.tree_util.register_dataclass(DraftBatch, data_fields=[f.name for f in dataclasses.fields(DraftBatch)],
                                 meta_fields=[])
jax.tree_util.register_dataclass(StepInputs, data_fields=[f.name for f in dataclasses.fields(StepInputs)],
                                 meta_fields=[])


def tree_layout(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth (1 for the root's children) and ancestor bits (bit j: node j; each node has its own) of
    draft nodes in depth-first order (parents[j] < j, -1 for the root)."""
    depth = np.zeros(len(parents), np.int32)
    anc = np.zeros(len(parents), np.int32)
    for j, p in enumerate(parents.tolist()):
        depth[j] = 1 if p < 0 else depth[p] + 1
        anc[j] = (1 << j) | (0 if p < 0 else anc[p])
    return depth, anc


@dataclasses.dataclass
class VerifyOutput:
    """Per sequence row: the tokens emitted (accepted drafts, then the correction or bonus token)."""
    tokens: np.ndarray        # i32 [B, K1]
    logprobs: np.ndarray      # f32 [B, K1]
    top_ids: np.ndarray       # i32 [B, K1, N]
    top_logprobs: np.ndarray  # f32 [B, K1, N]
    path: np.ndarray          # i32 [B, K1], the node whose logits gave each token (path[d] = d along a chain)
    count: np.ndarray         # i32 [B], tokens emitted (0 for rows that do not sample)


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray       # i32 [R]
    logprobs: np.ndarray     # f32 [R]
    top_ids: np.ndarray      # i32 [R, N]
    top_logprobs: np.ndarray  # f32 [R, N]
    logits: jax.Array        # f32 [R, V], left on device (fetch only when needed: a verifier, a test)


def seq_runs(seq: np.ndarray, num_tokens: int) -> list[tuple[int, int, int]]:
    """(page-table row, first token, end) of each run of consecutive tokens of one sequence."""
    if num_tokens == 0:
        return []
    s = seq[:num_tokens]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    return [(int(s[a]), int(a), int(e)) for a, e in zip(starts, np.r_[starts[1:], num_tokens])]


def query_tiles(runs: list[tuple[int, int, int]], num_positions: int, tile: int, num_tiles: int):
    """Splits each run into tiles of at most `tile` tokens. Returns tile_tok [num_tiles, tile] (token
    index; num_positions marks an empty slot), tile_seq [num_tiles] and tok_slot [num_positions] (each
    token's flat tile slot; num_tiles x tile for padding). ValueError when more tiles are needed."""
    tile_tok = np.full((num_tiles, tile), num_positions, np.int32)
    tile_seq = np.zeros(num_tiles, np.int32)
    tok_slot = np.full(num_positions, num_tiles * tile, np.int32)
    n = 0
    for row, a, end in runs:
        for b in range(a, end, tile):
            if n == num_tiles:
                raise ValueError(f"the step's tokens need more than {num_tiles} query tiles of {tile}")
            e = min(end, b + tile)
            tile_tok[n, :e - b] = np.arange(b, e)
            tile_seq[n] = row
            tok_slot[b:e] = n * tile + np.arange(e - b)
            n += 1
    return tile_tok, tile_seq, tok_slot


def single_token_tiles(seq: np.ndarray, num_tokens: int):
    """``query_tiles`` with tiles of one token, without the per-run loop (the decode step's path)."""
    t = len(seq)
    idx = np.arange(t, dtype=np.int32)
    real = idx < num_tokens
    slot = np.where(real, idx, t).astype(np.int32)
    return slot[:, None], np.where(real, seq, 0).astype(np.int32), slot


ATTENTION = ("reference", "pallas", "auto")  # EngineConfig.attention's values


def attention_kind(attention: str, mesh, spec: PoolSpec, gpu: bool | None = None) -> str:
    """The attention a runner runs for EngineConfig.attention: "pallas" or "reference" as asked, "auto"
    the Pallas kernel where the devices are GPUs (`gpu`; None: `mesh`'s) and Triton can tile the pool's
    pages (else the reference). ValueError naming the field where "pallas" cannot run on this pool."""
    if attention == "reference":
        return attention
    gpu = kernels.on_gpu(mesh) if gpu is None else gpu
    try:
        kernels.check_shapes(spec.page_size, spec.head_dim, gpu)
    except ValueError as e:
        if attention == "pallas":
            raise ValueError(f"EngineConfig.attention='pallas': {e}") from None
        return "reference"
    return "pallas" if attention == "pallas" or gpu else "reference"


LAYERS_PER_PROGRAM_CPU = 5  # EngineConfig.layers_per_program's default on CPUs


def layers_per_program(asked: int | None, mesh, attention: str, num_layers: int) -> int:
    """The runner's layers_per_program for EngineConfig.layers_per_program: as asked, or (None) the CPU
    default where the step's attention is the jnp reference on CPU devices and the model is deeper
    than one run (a model of a run's layers or fewer would compile the same layers beside an
    embedding and a head program), else 0 (one program)."""
    if asked is not None:
        return asked
    cpu = attention == "reference" and mesh_platform(mesh) == "cpu"
    return LAYERS_PER_PROGRAM_CPU if cpu and num_layers > LAYERS_PER_PROGRAM_CPU else 0


def reference_blocks(tile: int, num_blocks, pages_per_block: int):
    """(blocks, pages per block) the jnp reference walks for query tiles of `tile` tokens, given the
    step's `num_blocks` blocks of `pages_per_block` pages. Tiles of one token (decode steps, and the
    few prefill steps that fall back to them) read half blocks, twice as many: their dots are tiny and
    the gathered block is what costs; on XLA:CPU a half block made decode steps 6-10% faster (125M
    Llama and SmolLM2 shapes, batch 8-32, context 512-2048). Tiles of several tokens keep whole
    blocks, which make their matmuls bigger."""
    if tile == 1 and pages_per_block % 2 == 0:
        return num_blocks * 2, pages_per_block // 2
    return num_blocks, pages_per_block


def token_buckets(max_tokens: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` up to (and including) max_tokens."""
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return (*out, max_tokens)


@dataclasses.dataclass(frozen=True)
class TileRules:
    """How a runner lays out a step: its tokens padded to a bucket and grouped in query tiles. Plain
    arithmetic, so the simulator prices a step on the jnp reference attention as the runner runs it
    (`walk`: the page blocks each tile visits there)."""
    max_tokens_per_step: int
    max_seqs: int
    page_size: int
    pages_per_block: int = 4
    query_tile: int = 16
    whole_step_tile: bool = True  # one sequence's chunk runs as one tile of the whole step (the reference's)
    # The fewest tokens a step pads to: 2 on GPUs, where XLA's compiler rewrites a one-row matmul as a
    # multiply and a reduction that writes the [in, out] products to memory in between, three times
    # the weights' bytes (benchmarks/step_audit.py, --target=h200 at batch 1); a second row costs
    # nothing on a step bound by reading the weights.
    smallest_bucket: int = 1

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        return token_buckets(self.max_tokens_per_step, min(self.smallest_bucket, self.max_tokens_per_step))

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the step budget {self.max_tokens_per_step}")

    def tile_counts(self, t: int) -> tuple[int, ...]:
        """Tile counts a step of bucket `t` may use with tiles of `query_tile` tokens: T/Q (one chunk,
        or several that fit), 2T/Q (chunks ending mid-tile) and `most_tiles(t)` (chunks beside decode
        tokens, one tile each); none above `most_tiles(t)`, which no step needs (each count is a
        program to compile); only those below T: a tile costs a page-block read whether it is full or
        not, so more tiles than tokens would read more than tiles of one token do. Steps under two
        tiles' worth keep tiles of one (their mostly empty tiles would multiply the attention FLOPs)."""
        q = self.query_tile
        if q == 1 or t < 2 * q:
            return ()
        most = self.most_tiles(t)
        return tuple(sorted(n for n in {t // q, 2 * (t // q), most} if 0 < n < t and n <= most))

    def most_tiles(self, t: int) -> int:
        """The most tiles of `query_tile` a step of up to `t` tokens can need: one a sequence (as many
        as it may hold) and one for each further `query_tile` tokens (a sequence of n tokens needs
        ceil(n / Q) = 1 + (n - 1) // Q)."""
        seqs = min(t, self.max_seqs)
        return seqs + (t - seqs) // self.query_tile

    def single_token_tiles(self, t: int) -> bool:
        """Whether a step of bucket `t` may run in tiles of one token: it has no tile counts, or it may
        hold one token from each of more sequences than the bucket below holds tokens, or its
        sequences may need more tiles than its largest count (then `most_tiles(t)` >= T, which needs
        max_seqs >= T: the second case). (Each (t, 1, t) shape is a program, and with max_seqs below a
        bucket's tokens most are never run.)"""
        below = max((b for b in self.buckets if b < t), default=0)
        return not self.tile_counts(t) or below + 1 <= self.max_seqs

    def tiles(self, t: int, runs: Sequence[int]) -> tuple[int, int] | None:
        """(tokens a tile, tiles) of a step of bucket `t` whose sequences bring `runs` tokens each: one
        tile of the whole step when it is one sequence's chunk (`whole_step_tile`: on the jnp
        reference the tile's matmuls are then [t x G, head_dim] x [head_dim, block] rather than many
        [query_tile x G, ...] ones, which XLA:CPU runs far better, a 512-token chunk over 8K cached
        tokens in 110 against 207 ms per layer on a 2-core CPU; a single chunk fills at least half its
        bucket, so its empty rows cost less than small tiles would); tiles of `query_tile` when a
        prefill chunk is in the step and few enough of them cover it, their count one of
        `tile_counts`; None: tiles of one token (decode)."""
        counts = self.tile_counts(t)
        if not counts or all(n <= 1 for n in runs):
            return None
        if len(runs) == 1 and self.whole_step_tile:
            return t, 1
        need = sum(-(-n // self.query_tile) for n in runs)
        return (self.query_tile, next(c for c in counts if c >= need)) if need <= counts[-1] else None

    def shape(self, runs: Sequence[int]) -> tuple[int, int, int]:
        """(bucket, tokens a tile, tiles) of a step whose sequences bring `runs` tokens each."""
        t = self.bucket(sum(runs))
        return t, *(self.tiles(t, runs) or (1, t))

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every shape `shape` can give: the step programs a runner compiles."""
        return [s for t in self.buckets for s in [(t, 1, t)] * self.single_token_tiles(t)
                + [(t, self.query_tile, n) for n in self.tile_counts(t)]
                + ([(t, t, 1)] if self.whole_step_tile and self.tile_counts(t) else [])]

    def walk(self, chunks: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
        """A step of `chunks` (each sequence's new tokens, its cached tokens) on the jnp reference:
        (tokens padded to the bucket, tiles, query rows a tile, key tokens each tile visits). Every
        tile, a padding one too, walks the blocks of the step's longest sequence
        (engine/paged_attention.py)."""
        t, tile, tiles = self.shape([n for n, _ in chunks])
        pages = max(-(-(n + p) // self.page_size) for n, p in chunks)
        blocks, per = reference_blocks(tile, -(-pages // self.pages_per_block), self.pages_per_block)
        return t, tiles, tile, blocks * per * self.page_size


class Runner:
    def __init__(self, model: ShardedModel, arena: KVArena, spec: PoolSpec, *, max_seqs: int, max_pages_per_seq: int,
                 max_tokens_per_step: int, pages_per_block: int = 4, query_tile: int = 16,
                 attention: str = "reference", draft_nodes: int = 0, compiler_options: dict | None = None,
                 layers_per_program: int = 0):
        """draft_nodes: K1 of the verifying step (1 + the most draft tokens a sequence brings), 0 without
        speculation; compiler_options: XLA options of the step programs (jax.jit's); layers_per_program:
        0 compiles each step as one program, n > 0 runs it as programs of at most n layers (the most
        that divide the depth evenly), one program serving every run of like layers (the jnp reference
        attention only; steps over a weight slot stay one program)."""
        if attention not in ("reference", "pallas"):
            raise ValueError(f"Runner attention must be 'reference' or 'pallas', got {attention!r}")
        self.model = model
        self.attention = attention  # the step's ragged paged attention: the jnp reference or the Pallas kernel
        self.arena, self.spec = arena, spec
        self.max_seqs = max_seqs
        self.draft_nodes = draft_nodes
        self.mask_rows = max_seqs * max(draft_nodes, 1)  # a draw's grammar mask per sampling row or draft node
        self.mask_words = mask_words(model.cfg.vocab_size)
        self.pages_per_block = pages_per_block
        self.query_tile = query_tile
        self.rules = TileRules(max_tokens_per_step, max_seqs, spec.page_size, pages_per_block, query_tile,
                               whole_step_tile=attention == "reference",
                               smallest_bucket=2 if kernels.on_gpu(model.mesh) else 1)
        # Page-table width: whole blocks, so the attention loop's dynamic slices never run past it.
        self.table_width = -(-max_pages_per_seq // pages_per_block) * pages_per_block
        self.buckets = self.rules.buckets
        self.compilations = 0
        self.slot, self.layout = None, None  # see use_slot
        self.on_device = True  # the model's own arrays hold its weights (see set_model)
        rep = replicated(model.mesh)
        jit = functools.partial(jax.jit, static_argnums=0, static_argnames=("layout",), donate_argnames=("kv",),
                                compiler_options=compiler_options)
        self._step = jit(self._step_fn, out_shardings=(arena_sharding(model.mesh), rep, rep, rep, rep, rep))
        self._verify = jit(self._verify_fn, out_shardings=(arena_sharding(model.mesh), rep, rep, rep, rep, rep, rep))
        if layers_per_program < 0:
            raise ValueError(f"Runner layers_per_program must be >= 0, got {layers_per_program}")
        self.layers_per_program = layers_per_program if attention == "reference" else 0
        self._kinds, self._parts_of, self._parts_cache = [], None, None  # see _parts
        self._embed = jax.jit(self._embed_fn, static_argnums=0, out_shardings=rep, compiler_options=compiler_options)
        self._layers = jax.jit(self._layers_fn, static_argnums=0, donate_argnames=("kv", "h"),
                               out_shardings=(rep, arena_sharding(model.mesh)), compiler_options=compiler_options)
        self._head = jax.jit(self._head_fn, static_argnums=0, out_shardings=rep, compiler_options=compiler_options)

    def use_slot(self, slot, layout=None) -> None:
        """Reads the parameters from `slot` (a WeightSlot shared by several models' runners), carved by
        `layout` (default: SlotLayout.of(self.model) in the slot's word), instead of self.model.state;
        None: back to the model's state. Steps refuse to run while the slot holds other weights;
        `warmup` compiles the slot's path (it runs whatever the slot holds: its all-padding steps
        write nothing)."""
        if slot is not None:
            from talaria_jax.weights.slot import SlotLayout  # here: talaria_jax.weights imports orbax (~1.5 s)

            layout = layout or SlotLayout.of(self.model, word=slot.word)
            slot.check(layout)
        self.slot, self.layout = slot, layout if slot is not None else None

    def set_model(self, model: ShardedModel, on_device: bool = True) -> None:
        """Steps read `model`'s parameters (the same model's, in other arrays: `Engine.place_weights`);
        `on_device` False: it has none on the devices (abstract), and steps are refused."""
        self.model, self.on_device = model, on_device
        self._parts_of = self._parts_cache = None  # (it held the former arrays)

    @property
    def kv(self) -> jax.Array:
        """The KV arena's buffer (shared with every runner on the arena; each step donates it)."""
        return self.arena.array

    @kv.setter
    def kv(self, array: jax.Array) -> None:
        self.arena.array = array

    def bucket(self, n: int) -> int:
        return self.rules.bucket(n)

    @property
    def reference_tiles(self) -> TileRules | None:
        """`rules` where the step's attention is the jnp reference, whose layout `TileRules.walk` gives
        (what `sim.cost.CostModel.tiles` takes to price this runner's steps), else None."""
        return self.rules if self.attention == "reference" else None

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, tile, tiles) shape a step can take: what `warmup` compiles."""
        return self.rules.shapes()

    def tiling(self, b: StepBatch):
        """Query tiles for a step, as `TileRules.tiles` lays them out for its runs of tokens."""
        t = len(b.tokens)
        s = b.seq[:b.num_tokens]
        if self.rules.tile_counts(t) and np.any(s[1:] == s[:-1]):  # a sequence brings several tokens
            runs = seq_runs(b.seq, b.num_tokens)
            plan = self.rules.tiles(t, [e - a for _, a, e in runs])
            if plan is not None:
                return query_tiles(runs, t, *plan)
        return single_token_tiles(b.seq, b.num_tokens)

    def warmup(self, progress: bool | None = True) -> None:
        """Compiles every step shape now, so serving adds none; with draft_nodes, the verifying step of
        every shape too. Each program is traced and lowered here and compiled by XLA on up to
        `COMPILE_WORKERS` threads at once (one per CPU; XLA compiles without Python's lock), then run
        once (an all-padding step: nothing is written), which finds it compiled.
        progress: a bar (True), none (False), or a bar only on a terminal (None)."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        programs = [(s, None) for s in self.step_shapes()]
        if self.draft_nodes:
            programs += [(s, DraftBatch.empty(s[0], self.max_seqs, self.draft_nodes)) for s in self.step_shapes()]
        maps = MapBudget(len(programs), f"the step programs of {self.model.cfg.name}")
        lowered = set()
        workers = min(COMPILE_WORKERS, os.cpu_count() or 1)
        with tqdm(total=len(programs), desc="compiling step shapes", leave=False,
                  disable=None if progress is None else not progress) as bar, ThreadPoolExecutor(workers) as pool:
            compiling = []

            def finish_one():
                compiling.pop(0).result()
                maps.compiled()
                bar.update()

            for (t, q, n), d in programs:
                while len(compiling) >= (workers if maps.done else 1):  # the first alone: MapBudget's base
                    finish_one()
                maps.check()  # a clear error before XLA:CPU runs out of memory maps
                shape = self._programs(self.empty_batch(t), query_tiles([], t, q, n), d, lowered)
                compiling.append(pool.submit(lambda shape=shape: [p.compile() for p in shape]))
            while compiling:
                finish_one()
        for (t, q, n), d in programs:
            b, tiles = self.empty_batch(t), query_tiles([], t, q, n)
            self._run(b, *tiles) if d is None else self._run_verify(b, d, *tiles)

    def step_seconds(self, reps: int = 3) -> tuple[dict[int, float], dict[int, float]]:
        """Seconds of a plain and of a verifying step (draft_nodes must be set) at each token bucket:
        best of `reps` all-padding steps, after one that pays any lazy transfer."""
        plain, verify = {}, {}
        for t in self.buckets:
            b = self.empty_batch(t)
            d = DraftBatch.empty(len(b.tokens), self.max_seqs, self.draft_nodes)
            plain[t] = _best_time(lambda: self.step(b), reps)
            verify[t] = _best_time(lambda: self.verify_step(b, d), reps)
        return plain, verify

    def _attention(self, meta: AttentionMetadata, slots, window_of):
        """The step's AttentionFn over the pool: writes a layer's new K/V into the arena, then attends
        (the jnp reference, or the Pallas kernel reading the pages from the arena itself); a layer's
        sliding window is `window_of(layer)`."""
        spec, mesh, ppb = self.spec, self.model.mesh, self.pages_per_block

        def attn(layer, q, k, v, arena, sinks=None):
            arena = write_kv(arena, spec, mesh, layer, k, v, slots)
            if self.attention == "pallas":  # reads the pages straight from the arena
                return kernels.ragged_paged_attention(q, arena, spec, mesh, layer, meta, ppb, window_of(layer),
                                                      sinks), arena
            read = functools.partial(read_kv, arena, spec, mesh, layer)
            blocks, pages_per_block = reference_blocks(meta.tile_tok.shape[1], meta.num_blocks, ppb)
            out = ragged_paged_attention(q, read, spec.kv_heads, spec.page_size,
                                         dataclasses.replace(meta, num_blocks=blocks), pages_per_block,
                                         window_of(layer), sinks)
            return out, arena

        return attn

    def _forward(self, graphdef, params, kv, tokens, positions, meta: AttentionMetadata, slots, layout):
        """The model over the step's tokens: (model, hidden states [T, hidden], kv). RoPE uses
        `positions`, the attention mask `meta` (its pos and tree)."""
        self.compilations += 1  # runs at trace time only
        if layout is not None:  # params is a weight slot's flat buffer
            from talaria_jax.weights.slot import carve

            params = carve(params, layout)
        model = nnx.merge(graphdef, params)
        h, kv = model.hidden(tokens, positions, self._attention(meta, slots, model.cfg.window), kv)
        return model, h, kv

    def _sample(self, model, h, x: StepInputs):
        logits = model.logits(h[x.logits_idx])
        s = x.sampling
        drawn_from = constrain(logits, jnp.arange(logits.shape[0]), s.bias_ids, s.bias, x.allowed, x.allowed_at)
        return (*sample(logits, s.temperature, s.top_k, s.top_p, s.seed, s.step, drawn_from), logits)

    def _verify_sample(self, model, h, x: StepInputs, d: DraftBatch):
        logits = model.logits(h)  # every token's: each draft node is verified
        s = x.sampling
        drawn_from = constrain(logits, x.seq, s.bias_ids, s.bias, x.allowed, x.allowed_at)
        return verify(logits, x.tokens, x.seq, d.draw_step, d.node_idx, d.parent, d.active, s.temperature,
                      s.top_k, s.top_p, s.seed, drawn_from)

    def _step_fn(self, graphdef, params, kv, x: StepInputs, layout=None):
        model, h, kv = self._forward(graphdef, params, kv, x.tokens, x.positions, x.attn, x.slots, layout)
        return (kv, *self._sample(model, h, x))

    def _verify_fn(self, graphdef, params, kv, x: StepInputs, d: DraftBatch, layout=None):
        model, h, kv = self._forward(graphdef, params, kv, x.tokens, x.positions, self._meta(x, d), x.slots, layout)
        return (kv, *self._verify_sample(model, h, x, d))

    # ---- layer programs (EngineConfig.layers_per_program) -----------------------------------------------
    # The programs take the parameters as flat leaves and a small static key into `_kinds` (what to
    # rebuild them into): hashing a model's graph definition and flattening its nnx state on every call
    # cost more than a one-token embedding.
    def _embed_fn(self, kind: int, leaves, x: StepInputs, d: DraftBatch | None = None):
        """The first layer's input, and `x` and `d` on the devices (one transfer for the step's programs)."""
        self.compilations += 1  # runs at trace time only: one a step shape, as the whole-step program
        return self._merge(kind, leaves).embed_tokens(x.tokens), x, d

    def _layers_fn(self, kind: int, leaves, kv, h, x: StepInputs, meta: AttentionMetadata, first):
        """Layers first, first + 1, ... over h: one program serves every run of layers with the same
        definitions and sliding windows (`first` is an argument)."""
        defs, windows, treedef = self._kinds[kind]
        states = jax.tree.unflatten(treedef, leaves)
        attns = [functools.partial(self._attention(meta, x.slots, lambda _, w=w: w), first + j)
                 for j, w in enumerate(windows)]  # `first` is traced: the windows come static
        return run_blocks(self.model.cfg, [nnx.merge(g, b) for g, b in zip(defs, states)], attns, h, x.positions, kv)

    def _head_fn(self, kind: int, leaves, h, x: StepInputs, d: DraftBatch | None = None):
        """The final norm, the logits and the draw (or the verification). `x` comes without its
        attention metadata, so the step shapes of a token bucket share this program."""
        model = self._merge(kind, leaves)
        h = model.norm(h)
        return self._sample(model, h, x) if d is None else self._verify_sample(model, h, x, d)

    def _merge(self, kind: int, leaves):
        graphdef, treedef = self._kinds[kind]
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def _kind(self, key) -> int:
        """The static key of a program's parameter structure (equal structures share one)."""
        if key not in self._kinds:
            self._kinds.append(key)
        return self._kinds.index(key)

    def _parts(self, params):
        """(the embedding and head's key and leaves, [(key, leaves, first layer) of each run]) of `params`:
        runs of the most layers up to `layers_per_program` that divide the model's depth evenly (a
        16-layer model asked for 5 runs 4 at a time: one program, not one of 5 and one of 1). Kept while
        params stay the same."""
        if self._parts_of is not params:
            cfg = self.model.cfg
            n = max(d for d in range(1, min(self.layers_per_program, cfg.num_layers) + 1) if cfg.num_layers % d == 0)
            blocks = params["blocks"]
            defs = [nnx.graphdef(b) for b in self.model.module().blocks]
            rest = nnx.State({k: (v if k != "blocks" else jax.tree.map(lambda _: None, v)) for k, v in params.items()})
            leaves, treedef = jax.tree.flatten(rest)
            runs = []
            for a in range(0, cfg.num_layers, n):
                layers = range(a, min(a + n, cfg.num_layers))
                run_leaves, run_def = jax.tree.flatten(tuple(blocks[i] for i in layers))
                runs.append((self._kind((tuple(defs[i] for i in layers), tuple(cfg.window(i) for i in layers),
                                         run_def)), run_leaves, np.int32(a)))
            self._parts_of, self._parts_cache = params, ((self._kind((self.model.graphdef, treedef)), leaves), runs)
        return self._parts_cache

    def _by_layers(self, params, kv, x: StepInputs, d: DraftBatch | None = None, lowered: set | None = None):
        """The step as layer programs: the embedding, then each run of layers (their parameters only, the
        arena and the hidden states donated through), then the norm, the logits and the draw. With
        `lowered` (the keys of programs lowered before), the programs not among them lowered instead
        of run (their keys added): the step shapes of a token bucket share their head."""
        (rest, rest_leaves), runs = self._parts(params)
        if lowered is not None:
            t, out, rep = len(x.tokens), [], replicated(self.model.mesh)
            # what the embedding returns: x and d on the devices, and the hidden states
            xd, dd = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), (x, d))
            h = jax.ShapeDtypeStruct((t, self.model.cfg.hidden_size), jnp.dtype(self.model.cfg.dtype), sharding=rep)
            meta, tiles = self._meta(xd, dd), x.attn.tile_tok.shape
            programs = [(("embed", t, tiles, d is None), lambda: self._embed.trace(rest, rest_leaves, x, d))]
            programs += [(("layers", t, tiles, d is None, kind),
                          lambda kind=kind, leaves=leaves, first=first: self._layers.trace(
                              kind, leaves, kv, h, xd, meta, first)) for kind, leaves, first in runs]
            programs += [(("head", t, d is None),
                          lambda: self._head.trace(rest, rest_leaves, h, dataclasses.replace(xd, attn=None), dd))]
            for key, trace in programs:
                if key not in lowered:
                    lowered.add(key)
                    out.append(trace().lower())
            return out
        h, x, d = self._embed(rest, rest_leaves, x, d)
        meta = self._meta(x, d)
        for kind, leaves, first in runs:
            h, kv = self._layers(kind, leaves, kv, h, x, meta, first)
        return kv, self._head(rest, rest_leaves, h, dataclasses.replace(x, attn=None), d)

    @staticmethod
    def _meta(x: StepInputs, d: DraftBatch | None) -> AttentionMetadata:
        """The step's attention metadata: a verifying step's with the draft trees' positions and masks."""
        return x.attn if d is None else dataclasses.replace(x.attn, pos=d.mask_pos, tree=(d.base, d.anc))

    def require_weights(self) -> None:
        """ValueError unless the weights the step reads are on the devices (the slot holds this model's,
        or its own arrays are placed)."""
        if self.slot is not None:
            self.slot.require_active(self.layout, self.model.fingerprint)
        elif not self.on_device:
            raise ValueError(f"{self.model.cfg.name}'s weights are not on the devices (evicted); place them first")

    def step(self, b: StepBatch) -> StepOutput:
        self.require_weights()
        return self._run(b, *self.tiling(b))

    def verify_step(self, b: StepBatch, d: DraftBatch) -> VerifyOutput:
        """A step whose sequences bring draft trees: every node's logits are computed and the drafts
        verified (engine/spec/verify.py). b.sampling's rows are the sequences of node_idx's rows."""
        self.require_weights()
        return self._run_verify(b, d, *self.tiling(b))

    def inputs(self, b: StepBatch, tiles=None) -> StepInputs:
        """The jitted step's inputs for `b` (its query tiles: `tiling(b)` unless given)."""
        tile_tok, tile_seq, tok_slot = tiles if tiles is not None else self.tiling(b)
        meta = AttentionMetadata(b.page_tables, b.positions, tile_tok, tile_seq, tok_slot, np.int32(b.num_blocks))
        return StepInputs(b.tokens, b.positions, meta, b.slots, b.seq, b.logits_idx, b.sampling, b.allowed,
                          b.allowed_at)

    def lower(self, b: StepBatch, params=None, kv=None, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The step program for `b` lowered, not run (`.compile()` it to read the compiled program:
        benchmarks/step_audit.py). `params` and `kv` (None: this runner's) may be abstract
        (`jax.ShapeDtypeStruct`s), so a model's step can be read without its weights or its pool.
        platforms: lower for these instead of the mesh's devices (("cuda",): the program a GPU would
        compile, the Pallas kernel as its Triton call; readable here, not compilable)."""
        return self._lower(b, params=params, kv=kv, platforms=platforms)

    def _lower(self, b: StepBatch, tiles=None, d: DraftBatch | None = None, params=None, kv=None,
               platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The step for `b` (its `tiles`: `tiling(b)` unless given) lowered, the verifying one with
        drafts `d`."""
        params, kv = self._params() if params is None else params, self.kv if kv is None else kv
        with jax.set_mesh(self.model.mesh):
            inputs = self.inputs(b, tiles)
            traced = (self._step.trace(self.model.graphdef, params, kv, inputs, layout=self.layout) if d is None else
                      self._verify.trace(self.model.graphdef, params, kv, inputs, d, layout=self.layout))
            return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    def _programs(self, b: StepBatch, tiles, d: DraftBatch | None, lowered: set) -> list[jax.stages.Lowered]:
        """The programs a step for `b` runs that are not among `lowered` (their keys, updated), lowered:
        the step's, or its layer programs."""
        if not self.by_layers:  # one program a step shape: never shared
            return [self._lower(b, tiles, d)]
        with jax.set_mesh(self.model.mesh):
            return self._by_layers(self._params(), self.kv, self.inputs(b, tiles), d, lowered)

    def _params(self):
        """What a step reads its parameters from: the model's arrays, or the weight slot."""
        return self.model.state if self.slot is None else self.slot.array

    @property
    def by_layers(self) -> bool:
        """Whether steps run as layer programs (`layers_per_program`), not one program."""
        return bool(self.layers_per_program) and self.layout is None

    def _run_verify(self, b: StepBatch, d: DraftBatch, tile_tok, tile_seq, tok_slot) -> VerifyOutput:
        params, x = self._params(), self.inputs(b, (tile_tok, tile_seq, tok_slot))
        with jax.set_mesh(self.model.mesh):
            if self.by_layers:
                self.kv, out = self._by_layers(params, self.kv, x, d)
            else:
                self.kv, *out = self._verify(self.model.graphdef, params, self.kv, x, d, layout=self.layout)
        return VerifyOutput(*jax.device_get(out))

    def _run(self, b: StepBatch, tile_tok, tile_seq, tok_slot) -> StepOutput:
        params, x = self._params(), self.inputs(b, (tile_tok, tile_seq, tok_slot))
        with jax.set_mesh(self.model.mesh):
            if self.by_layers:
                self.kv, out = self._by_layers(params, self.kv, x)
            else:
                self.kv, *out = self._step(self.model.graphdef, params, self.kv, x, layout=self.layout)
        toks, lp, top_ids, top_lp = jax.device_get(out[:4])
        return StepOutput(toks, lp, top_ids, top_lp, out[4])

    # ---- plans ------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs a plan (its restores scattered in by the caller first): one step, or one verifying step
        when the plan brings drafts. Returns what each sampling chunk drew."""
        b, d = self.batch(plan)
        t0 = time.perf_counter()
        out = self.verify_step(b, d) if d is not None else self.step(b)
        seconds = time.perf_counter() - t0
        drawn, row = {}, 0
        for r, c in enumerate(plan.chunks):
            if c.sample is None:
                continue
            if d is not None:  # the verifier's rows are the step's sequences
                count = int(out.count[r])
                path = out.path[r, :count]
                # accepted nodes 1, 2, ... in place hold their KV; after a jump (a tree's side branch)
                # the accepted tokens are known but recomputed next step
                kept = int(np.argmin(np.r_[path[1:] == np.arange(1, count), False]))
                drawn[c.request_id] = Drawn(out.tokens[r, :count], out.logprobs[r, :count], out.top_ids[r, :count],
                                            out.top_logprobs[r, :count], kept)
            else:
                drawn[c.request_id] = Drawn(out.tokens[row:row + 1], out.logprobs[row:row + 1],
                                            out.top_ids[row:row + 1], out.top_logprobs[row:row + 1])
                row += 1
        return StepResult(drawn, seconds, len(b.tokens))

    def batch(self, plan: StepPlan) -> tuple[StepBatch, DraftBatch | None]:
        """The host arrays of a plan: its chunks' tokens, positions and KV slots in page-table row order,
        sampling rows, and (for a speculative plan) the draft trees."""
        spec = plan.speculative
        b = self.empty_batch(plan.num_tokens)
        d = DraftBatch.empty(len(b.tokens), self.max_seqs, self.draft_nodes) if spec else None
        ps = self.spec.page_size
        t = rows = max_pages = masks = 0
        for i, c in enumerate(plan.chunks):
            q, n = len(c.tokens), c.num_tokens
            m = n - q
            pos = np.arange(c.start, c.start + n)  # a draft's nodes in depth-first order
            pages = np.asarray(c.pages, np.int32)
            b.tokens[t:t + q] = c.tokens
            b.positions[t:t + n] = pos
            b.seq[t:t + n] = i
            b.slots[t:t + n] = pages[pos // ps] * ps + pos % ps
            b.page_tables[i, :len(pages)] = pages
            max_pages = max(max_pages, len(pages))
            if d is not None:
                d.mask_pos[t:t + n] = pos
            if m:
                depth, anc = tree_layout(c.draft.parents)
                b.tokens[t + 1:t + n] = c.draft.tokens
                b.positions[t + 1:t + n] = c.start + depth
                d.base[t + 1:t + n] = c.start + 1
                d.anc[t + 1:t + n] = anc
            if c.sample is not None:
                row = i if spec else rows
                out_idx = c.sample.step
                if spec:
                    d.node_idx[i, :m + 1] = t + q - 1 + np.arange(m + 1)
                    d.parent[i, 0] = -1
                    d.active[i] = True
                    d.draw_step[t + q - 1] = out_idx
                    if m:
                        d.parent[i, 1:m + 1] = c.draft.parents + 1
                        d.draw_step[t + 1:t + n] = out_idx + depth
                else:
                    b.logits_idx[row] = t + n - 1
                b.sampling.set_row(row, c.sample.params, c.sample.seed, out_idx)
                if c.sample.allowed is not None:  # one mask per draw: the sampling row's, or each node's
                    k = len(c.sample.allowed) if spec else 1
                    b.allowed[masks:masks + k] = c.sample.allowed[:k]
                    b.allowed_at[masks:masks + k] = t + q - 1 + np.arange(k) if spec else row
                    masks += k
                rows += 1
            t += n
        b.num_blocks = -(-max_pages // self.pages_per_block)
        return b, d

    def empty_batch(self, num_tokens: int) -> StepBatch:
        """A padded batch of the bucket for num_tokens: every token writes out of bounds."""
        t = self.bucket(num_tokens)
        return StepBatch(
            tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), seq=np.zeros(t, np.int32),
            slots=np.full(t, self.spec.num_slots, np.int32),
            page_tables=np.zeros((self.max_seqs, self.table_width), np.int32), num_blocks=0, num_tokens=num_tokens,
            logits_idx=np.zeros(self.max_seqs, np.int32), sampling=SamplingBatch.empty(self.max_seqs),
            allowed=np.full((self.mask_rows, self.mask_words), -1, np.int32),
            allowed_at=np.full(self.mask_rows, NO_MASK, np.int32))


def _best_time(fn, reps: int) -> float:
    fn()  # compiled already after a warm-up; this one pays any lazy transfer
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
