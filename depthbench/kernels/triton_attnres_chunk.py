"""
depthbench/kernels/triton_attnres_chunk.py: AttnRes' depth mix in two phases, a chunk of consumers at once (the
Kimi AttnRes paper's / flash-attn-res' form), the GPU body of `DepthBank.mix` when the bank holds the design's
(2L, D) queries and key gains (`DepthBank.start(..., queries=, key_gains=)`, residuals.FullAttnRes.init_stream).

The maths is triton_attnres.py's (ops.depth_mix per consumer). The queries are learnt parameters, not token-dependent,
so the CHUNK consumers of rows r0 .. r0 + CHUNK - 1 can be served together; consumer k of the chunk reads the bank's
first n_k sources (and Block AttnRes' open sum `extra`), n_k >= n1, the bank's size at the chunk's first consumer
(a consumer of an older state, n_k < n1, takes triton_attnres.py's mix on the same bank). The row: residuals.py
hands each mix its Site, whose int `row_index` is read here, in eager code (a compiled block would guard on it):

- phase 1 (`_chunk_forward`, run by the chunk's first consumer): two passes over sources 0 .. n1 - 1 with the
  chunk's CHUNK queries in the program, PHASE1_TOKENS tokens a program, each source read COLUMNS_TILE columns at a
  time: the logits of every consumer (one fp32 product a tile) and their lse1_k, then o1_k = sum_j exp(s_j - lse1_k)
  v_j column tile by column tile (the normalised partial mix, in the bank's dtype); the logits kept (fp32, for p);
- phase 2 (`_merge_forward`, each consumer): the online softmax started from (o1_k, lse1_k) (max lse1_k, sum 1,
  weighted sum o1_k) over the sources pushed since (n1 .. n_k - 1) and the extra -> mix, lse, p.

Backward with the final lse and delta = <mix, dmix> (flash attention's), as triton_attnres.py's:
- the consumer's pass (`_merge_backward`): its phase-2 sources' gradients (read-modify-write of their fp32 slots;
  the extra's written, its later uses' added: `Merge`); its record (dmix in the bank's dtype, delta, lse) and its
  partial dgq rows into the chunk;
- the chunk's pass (`_chunk_backward`, run by autograd after every consumer of the chunk, before any push it read):
  each source 0 .. n1 - 1 read once, a token's records read once (tensor-core products over blocks of 16 of its
  sources, bf16 operands for a bf16 bank: `_chunk_backward`'s docstring): every consumer's pair gradient summed and
  added into the source's gradient slot (an atomic add a chunk), and each consumer's dgq rows, which
  `_chunk_query_gradients` adds to its phase-2 ones: the chunk's rows of dqueries and dkey_gains in one launch.
The pushes' `source_gradient` (triton_attnres.py) hand each source its gradient slot. Memory: each chunk's o1
(CHUNK slots in the bank's dtype) and logits live from its phase 1 to its backward; the records (CHUNK slots) from
its first consumer's backward to its own, with their phase-2 dgq rows (CHUNK x at most PROGRAMS rows of D fp32); the
gradient bank (n_max fp32 slots) from the first backward. The two backward passes run at most PROGRAMS programs,
each over several tiles of tokens (`chunk_programs`, `merge_programs`): fewer partial dgq rows to write and sum.

Equal to ops.depth_mix's mix, p and every gradient: tests/test_triton.py's `test_chunked_bank_equals_reference`
(Full's and Block's patterns, consumers of older states, the card's depth, bf16), `test_model_equals_reference`
(two chunks, checkpointed blocks) and `test_compiled_blocks_keep_their_graphs_with_the_chunked_bank`;
`step_traffic` counts what each launch moves (`test_chunked_step_traffic_counts_the_launches` its launches). The
release's variants (top-k, learnt logit scale) keep triton_attnres.py's mix (residuals.py hands them no queries).
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations are read as text: no triton, no error

import torch

from depthbench.kernels import triton_attnres as attnres
from depthbench.kernels.triton_attnres import (COLUMNS, ROWS, STAGES, WEIGHT_ROWS, _backward_pass, _key_query,
                                               _row_sum, _source_pass, _weights, jit, launch_grid, moved,
                                               next_power_of_2, tl, triton)
from ops import topk_count

CHUNK = 8     # consumers a phase-1 pass serves (a power of 2): its CHUNK running mixes or records in registers
PROGRAMS = 264  # a backward pass's programs at most (the chunk's, a consumer's phase 2): 2 a streaming
                # multiprocessor of an H100 or H200 (132), 1 program resident on each at its registers; the chunk's
                # dgq rows (CHUNK D fp32 a program): 84 MB -> 5.4 MB a chunk at the card's shape, micro-batch 2
PHASE1_TOKENS = 16   # _chunk_forward's tokens a program: the rows of its logits' product (tl.dot), one a thread at
PHASE1_WARPS = 4     # 4 warps; its CHUNK x PHASE1_TOKENS x COLUMNS_TILE fp32 sums, 64 registers a thread
COLUMNS_TILE = 64    # the columns of a source a loop step reads (a power of 2: 640 = 10 x 64, no padding)
SOURCE_BLOCK = 16   # _chunk_backward's sources of a token a loop step: the rows of its tl.dot products
COLUMN_TILES = 5   # _chunk_backward's column tiles (`backward_blocks`); its source loop's stages: `backward_stages`
WARPS = 8     # every kernel here but phase 1 (PHASE1_WARPS). ptxas sm90 at the card's launch (d640, bf16 bank),
              # registers under Triton 3.9 / 3.6: _chunk_forward 138 / 179 (x 4 warps: 3 / 2 programs an SM),
              # _merge_forward 74-76 / 79-101, _merge_backward 106-117 / 123-124 (2 programs); _chunk_backward 254 /
              # 255 at 4 warps (`backward_warps`; 2 programs; no local memory in a loop; docs/speed.md)


def phase1_blocks(BT, D):
    """(BLOCK_T, BLOCK_D) of `_chunk_forward`: PHASE1_TOKENS tokens a program (the last one's masked), its sources
    read COLUMNS_TILE columns at a time."""
    return PHASE1_TOKENS, min(COLUMNS_TILE, next_power_of_2(D))


def chunk_programs(BT, D):
    """The programs of the chunk's backward pass: one a token, at most PROGRAMS (each then sums its consumers' dgq
    over several tokens: fewer partial rows to write and read back)."""
    return min(BT, PROGRAMS)


def backward_blocks(BT, D):
    """(BLOCK_J, BLOCK_D) of the chunk's backward pass (`_chunk_backward`): SOURCE_BLOCK sources of a token a loop
    step (the rows of its products), D in COLUMN_TILES tiles of BLOCK_D columns (a power of 2, at least 16):
    640 = 5 x 128, no padding."""
    return SOURCE_BLOCK, max(16, next_power_of_2(-(-D // COLUMN_TILES)))


def backward_stages(storage_bytes=2):
    """`_chunk_backward`'s source loop's num_stages: 3 for a 16-bit bank (2 buffers of the next block's v: 88 KB, 2
    programs a multiprocessor; Triton 3.6 leaves it unpipelined), 1 for an fp32 one (1,048 bytes of stack: 296)."""
    return 3 if storage_bytes == 2 else 1


def backward_warps(storage_bytes=2):
    """`_chunk_backward`'s warps: 4 for a 16-bit bank, registers uncapped (254, 2 programs a multiprocessor; at 8
    warps capped at 128 its loop spilled under Triton 3.6, 48 accesses, and issued 60% more); WARPS for an fp32 one."""
    return 4 if storage_bytes == 2 else WARPS


def backward_precision(dtype):
    """`_chunk_backward`'s products' input precision: "ieee" (exact fp32) for an fp32 bank; for a 16-bit one its
    operands are in the bank's dtype (tensor cores, fp32 sums) and the precision is not read ("tf32": Triton's
    default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def merge_blocks(BT, D):
    """(BLOCK_T, BLOCK_D) of a consumer's phase-2 backward pass (`_merge_backward`): half the forward's tokens a tile
    (blocks of 2 sources' width), so that its five tiles (dmix, v, dv, dgq, the gradient slot) fit 2 programs on a
    streaming multiprocessor (ptxas sm90 at d640, bf16 bank, pipelined: 106 registers x 8 warps; 165 at 4 tokens)."""
    return attnres.blocks(BT, D, 2)


def merge_programs(BT, D):
    """The programs of a consumer's phase-2 backward pass: one a tile of tokens (`merge_blocks`), at most PROGRAMS
    (each sums the consumer's dgq over its tiles)."""
    return min(-(-BT // merge_blocks(BT, D)[0]), PROGRAMS)

# Triton's interpreter multiplies the 16-bit operands of a tl.dot as their raw bits: under it `_product` multiplies
# the operands, rounded to the bank's dtype as on a GPU, in fp32 (the same products, exact in fp32; the sums in
# another order). A global, not a launch argument: the probe's recorded launches are the GPU's.
UPCAST_DOTS = None if tl is None else tl.constexpr(attnres.interpreted())


# ----------------------------------------------------------------------------- the kernels

@jit
def _chunk_tile(pid, BT, D, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The indices of a program's tile: rows, cols, consumers, and the masks and offsets of one slot's tile."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < BT
    mask = row_ok[:, None] & (cols[None, :] < D)
    return rows, cols, tl.arange(0, BLOCK_C), row_ok, mask, rows[:, None] * D + cols[None, :]


@jit
def _chunk_queries(q_ptr, g_ptr, cons, cols, C, D):
    """gq = g * q of the chunk's C consumers (BLOCK_C, BLOCK_D) fp32, zero in the padding."""
    ok = (cons < C)[:, None] & (cols < D)[None, :]
    at = cons[:, None] * D + cols[None, :]
    q = tl.load(q_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)


@jit
def _chunk_logits(V, q_ptr, g_ptr, logits, rows, row_ok, cons, n1, C, BT, D: tl.constexpr, eps,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Phase 1's first pass, tokens x consumers (BLOCK_T, BLOCK_C): each source's logits s of the C consumers,
    stored at `logits` (advanced one row of BT a source), their online max m and sum l = sum_j exp(s_j - m) -> lse.
    A source is read BLOCK_D columns at a time: u = <v, gq> of all C consumers as one fp32 product (`tl.dot`, "ieee":
    exact fp32, no sum across lanes per consumer), the squares summed per column and over D once a source."""
    t_rows = row_ok[:, None] & (cons < C)[None, :]
    m = tl.full((BLOCK_T, cons.shape[0]), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_T, cons.shape[0]), tl.float32)
    slot = V                                                 # advanced one slot (BT * D) per source: no int32 overflow
    for j in tl.range(0, n1, num_stages=NUM_STAGES):
        squares = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        u = tl.zeros((BLOCK_T, cons.shape[0]), tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            v = tl.load(slot + rows[:, None] * D + cols[None, :],
                        mask=row_ok[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
            squares += v * v
            u = tl.dot(v, _chunk_queries_t(q_ptr, g_ptr, cons, cols=cols, C=C, D=D), u, input_precision="ieee")
        s = u * (1.0 / tl.sqrt(tl.sum(squares, axis=1) / D + eps))[:, None]
        tl.store(logits, s, mask=t_rows)
        m_new = tl.maximum(m, s)
        l = l * tl.exp(m - m_new) + tl.exp(s - m_new)
        m = m_new
        slot += BT * D
        logits += BT
    return m + tl.log(l)


@jit
def _chunk_queries_t(q_ptr, g_ptr, cons, cols, C, D):
    """gq = g * q of the chunk's C consumers, transposed: (BLOCK_D, BLOCK_C) fp32, zero in the padding."""
    ok = (cols < D)[:, None] & (cons < C)[None, :]
    at = cons[None, :] * D + cols[:, None]
    q = tl.load(q_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)


@jit
def _chunk_forward(V, q_ptr, g_ptr, o1_ptr, lse1_ptr, logits_ptr, n1, C, BT, D: tl.constexpr, eps,
                   BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Phase 1 for tokens [pid BLOCK_T, (pid + 1) BLOCK_T): the C consumers' (q, g rows from q_ptr, g_ptr) softmax
    over sources 0 .. n1 - 1 of V (n_max, BT, D) -> o1 (C, BT, D) in o1_ptr's dtype, lse1 (C, BT) fp32 and the
    logits (C, n1, BT) fp32. Two passes over the sources: their logits and lse1 (`_chunk_logits`), then for each
    tile of BLOCK_D columns o1 = sum_j exp(s_j - lse1) v_j (no sum over D in it, so no rescaling and no barrier):
    each source read twice, the CHUNK running mixes of a token never all in registers at once."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cons = tl.arange(0, BLOCK_C)
    row_ok = rows < BT
    t_rows = row_ok[:, None] & (cons < C)[None, :]                                     # (BLOCK_T, BLOCK_C)
    logits = logits_ptr + cons[None, :] * (n1 * BT) + rows[:, None]
    lse = _chunk_logits(V, q_ptr, g_ptr, logits, rows=rows, row_ok=row_ok, cons=cons, n1=n1, C=C, BT=BT, D=D, eps=eps,
                        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, NUM_STAGES=NUM_STAGES)
    tl.store(lse1_ptr + cons[None, :] * BT + rows[:, None], lse, mask=t_rows)
    tl.debug_barrier()                                   # the logits stored above are visible to every thread
    for d0 in tl.static_range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols < D)[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C, BLOCK_D), tl.float32)
        slot = V
        for j in tl.range(0, n1, num_stages=NUM_STAGES):
            v = tl.load(slot + offsets, mask=mask, other=0.0).to(tl.float32)
            w = tl.exp(tl.load(logits + j * BT, mask=t_rows, other=float("-inf")) - lse)
            acc += w[:, :, None] * v[:, None, :]
            slot += BT * D
        tl.store(o1_ptr + cons[None, :, None] * (BT * D) + offsets[:, None, :], acc,
                 mask=(cons < C)[None, :, None] & mask[:, None, :])


@jit
def _merge_forward(V, extra, q_ptr, g_ptr, o1_ptr, lse1_ptr, logits1_ptr, mix_ptr, lse_ptr, p_ptr, n1, n2, m2, BT,
                   D, eps, HAS_EXTRA: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_STAGES: tl.constexpr, BLOCK_J: tl.constexpr):
    """Phase 2 of one consumer: its online softmax from (o1, lse1) over the n2 sources of V (the bank from slot n1)
    and, with HAS_EXTRA, the extra (m2 = n2 + 1 sources then, else n2) -> mix (fp32), lse, and the weights p
    (n1 + m2, BT): exp(s - lse) of phase 1's logits (logits1_ptr (n1, BT)) and of its own."""
    rows, cols, cons, row_ok, mask, offsets = _chunk_tile(tl.program_id(0), BT, D, BLOCK_C=1, BLOCK_T=BLOCK_T,
                                                          BLOCK_D=BLOCK_D)
    gq = _key_query(q_ptr, g_ptr, cols, D)
    m = tl.load(lse1_ptr + rows, mask=row_ok, other=0.0)
    l = tl.full((BLOCK_T,), 1.0, tl.float32)
    acc = tl.load(o1_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m, l, acc = _source_pass(V, extra, p_ptr + n1 * BT, n2, offsets=offsets, mask=mask, rows=rows, row_ok=row_ok,
                             gq=gq, m=m, l=l, acc=acc, BT=BT, D=D, eps=eps, HAS_EXTRA=HAS_EXTRA,
                             NUM_STAGES=NUM_STAGES)
    tl.store(mix_ptr + offsets, acc / l[:, None], mask=mask)
    lse = m + tl.log(l)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.debug_barrier()                                   # the logits stored above are visible to every thread
    _weights(logits1_ptr, p_ptr, n1, rows=rows, row_ok=row_ok, lse=lse, BT=BT, BLOCK_J=BLOCK_J)   # phase 1's logits
    _weights(p_ptr + n1 * BT, p_ptr + n1 * BT, m2, rows=rows, row_ok=row_ok, lse=lse, BT=BT, BLOCK_J=BLOCK_J)  # its own


@jit
def _merge_backward(V, extra, q_ptr, g_ptr, mix_ptr, dmix_ptr, lse_ptr, dV, d_extra, incoming, dgq_ptr, record_ptr,
                    scalars_ptr, ran_ptr, n2, P, BT, D, eps, HAS_EXTRA: tl.constexpr, HAS_INCOMING: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The consumer's pass, P programs each over the token tiles pid, pid + P, ...: its phase-2 sources' dv added
    into their gradient slots (dV from slot n1, fp32), the extra's dv (+ `incoming`, with HAS_INCOMING) to d_extra,
    its share of dgq over the program's tiles to row pid of dgq_ptr; its record for the chunk's pass: dmix
    (record_ptr, the bank's dtype), delta and lse (scalars_ptr (2, BT)), and 1 at ran_ptr."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    gq = _key_query(q_ptr, g_ptr, cols, D)
    dgq = tl.zeros((BLOCK_D,), tl.float32)
    for tile in range(pid, tl.cdiv(BT, BLOCK_T), P):
        rows, cols, cons, row_ok, mask, offsets = _chunk_tile(tile, BT, D, BLOCK_C=1, BLOCK_T=BLOCK_T,
                                                              BLOCK_D=BLOCK_D)
        dmix = tl.load(dmix_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(tl.load(mix_ptr + offsets, mask=mask, other=0.0) * dmix, axis=1)   # <mix, dmix> = sum p_j dp_j
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        dgq += tl.sum(_backward_pass(V, extra, dV, d_extra, incoming=incoming, n=n2, offsets=offsets, mask=mask,
                                     gq=gq, dmix=dmix, lse=lse, delta=delta, BT=BT, D=D, eps=eps, DEFER=False,
                                     HAS_EXTRA=HAS_EXTRA, HAS_INCOMING=HAS_INCOMING, BLOCK_T=BLOCK_T,
                                     BLOCK_D=BLOCK_D, NUM_STAGES=NUM_STAGES), axis=0)
        tl.store(record_ptr + offsets, dmix, mask=mask)
        tl.store(scalars_ptr + rows, delta, mask=row_ok)
        tl.store(scalars_ptr + BT + rows, lse, mask=row_ok)
    if pid == 0:
        tl.store(ran_ptr, 1)
    tl.store(dgq_ptr + pid * D + cols, dgq, mask=cols < D)


@jit
def _stacked_rows(q_ptr, g_ptr, records, ran_ptr, t, C, BT, D, lo, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [lo, lo + BLOCK_D) of the chunk's consumers' gq and dmix at token t, interleaved (2 BLOCK_C, BLOCK_D)
    fp32: row 2c = consumer c's gq (g * q), row 2c + 1 its dmix (0 where its backward did not run); 0 in the padding.
    One operand serves both products of a source block: <v, gq> and <v, dmix> in one `tl.dot`, and dv's two terms.
    The scalar lo is added to the pointers (one offsets tensor for every tile: fewer registers held)."""
    rows = tl.arange(0, 2 * BLOCK_C)
    c = rows // 2
    cols = tl.arange(0, BLOCK_D)
    ok = (c < C)[:, None] & (cols < D - lo)[None, :]
    is_q = (rows % 2 == 0)[:, None]
    ran = (tl.load(ran_ptr + c, mask=c < C, other=0) != 0)[:, None]
    at = c[:, None] * D + cols[None, :]
    q_ptr += lo
    g_ptr += lo
    records += t * D + lo
    gq = (tl.load(q_ptr + at, mask=ok & is_q, other=0.0).to(tl.float32)
          * tl.load(g_ptr + at, mask=ok & is_q, other=0.0).to(tl.float32))
    dmix = tl.load(records + c[:, None] * (BT * D) + cols[None, :], mask=ok & ran & ~is_q, other=0.0)
    return gq + dmix.to(tl.float32)


@jit
def _stacked_tiles(q_ptr, g_ptr, records, ran_ptr, t, C, BT, D, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_stacked_rows` of token t in COLUMN_TILES column tiles, in the bank's dtype (records')."""
    dtype = records.dtype.element_ty
    return (_stacked_rows(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, lo=0, BLOCK_C=BLOCK_C,
                          BLOCK_D=BLOCK_D).to(dtype),
            _stacked_rows(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, lo=BLOCK_D, BLOCK_C=BLOCK_C,
                          BLOCK_D=BLOCK_D).to(dtype),
            _stacked_rows(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, lo=2 * BLOCK_D, BLOCK_C=BLOCK_C,
                          BLOCK_D=BLOCK_D).to(dtype),
            _stacked_rows(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, lo=3 * BLOCK_D, BLOCK_C=BLOCK_C,
                          BLOCK_D=BLOCK_D).to(dtype),
            _stacked_rows(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, lo=4 * BLOCK_D, BLOCK_C=BLOCK_C,
                          BLOCK_D=BLOCK_D).to(dtype))


@jit
def _product(a, b, acc, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """a b + acc (fp32) of a and b in `dtype` (the bank's): tensor cores for a 16-bit bank, exact fp32 ("ieee") for
    an fp32 one; under the interpreter the rounded operands multiplied in fp32 (UPCAST_DOTS)."""
    a = a.to(dtype)
    b = b.to(dtype)
    if UPCAST_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@jit
def _block_products(slot, offsets, src_ok, s, x, sq, lo, D, PRECISION: tl.constexpr):
    """Column tile [lo, lo + BLOCK_D) of a block of sources v (slot + offsets, (BLOCK_J, BLOCK_D)): x += v s^T
    (BLOCK_J, 2 BLOCK_C), every consumer's <v, gq> and <v, dmix>, and sq += v v^T (BLOCK_J, BLOCK_J), whose diagonal
    is each source's sum of squares (v exact in the bank's dtype: its squares exact in fp32) -> (x, sq, v)."""
    mask = src_ok[:, None] & (tl.arange(0, offsets.shape[1]) < D - lo)[None, :]
    v = tl.load(slot + lo + offsets, mask=mask, other=0.0)
    return (_product(v, tl.trans(s), x, dtype=v.dtype, PRECISION=PRECISION),
            _product(v, tl.trans(v), sq, dtype=v.dtype, PRECISION=PRECISION), v)


@jit
def _block_gradient(grad, v, offsets, src_ok, a, s, bt, k, dgq, lo, D, PRECISION: tl.constexpr):
    """Column tile [lo, lo + BLOCK_D) of a block of sources v (read once, `_block_products`') and of their fp32
    gradient slots (grad + offsets): dv = a s + k v added by an atomic add (no read of the slots: the pipelined loop
    stages v alone; an element is one thread's; a: b and p interleaved as s' rows are (BLOCK_J, 2 BLOCK_C), k
    (BLOCK_J, BLOCK_J) diagonal) -> dgq^T + v^T bt (BLOCK_D, BLOCK_C; bt = b (BLOCK_J, BLOCK_C))."""
    mask = src_ok[:, None] & (tl.arange(0, offsets.shape[1]) < D - lo)[None, :]
    dv = _product(a, s, _product(k, v, tl.zeros(v.shape, tl.float32), dtype=v.dtype, PRECISION=PRECISION),
                  dtype=v.dtype, PRECISION=PRECISION)
    tl.atomic_add(grad + lo + offsets, dv, mask=mask, sem="relaxed")
    return _product(tl.trans(v), bt, dgq, dtype=v.dtype, PRECISION=PRECISION)


@jit
def _store_dgq(dgq_rows, dgq, cons, C, D, lo, BLOCK_D: tl.constexpr):
    """A column tile [lo, lo + BLOCK_D) of the consumers' dgq^T (BLOCK_D, BLOCK_C) into their rows (C, P, D):
    dgq_rows points at the program's row with each consumer's stride applied, (1, BLOCK_C)."""
    cols = lo + tl.arange(0, BLOCK_D)
    tl.store(dgq_rows + cols[:, None], dgq, mask=(cons < C)[None, :] & (cols < D)[:, None])


@jit
def _store_dgq_tiles(dgq_rows, dgq0, dgq1, dgq2, dgq3, dgq4, cons, C, D, BLOCK_D: tl.constexpr):
    """The COLUMN_TILES column tiles of the consumers' dgq^T into their rows (C, P, D)."""
    _store_dgq(dgq_rows, dgq0, cons, C, D=D, lo=0, BLOCK_D=BLOCK_D)
    _store_dgq(dgq_rows, dgq1, cons, C, D=D, lo=BLOCK_D, BLOCK_D=BLOCK_D)
    _store_dgq(dgq_rows, dgq2, cons, C, D=D, lo=2 * BLOCK_D, BLOCK_D=BLOCK_D)
    _store_dgq(dgq_rows, dgq3, cons, C, D=D, lo=3 * BLOCK_D, BLOCK_D=BLOCK_D)
    _store_dgq(dgq_rows, dgq4, cons, C, D=D, lo=4 * BLOCK_D, BLOCK_D=BLOCK_D)


@jit
def _block_weights(x, squares, src_ok, valid, lse, delta, D: tl.constexpr, eps):
    """A block's x = [<v, gq>, <v, dmix>] interleaved (BLOCK_J, 2 BLOCK_C) and squares = v v^T -> (a, b, k):
    a = [b, p] interleaved as x (b = ds r, the gradient through u; p the weights, the gradient through dmix), b
    (BLOCK_J, BLOCK_C), k = diag(-sum_c ds u r^3 / D) (through r: as _source_gradient; a diagonal matrix, so that
    k v is a product); p and b 0 for sources past n1 and idle consumers."""
    diagonal = tl.arange(0, squares.shape[0])
    on_diagonal = diagonal[:, None] == diagonal[None, :]
    r = 1.0 / tl.sqrt(tl.sum(tl.where(on_diagonal, squares, 0.0), axis=1) / D + eps)
    u, vd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))              # (BLOCK_J, BLOCK_C) each
    p = tl.where(src_ok[:, None] & valid[None, :], tl.exp(r[:, None] * u - lse[None, :]), 0.0)
    ds = p * (vd - delta[None, :])
    b = ds * r[:, None]
    k = tl.where(on_diagonal, (tl.sum(-ds * u, axis=1) * (r * r * r) / D)[:, None], 0.0)
    return tl.reshape(tl.join(b, p), x.shape), b, k


@jit(do_not_specialize=["n1"])   # n1 = 1 (Block AttnRes' first chunks) as a constant: the source loop gone, spills
def _chunk_backward(V, q_ptr, g_ptr, records, scalars_ptr, ran_ptr, dV, dgq_ptr, n1, C, P, BT, D: tl.constexpr, eps,
                    BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                    PRECISION: tl.constexpr):
    """The chunk's pass, P programs each over the tokens pid, pid + P, ...: for each source j < n1 (V, its gradient
    slot in dV, fp32), the sum over the chunk's consumers that ran their backward (ran_ptr[c] != 0) of the pair's dv,
    from their records (records (C, BT, D), scalars (C, 2, BT): delta, lse), added into dV[j] once; each consumer's
    share of dgq over the program's tokens to dgq_ptr (C, P, D), row pid. A token's sources in blocks of BLOCK_J,
    every sum over D, the consumers or the block's sources a product (`_product`): x = v s^T (<v, gq> and <v, dmix>,
    `_stacked_rows`), v v^T, dv = a s + k v, dgq^T += v^T b; D in COLUMN_TILES tiles of BLOCK_D columns.
    PRECISION (`backward_precision`): an fp32 bank's products exact ("ieee"); a 16-bit bank's on tensor cores, fp32
    sums, the operands in its dtype: v, dmix exact, gq, p, b and k rounded (2^-9 a term; tests: cosine 0.999)."""
    pid = tl.program_id(0)
    cons = tl.arange(0, BLOCK_C)
    srcs = tl.arange(0, BLOCK_J)
    valid = (cons < C) & (tl.load(ran_ptr + cons, mask=cons < C, other=0) != 0)
    dgq0 = tl.zeros((BLOCK_D, BLOCK_C), tl.float32)
    dgq1 = tl.zeros((BLOCK_D, BLOCK_C), tl.float32)
    dgq2 = tl.zeros((BLOCK_D, BLOCK_C), tl.float32)
    dgq3 = tl.zeros((BLOCK_D, BLOCK_C), tl.float32)
    dgq4 = tl.zeros((BLOCK_D, BLOCK_C), tl.float32)
    offsets = srcs[:, None] * (BT * D) + tl.arange(0, BLOCK_D)[None, :]     # a block's slots from its first
    for t in range(pid, BT, P):
        s0, s1, s2, s3, s4 = _stacked_tiles(q_ptr, g_ptr, records, ran_ptr, t=t, C=C, BT=BT, D=D, BLOCK_C=BLOCK_C,
                                            BLOCK_D=BLOCK_D)
        delta = tl.load(scalars_ptr + cons * (2 * BT) + t, mask=valid, other=0.0)
        lse = tl.load(scalars_ptr + cons * (2 * BT) + BT + t, mask=valid, other=0.0)
        slot = V + t * D                                     # advanced BLOCK_J slots a block
        grad = dV + t * D
        for j0 in tl.range(0, n1, BLOCK_J, num_stages=NUM_STAGES):
            ok = j0 + srcs < n1
            x = tl.zeros((BLOCK_J, 2 * BLOCK_C), tl.float32)
            sq = tl.zeros((BLOCK_J, BLOCK_J), tl.float32)
            x, sq, v0 = _block_products(slot, offsets, ok, s0, x=x, sq=sq, lo=0, D=D, PRECISION=PRECISION)
            x, sq, v1 = _block_products(slot, offsets, ok, s1, x=x, sq=sq, lo=BLOCK_D, D=D, PRECISION=PRECISION)
            x, sq, v2 = _block_products(slot, offsets, ok, s2, x=x, sq=sq, lo=2 * BLOCK_D, D=D, PRECISION=PRECISION)
            x, sq, v3 = _block_products(slot, offsets, ok, s3, x=x, sq=sq, lo=3 * BLOCK_D, D=D, PRECISION=PRECISION)
            x, sq, v4 = _block_products(slot, offsets, ok, s4, x=x, sq=sq, lo=4 * BLOCK_D, D=D, PRECISION=PRECISION)
            a, b, k = _block_weights(x, sq, ok, valid, lse=lse, delta=delta, D=D, eps=eps)
            dgq0 = _block_gradient(grad, v0, offsets, ok, a=a, s=s0, bt=b, k=k, dgq=dgq0, lo=0, D=D,
                                   PRECISION=PRECISION)
            dgq1 = _block_gradient(grad, v1, offsets, ok, a=a, s=s1, bt=b, k=k, dgq=dgq1, lo=BLOCK_D, D=D,
                                   PRECISION=PRECISION)
            dgq2 = _block_gradient(grad, v2, offsets, ok, a=a, s=s2, bt=b, k=k, dgq=dgq2, lo=2 * BLOCK_D, D=D,
                                   PRECISION=PRECISION)
            dgq3 = _block_gradient(grad, v3, offsets, ok, a=a, s=s3, bt=b, k=k, dgq=dgq3, lo=3 * BLOCK_D, D=D,
                                   PRECISION=PRECISION)
            dgq4 = _block_gradient(grad, v4, offsets, ok, a=a, s=s4, bt=b, k=k, dgq=dgq4, lo=4 * BLOCK_D, D=D,
                                   PRECISION=PRECISION)
            slot += BLOCK_J * BT * D
            grad += BLOCK_J * BT * D
    _store_dgq_tiles(dgq_ptr + cons[None, :] * (P * D) + pid * D, dgq0, dgq1, dgq2, dgq3=dgq3, dgq4=dgq4, cons=cons,
                     C=C, D=D, BLOCK_D=BLOCK_D)


@jit
def _chunk_query_gradients(dgq_rows, merge_rows, ran_ptr, q_ptr, g_ptr, dq_ptr, dg_ptr, P, P2, D,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Consumer c = program_id(1) of the chunk: dgq = the sum of its P partial rows from the chunk's pass
    (dgq_rows + c P D) and, where its backward ran (ran_ptr[c] != 0), of its phase-2 pass's P2 (merge_rows + c P2 D);
    dq = dgq g and dg = dgq q into row c of dq_ptr, dg_ptr (the chunk's rows), columns [pid BLOCK_C, +BLOCK_C)."""
    c = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    ran_rows = P2 * (tl.load(ran_ptr + c) != 0).to(tl.int32)           # no phase-2 rows where it did not run
    dgq = (_row_sum(dgq_rows + c * P * D, n_rows=P, cols=cols, col_ok=col_ok, D=D, BLOCK_R=BLOCK_R)
           + _row_sum(merge_rows + c * P2 * D, n_rows=ran_rows, cols=cols, col_ok=col_ok, D=D, BLOCK_R=BLOCK_R))
    q = tl.load(q_ptr + c * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + c * D + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(dq_ptr + c * D + cols, dgq * g, mask=col_ok)
    tl.store(dg_ptr + c * D + cols, dgq * q, mask=col_ok)


# ----------------------------------------------------------------------------- autograd and the bank

class Chunk:
    """Phase 1 of the consumers of rows r0 .. r0 + C - 1 over the bank's first n1 sources: o1 (C, B, T, D) in the
    bank's dtype, lse1 (C, B T) and logits (C, n1, B T) fp32, and `token` (what its consumers' mixes take, so that
    autograd runs the chunk's backward after theirs); their records and phase-2 query rows (`record`), made by the
    first backward."""

    def __init__(self, r0, C, n1, V):
        B, T, D = V.shape[1:]
        self.r0, self.C, self.n1 = r0, C, n1
        self.o1 = V.new_empty((C, B, T, D))
        self.lse1 = V.new_empty((C, B * T), dtype=torch.float32)
        self.logits = V.new_empty((C, n1, B * T), dtype=torch.float32)
        self.records = self.scalars = self.ran = self.merge_rows = self.token = None

    def record(self, i, programs):
        """(dmix slot, scalars (2, B T), ran flag, dgq rows (programs, D)) of consumer i's record: dmix in the bank's
        dtype, delta and lse; its phase-2 pass's partial dgq rows (fp32), which the chunk's pass turns into its rows
        of dqueries and dkey_gains with its own (one launch a chunk, none a consumer)."""
        if self.records is None:
            self.records = torch.empty_like(self.o1)
            self.scalars = self.lse1.new_empty((self.C, 2, self.lse1.shape[1]))
            self.ran = torch.zeros(self.C, dtype=torch.int32, device=self.o1.device)
            self.merge_rows = self.lse1.new_empty((self.C, programs, self.o1.shape[-1]))
        return self.records[i], self.scalars[i], self.ran[i:], self.merge_rows[i]


class ChunkPass(torch.autograd.Function):
    """Phase 1 (forward, `_chunk_forward` into the chunk) -> a token; backward, the chunk's pass (`_chunk_backward`,
    into the bank's gradient slots) -> the chunk's rows of dqueries and dkey_gains (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, bank, chunk, queries, key_gains, token):
        V = bank.slots[0]
        B, T, D = V.shape[1:]
        BLOCK_T, BLOCK_D = phase1_blocks(B * T, D)
        _chunk_forward[(triton.cdiv(B * T, BLOCK_T),)](V, queries[chunk.r0], key_gains[chunk.r0], o1_ptr=chunk.o1,
                                                        lse1_ptr=chunk.lse1, logits_ptr=chunk.logits, n1=chunk.n1,
                                                        C=chunk.C, BT=B * T, D=D, eps=bank.norm_eps, BLOCK_C=CHUNK,
                                                        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, NUM_STAGES=STAGES,
                                                        num_warps=PHASE1_WARPS)
        ctx.save_for_backward(queries, key_gains)
        ctx.bank, ctx.chunk = bank, chunk
        ctx.set_materialize_grads(False)
        return torch.empty((), dtype=torch.float32, device=V.device)

    @staticmethod
    def backward(ctx, dtoken):
        chunk, bank = ctx.chunk, ctx.bank
        queries, key_gains = ctx.saved_tensors
        if chunk.records is None:                            # no consumer of the chunk ran its backward
            return None, None, None, None, None
        V, dV = bank.slots[0], bank.gradients()[0]
        B, T, D = V.shape[1:]
        BLOCK_J, BLOCK_D = backward_blocks(B * T, D)
        P = chunk_programs(B * T, D)
        dgq_rows = chunk.lse1.new_empty((chunk.C, P, D))
        _chunk_backward[(P,)](V, queries[chunk.r0], key_gains[chunk.r0], chunk.records, scalars_ptr=chunk.scalars,
                              ran_ptr=chunk.ran, dV=dV, dgq_ptr=dgq_rows, n1=chunk.n1, C=chunk.C, P=P, BT=B * T,
                              D=D, eps=bank.norm_eps, BLOCK_C=CHUNK, BLOCK_J=BLOCK_J, BLOCK_D=BLOCK_D,
                              NUM_STAGES=backward_stages(V.element_size()), PRECISION=backward_precision(V.dtype),
                              num_warps=backward_warps(V.element_size()))
        dq, dg = torch.zeros_like(queries), torch.zeros_like(key_gains)
        BLOCK_C = min(COLUMNS, next_power_of_2(D))
        _chunk_query_gradients[(triton.cdiv(D, BLOCK_C), chunk.C)](dgq_rows, chunk.merge_rows, chunk.ran,
                                                                   q_ptr=queries[chunk.r0], g_ptr=key_gains[chunk.r0],
                                                                   dq_ptr=dq[chunk.r0], dg_ptr=dg[chunk.r0], P=P,
                                                                   P2=chunk.merge_rows.shape[1], D=D, BLOCK_R=ROWS,
                                                                   BLOCK_C=BLOCK_C)
        # the chunk's memory, no longer read, and a checkpointed block's recomputed phase 1 with it
        chunk.records = chunk.scalars = chunk.o1 = chunk.logits = chunk.merge_rows = None
        bank.chunks.pop(chunk.r0, None)
        return None, None, dq, dg, None


class Merge(torch.autograd.Function):
    """Phase 2 of consumer i of the chunk over the bank's first n sources and the extra. (bank, chunk, i, n, query,
    key_gain, token, chunk_token, extra) -> (mix (B, T, D) fp32, p (m, B, T) not differentiable, the extra passed
    on: the kernel adds its later uses' gradient to the mix's); query and key_gain are row r0 + i of the queries and
    key gains the chunk's phase 1 took, detached.
    Backward: the extra's gradient; its phase-2 sources' gradients into the gradient slots; its record for the
    chunk's pass, with its partial dgq rows: the chunk's pass hands the queries and key gains this pass's share
    of their gradients with its own (so none here: no launch per consumer for dq, dg). No gradient for the tokens
    (they order the backward)."""

    @staticmethod
    def forward(ctx, bank, chunk, i, n, query, key_gain, token, chunk_token, extra):
        V = bank.slots[0]
        B, T, D = V.shape[1:]
        n1, n2 = chunk.n1, n - chunk.n1
        m2 = n2 + (extra is not None)
        extra_in = V if extra is None else extra.contiguous()
        mix = V.new_empty((B, T, D), dtype=torch.float32)
        lse = V.new_empty((B * T,), dtype=torch.float32)
        p = V.new_empty((n1 + m2, B, T), dtype=torch.float32)
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        _merge_forward[grid](V[n1] if n2 else V, extra_in, query, key_gain, o1_ptr=chunk.o1[i], lse1_ptr=chunk.lse1[i],
                             logits1_ptr=chunk.logits[i], mix_ptr=mix, lse_ptr=lse, p_ptr=p, n1=n1, n2=n2, m2=m2,
                             BT=B * T, D=D, eps=bank.norm_eps, HAS_EXTRA=extra is not None, BLOCK_T=BLOCK_T,
                             BLOCK_D=BLOCK_D, NUM_STAGES=STAGES, BLOCK_J=WEIGHT_ROWS, num_warps=WARPS)
        ctx.save_for_backward(query, key_gain, mix, lse, *([] if extra is None else [extra_in]))
        ctx.bank, ctx.chunk, ctx.i, ctx.n = bank, chunk, i, n
        ctx.extra_dtype = None if extra is None else extra.dtype
        ctx.mark_non_differentiable(p)
        ctx.set_materialize_grads(False)
        return mix, p, extra                               # extra returned as it is: autograd makes it a view

    @staticmethod
    def backward(ctx, dmix, _, d_passed):
        if dmix is None:                                   # the mix unused: the extra's gradient is its other uses'
            return (None,) * 8 + (d_passed,)
        bank, chunk = ctx.bank, ctx.chunk
        query, key_gain, mix, lse, *extra = ctx.saved_tensors
        V, dV = bank.slots[0], bank.gradients()[0]
        B, T, D = V.shape[1:]
        n1, n2 = chunk.n1, ctx.n - chunk.n1
        BLOCK_T, BLOCK_D = merge_blocks(B * T, D)
        programs = merge_programs(B * T, D)
        record, scalars, ran, dgq_rows = chunk.record(ctx.i, programs=programs)
        d_extra = torch.empty(mix.shape, dtype=ctx.extra_dtype, device=mix.device) if extra else None
        V2, dV2 = (V[n1], dV[n1]) if n2 else (V, dV)                 # from slot n1 (placeholders without sources)
        extra_in, d_extra_in = (extra[0], d_extra) if extra else (V, dV)
        incoming = d_extra_in if d_passed is None else d_passed.contiguous()      # the extra's other uses' gradient
        _merge_backward[(programs,)](V2, extra_in, query, key_gain, mix_ptr=mix, dmix_ptr=dmix.contiguous(),
                                     lse_ptr=lse, dV=dV2, d_extra=d_extra_in, incoming=incoming, dgq_ptr=dgq_rows,
                                     record_ptr=record, scalars_ptr=scalars, ran_ptr=ran, n2=n2, P=programs,
                                     BT=B * T, D=D, eps=bank.norm_eps, HAS_EXTRA=bool(extra),
                                     HAS_INCOMING=d_passed is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                                     NUM_STAGES=STAGES, num_warps=WARPS)
        return None, None, None, None, None, None, None, None, d_extra       # dq, dg: by the chunk's pass


class DepthBank(attnres.DepthBank):
    """triton_attnres.DepthBank (the same bank, pushes and backward) whose `mix`, given the consumer's row of the
    queries the bank was started with (its Site), runs the two phases: the chunk's first consumer (row r0, a multiple of
    CHUNK) runs phase 1, each consumer phase 2. Without queries (the release's variants, DenseFormer's and MUDD's
    banks), without a row, or for a consumer of a state older than its chunk's phase 1: triton_attnres's mix."""

    @classmethod
    def start(cls, first, n_max, eps=1e-5, queries=None, key_gains=None):
        bank = attnres.DepthBank.start(first, n_max, eps)
        if not isinstance(bank, attnres.DepthBank):           # kernels.py's bank (no key norm, no kernel here)
            return bank
        bank.bank.queries = None if queries is None else (queries, key_gains)
        bank.bank.chunks = {}                                 # first row -> its Chunk
        return cls(bank.bank, bank.n, bank.token)

    @torch.compiler.disable
    def push(self, v):
        pushed = super().push(v)
        return DepthBank(pushed.bank, pushed.n, pushed.token)

    @torch.compiler.disable
    def mix(self, query, key_gain, eps, extra=None, topk_fraction=1.0, site=None):
        """triton_attnres.DepthBank's mix; site: the consumer's Site, whose `row_index` (an int, read here in eager
        code: a compiled block would guard on it) is its row of the bank's queries. The two phases read that row of
        the queries and key gains the bank was started with (query and key_gain are those rows: residuals.py's
        Site.pick) and hand them their gradients in the chunk's pass, not through query and key_gain. The extra is
        passed on by Merge: the gradient of its later uses (Block AttnRes' next write) meets the mix's in its kernel."""
        m = self.n + (extra is not None)
        params = getattr(self.bank, "queries", None)
        if site is None or params is None or topk_count(m, topk_fraction) < m:
            return super().mix(query, key_gain, eps, extra=extra, topk_fraction=topk_fraction)
        if eps != self.bank.norm_eps:
            raise ValueError(f"the bank's key norm uses eps {self.bank.norm_eps}, not {eps}")
        row = site.row_index
        chunk = self.chunk(row, *params)
        if chunk is None:
            return super().mix(query, key_gain, eps, extra=extra)
        queries, key_gains = params
        mix, p, passed = Merge.apply(self.bank, chunk, row - chunk.r0, self.n, queries[row].detach(),
                                     key_gains[row].detach(), self.token, chunk.token, extra)
        return mix, p.movedim(0, -1), passed

    def chunk(self, row, queries, key_gains):
        """The Chunk serving `row`: phase 1 runs at the chunk's first row (again, when a checkpointed block recomputes
        it), or for a row whose chunk has not run; None when the chunk read more sources than this state holds."""
        r0 = row - row % CHUNK
        chunk = self.bank.chunks.get(r0)
        if row == r0 or chunk is None:
            chunk = Chunk(r0, min(CHUNK, len(queries) - r0), self.n, self.bank.slots[0])
            chunk.token = ChunkPass.apply(self.bank, chunk, queries, key_gains, self.token)
            self.bank.chunks[r0] = chunk
        return chunk if chunk.n1 <= self.n else None


# ----------------------------------------------------------------------------- what a step moves (the roofline)

def phase_traffic(n1, n, tokens, D, extra=False, storage_bytes=2, incoming=False):
    """[moved] of one consumer's launch each way over phase 1's n1 sources and its n: phase 2's forward
    (`_merge_forward`) and backward (`_merge_backward`; its dgq rows are summed by the chunk's pass, `chunk_traffic`).
    With S = tokens D, n2 = n - n1 sources pushed since phase 1, m2 = n2 + extra, E = 4 S if extra else 0, P = the
    backward's programs (`merge_programs`), I = E with `incoming` (the extra has later uses: their gradient is read and
    added to the extra's), else 0:

        forward   read     S sb (o1) + 4 tokens (lse1, phase 1's logits n1 times, its own logits m2 times)
                           + n2 S sb + E + 8 D (q, g)
                  written  4 S (mix) + 4 tokens (lse, p: n1 + m2, its logits first: m2)
        backward  read     8 S (mix, dmix) + 4 tokens (lse) + 8 D + n2 S sb + E + I + 4 n2 S (the gradient slots)
                  written  4 n2 S + E (the extra's dv) + S sb + 8 tokens + 4 (its record: dmix, delta, lse, ran)
                           + 4 P D (dgq's rows)."""
    S, n2 = tokens * D, n - n1
    m2, E = n2 + int(extra), 4 * S * int(extra)
    P = merge_programs(tokens, D)
    return [moved(S * storage_bytes + 4 * tokens * (1 + n1 + m2) + n2 * S * storage_bytes + E + 8 * D,
                  4 * S + 4 * tokens * (1 + n1 + 2 * m2), launch="_merge_forward"),
            moved(8 * S + 4 * tokens + 8 * D + n2 * S * storage_bytes + E * (1 + int(incoming)) + 4 * n2 * S,
                  4 * n2 * S + E + S * storage_bytes + 8 * tokens + 4 + 4 * P * D, launch="_merge_backward")]


def chunk_traffic(n1, C, rows, tokens, D, storage_bytes=2):
    """[moved] of a chunk's phase 1 over n1 sources for C consumers, the queries and key gains (rows, D):
    forward `_chunk_forward` (read the sources twice, once for the logits and once for o1, q and g, and the logits
    back (once: its later column tiles' reads of them are the L2's); write o1 in the bank's dtype, lse1 and the
    logits); backward, the ran flags' "zeros" (at its first consumer's backward), `_chunk_backward` (the sources
    once, the C records, the gradient slots read and written once), dqueries' and dkey_gains' "zeros",
    `_chunk_query_gradients` (the chunk pass's P dgq rows and each consumer's phase-2 P2, the ran flags), and
    autograd's two "add"s of them into the parameters' other gradients."""
    S, R = tokens * D, rows * D
    P, P2 = chunk_programs(tokens, D), merge_programs(tokens, D)
    return [moved(2 * n1 * S * storage_bytes + 8 * D * C + 4 * tokens * C * (1 + n1),
                  C * S * storage_bytes + 4 * tokens * C * (1 + n1), launch="_chunk_forward"),
            moved(0, 4 * C, launch="zeros"),
            moved(n1 * S * storage_bytes + C * (S * storage_bytes + 8 * tokens + 4 + 8 * D) + 4 * n1 * S,
                  4 * n1 * S + 4 * P * C * D, launch="_chunk_backward"),
            moved(0, 8 * R, launches=2, launch="zeros"),
            moved(4 * (P + P2) * C * D + 4 * C + 8 * D * C, 8 * D * C, launch="_chunk_query_gradients"),
            moved(16 * R, 8 * R, launches=2, launch="add")]


def step_traffic(reads, n_max, tokens, D, extra=False, storage_bytes=2):
    """[moved] of a whole step of one bank served by chunks: `reads` = the bank sources consumer row i = 0, 1, ...
    reads (forward order; each reads every source pushed before it), the bank n_max slots; rows r0 = 0, CHUNK, ...
    start a chunk over the sources their consumer reads. Also: the read of sublayer 0's source (`read_traffic`),
    each push's "copy" in (forward; its backward hands on its gradient slot: no launch), the gradient bank's "zeros"
    (at the first backward). With an extra source (Block AttnRes' open sum, fp32), every consumer but the last (the
    head) passes it on to a second use (the next write's sum, or the push that closes its group): that use's gradient
    is read by the consumer's `_merge_backward` and added to the mix's there (`phase_traffic`'s incoming), where
    autograd would add the two in a launch of its own (read 8 S, written 4 S), outside any compiled graph."""
    S = tokens * D
    rows = attnres.read_traffic(tokens, D, storage_bytes)
    rows += [moved(4 * S, S * storage_bytes, launch="copy")] * max(reads)        # the pushes' copies
    rows.append(moved(0, 4 * n_max * S, launch="zeros"))                         # the gradient bank's zeros
    for r0 in range(0, len(reads), CHUNK):
        chunk = reads[r0:r0 + CHUNK]
        rows += chunk_traffic(chunk[0], len(chunk), len(reads), tokens, D=D, storage_bytes=storage_bytes)
        for row, n in enumerate(chunk, start=r0):
            rows += phase_traffic(chunk[0], n, tokens, D, extra=extra, storage_bytes=storage_bytes,
                                  incoming=extra and row < len(reads) - 1)
    return rows
