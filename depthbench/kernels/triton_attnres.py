"""
depthbench/kernels/triton_attnres.py: Full and Block AttnRes' depth mix as Triton kernels, the GPU body of
`DepthBank.mix` (triton_attnres_chunk.py serves a chunk of consumers at once on top of it).

The maths is ops.depth_mix, for one consumer with the query row q, the key gain g and the sources v_0 .. v_(m-1)
(the bank's n sources, then Block AttnRes' open partial sum `extra` if given), per token:

    gq  = g * q                                      (D,), made by each kernel from q and g
    r_j = rsqrt(mean(v_j^2) + eps),  u_j = <v_j, gq>,  s_j = r_j u_j          (the logit: <q, g * RMSNorm(v_j)>)
    p_j = softmax_j(s),  mix = sum_j p_j v_j,  lse = log sum_j exp(s_j)

RMSNorm_k(mix) stays outside (residuals.py). Launches: one per consumer forward, two backward, one per push forward
and at most one backward, no torch glue (each kernel reads q and g itself).

Kernels (each equals the named reference, proved by the named test of tests/test_triton.py):
- `_mix_forward`: a program per BLOCK_T tokens, the width D in registers; one pass over the sources with an online
  softmax (`_source_pass`), fp32 inside; writes mix, lse and the weights p (fp32; telemetry reads p):
  ops.depth_mix's (mix, p), `test_mix_forward_equals_reference`.
- `_mix_backward`, the consumer's pass (`_backward_pass`): its sources again, p_j = exp(s_j - lse) from the saved
  lse, delta = <mix, dmix> = sum_j p_j dp_j (flash attention's rowsum(dO * O)):

      dp_j = <v_j, dmix>,   ds_j = p_j (dp_j - delta)
      dv_j = p_j dmix + ds_j r_j gq - ds_j u_j r_j^3 / D  v_j          (the last term: through r_j)
      dgq  = sum_tokens sum_j ds_j r_j v_j                              (one partial row per program)

  `_query_gradients` sums dgq's rows into dq = dgq g and dg = dgq q (the second launch). The sources' dv_j:
  * deferred (the default): the consumer's pass writes its record (dmix in the bank's storage dtype, delta, lse, gq
    and how many sources it read, `Deferred`) and no dv_j; the sources' passes, run by their pushes when backward
    reaches them (after every consumer that read them), sum dv_j over the records and write it once, no gradient
    bank. By blocks of BLOCK_SOURCES sources: the top source's push runs `_block_backward` (the block's sources in
    registers, each record read once for all of them), each source below adds the records written since
    (`_source_backward`). A bank keeps n_max records (the memory of its slots): Full AttnRes defers every consumer.
  * read-modify-write (a consumer past that room: Block AttnRes from its (N+2)-th backward on): dv_j is added into
    the bank's fp32 gradient slot j in the same pass, one read and one write of each slot this consumer read.
  Both equal autograd's through ops.depth_mix: `test_mix_gradients_equal_reference`,
  `test_a_steps_bank_equals_reference`, `test_consumers_of_several_depths_share_a_bank`; whole models:
  `test_model_equals_reference`, `test_model_under_bf16_autocast_is_the_reference_to_bf16`.

Storage (`storage_dtype`): the sources in bf16 under bf16 autocast, else the first source's dtype; gradients in
fp32. The release's top-k runs cpu.py's mix on the same bank; DenseFormer's and MUDD's banks (eps None) and a bank
no kernel runs on are cpu.py's (`DepthBank.start`). `traffic` and `step_traffic` count what each launch moves.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations are read as text: no triton, no error

import torch

from depthbench.kernels import cpu as kernels
from ops import topk_count

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; nothing here runs then (`runs_here` is False)
    triton = tl = None

TILE_ELEMENTS = 4096   # tokens x padded width one program holds per tile: BLOCK_T = TILE_ELEMENTS // BLOCK_D, >= 1
MAX_BLOCK_T = 16
BACKWARD_WARPS = 8     # the backward holds ~5 tiles (dmix, v, dv, dgq, the old gradient): more warps, fewer spills
COLUMNS, ROWS = 64, 32  # _query_gradients: columns per program, partial rows summed per step
BLOCK_SOURCES = 8      # _block_backward: sources whose gradients one pass over the records sums (a power of 2)
STAGES, WEIGHT_ROWS = 2, 32  # the source loops' pipelining (tl.range's num_stages); the weights p's sources a step


def jit(fn=None, **options):
    """triton.jit (options: its keywords; no fn: the decorator) where triton imports; else fn (never called)."""
    if fn is None:
        return lambda f: jit(f, **options)
    return fn if triton is None else triton.jit(fn, **options)


def interpreted():
    """Whether the kernels below were decorated for Triton's CPU interpreter: TRITON_INTERPRET=1 was set before
    triton's first import in this process (then they run on CPU tensors)."""
    return type(_mix_forward).__name__ == "InterpretedFunction"


def runs_here(t):
    """Whether the kernels can run on t's device: triton imports, t on CUDA (or on the CPU, interpreted)."""
    if triton is None:
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpreted())


def storage_dtype(first):
    """The bank's dtype: autocast's (bf16) when autocast is on for the source's device, else the source's own."""
    if torch.is_autocast_enabled(first.device.type):
        return torch.get_autocast_dtype(first.device.type)
    return first.dtype


def blocks(BT, D, sources=1):
    """(BLOCK_T, BLOCK_D): the padded width, and how many tokens a program holds so that a tile of `sources` sources
    stays TILE_ELEMENTS wide (fewer for a short sequence)."""
    BLOCK_D = next_power_of_2(D)
    BLOCK_T = max(1, min(MAX_BLOCK_T, TILE_ELEMENTS // (BLOCK_D * sources), next_power_of_2(BT)))
    return BLOCK_T, BLOCK_D


def next_power_of_2(x):
    """The least power of 2 >= x (triton.next_power_of_2, without triton)."""
    return 1 << max(x - 1, 0).bit_length()


# ----------------------------------------------------------------------------- the kernels

@jit
def _token_tile(pid, BT, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program pid's tile of a (BT, D) slot: rows (BLOCK_T,), cols (BLOCK_D,), row_ok, the mask and the elements'
    offsets within a slot (BLOCK_T, BLOCK_D)."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < BT
    return rows, cols, row_ok, row_ok[:, None] & (cols[None, :] < D), rows[:, None] * D + cols[None, :]


@jit
def _source_logit(v, gq, D, eps):
    """For a tile of one source v (BLOCK_T, BLOCK_D) in fp32, its padding zero: r = rsqrt(mean(v^2) + eps),
    u = <v, gq>, s = r u, each (BLOCK_T,)."""
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    u = tl.sum(v * gq[None, :], axis=1)
    return r, u, r * u


@jit
def _online_step(v, s, m, l, acc):
    """One source into the online softmax: the running max m, sum l = sum exp(s_j - m) and acc = sum exp(s_j - m) v_j,
    rescaled by exp(m_old - m_new) (0 at the first source, whose m_old is -inf)."""
    m_new = tl.maximum(m, s)
    alpha = tl.exp(m - m_new)
    w = tl.exp(s - m_new)
    return m_new, l * alpha + w, acc * alpha[:, None] + w[:, None] * v


@jit
def _source_pass(V, extra, logits, n, offsets, mask, rows, row_ok, gq, m, l, acc, BT, D, eps,
                 HAS_EXTRA: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The online softmax from (m, l, acc) over the n sources of V (BT x D each), then (HAS_EXTRA) the extra ->
    (m, l, acc); each source's logits to `logits`, a row of BT each. Of _mix_forward and a chunk's phase 2."""
    slot = V                                                 # advanced one slot (BT * D) per source: no int32 overflow
    for j in tl.range(0, n, num_stages=NUM_STAGES):          # pipelined: the next source's copy in flight
        v = tl.load(slot + offsets, mask=mask, other=0.0).to(tl.float32)
        r, u, s = _source_logit(v, gq, D, eps)
        tl.store(logits + rows, s, mask=row_ok)
        m, l, acc = _online_step(v, s, m=m, l=l, acc=acc)
        slot += BT * D
        logits += BT
    if HAS_EXTRA:
        v = tl.load(extra + offsets, mask=mask, other=0.0).to(tl.float32)
        r, u, s = _source_logit(v, gq, D, eps)
        tl.store(logits + rows, s, mask=row_ok)
        m, l, acc = _online_step(v, s, m=m, l=l, acc=acc)
    return m, l, acc


@jit
def _weights(logits, p_ptr, count, rows, row_ok, lse, BT, BLOCK_J: tl.constexpr):
    """p = exp(s - lse) of `count` rows of logits (count, BT) into p_ptr (count, BT): (BLOCK_J, BLOCK_T) a step."""
    js = tl.arange(0, BLOCK_J)
    for j0 in range(0, count, BLOCK_J):
        at, ok = (j0 + js)[:, None] * BT + rows[None, :], (j0 + js < count)[:, None] & row_ok[None, :]
        tl.store(p_ptr + at, tl.exp(tl.load(logits + at, mask=ok, other=0.0) - lse[None, :]), mask=ok)


@jit
def _key_query(q_ptr, g_ptr, cols, D):
    """gq = g * q (BLOCK_D,) in fp32, zero in the padding, from the query row and key gain in their own dtypes."""
    q = tl.load(q_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)


@jit
def _mix_forward(V, extra, q_ptr, g_ptr, mix_ptr, lse_ptr, p_ptr, n, m_sources, BT, D, eps, HAS_EXTRA: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_J: tl.constexpr):
    """mix and lse of tokens [pid BLOCK_T, +BLOCK_T) over the n sources V (n_max, BT, D), then (HAS_EXTRA) the extra
    (BT, D): m_sources in all; the weights p (m_sources, BT): the logits first, then exp(s - lse)."""
    pid = tl.program_id(0)
    rows, cols, row_ok, mask, offsets = _token_tile(pid, BT, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    gq = _key_query(q_ptr, g_ptr, cols, D)
    m, l = tl.full((BLOCK_T,), float("-inf"), tl.float32), tl.zeros((BLOCK_T,), tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    m, l, acc = _source_pass(V, extra, p_ptr, n, offsets=offsets, mask=mask, rows=rows, row_ok=row_ok, gq=gq, m=m,
                             l=l, acc=acc, BT=BT, D=D, eps=eps, HAS_EXTRA=HAS_EXTRA, NUM_STAGES=NUM_STAGES)
    tl.store(mix_ptr + offsets, acc / l[:, None], mask=mask)
    lse = m + tl.log(l)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.debug_barrier()                                   # the logits stored above are visible to every thread
    _weights(p_ptr, p_ptr, m_sources, rows=rows, row_ok=row_ok, lse=lse, BT=BT, BLOCK_J=BLOCK_J)   # as weights


@jit
def _source_gradient(v, gq, dmix, lse, delta, D, eps):
    """One (consumer, source) pair's backward for a tile of tokens: (dv (BLOCK_T, BLOCK_D), b = ds r (BLOCK_T,)), where
    b[:, None] * v summed over the tokens is the pair's share of the consumer's dgq."""
    r, u, s = _source_logit(v, gq, D, eps)
    p = tl.exp(s - lse)                                          # the weight, from the consumer's saved lse
    dp = tl.sum(v * dmix, axis=1)
    ds = p * (dp - delta)
    b = ds * r
    c = -ds * u * r * r * r / D                                  # through r_j: d r_j / d v_j = -r_j^3 v_j / D
    dv = p[:, None] * dmix + b[:, None] * gq[None, :] + c[:, None] * v
    return dv, b


@jit
def _backward_pass(V, extra, dV, d_extra, incoming, n, offsets, mask, gq, dmix, lse, delta, BT, D, eps,
                   DEFER: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_INCOMING: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """A consumer's backward over V's n sources and the extra -> its dgq share (BLOCK_T, BLOCK_D); the extra's dv (+
    `incoming`, with HAS_INCOMING) to d_extra; each source's dv into its fp32 gradient slot of dV, or not (DEFER)."""
    dgq = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    slot, grad = V, dV
    for j in tl.range(0, n, num_stages=NUM_STAGES):                 # pipelined: the next source's copy in flight
        v = tl.load(slot + offsets, mask=mask, other=0.0).to(tl.float32)
        dv, b = _source_gradient(v, gq, dmix, lse=lse, delta=delta, D=D, eps=eps)
        if not DEFER:
            old = tl.load(grad + offsets, mask=mask, other=0.0)      # the one read-modify-write of slot j's gradient
            tl.store(grad + offsets, old + dv, mask=mask)
        dgq += b[:, None] * v
        slot += BT * D
        grad += BT * D
    if HAS_EXTRA:
        v = tl.load(extra + offsets, mask=mask, other=0.0).to(tl.float32)
        dv, b = _source_gradient(v, gq, dmix, lse=lse, delta=delta, D=D, eps=eps)
        if HAS_INCOMING:
            dv += tl.load(incoming + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(d_extra + offsets, dv, mask=mask)                   # cast to the extra's dtype by the store
        dgq += b[:, None] * v
    return dgq


@jit
def _mix_backward(V, extra, q_ptr, g_ptr, mix_ptr, dmix_ptr, lse_ptr, dV, d_extra, dgq_ptr, scalars_ptr, gq_row,
                  reads_ptr, n, BT, D, eps, HAS_EXTRA: tl.constexpr, DEFER: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The consumer's pass (`_backward_pass`): its share of dgq to row pid of dgq_ptr (programs, D); DEFER False,
    the sources' dv into the gradient bank dV (n_max, BT, D) fp32; DEFER True, its record: dmix (dV: (BT, D), the
    bank's dtype), delta and lse (scalars_ptr (2, BT) fp32), gq (gq_row) and n (reads_ptr)."""
    pid = tl.program_id(0)
    rows, cols, row_ok, mask, offsets = _token_tile(pid, BT, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    gq = _key_query(q_ptr, g_ptr, cols, D)
    dmix = tl.load(dmix_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(tl.load(mix_ptr + offsets, mask=mask, other=0.0) * dmix, axis=1)    # <mix, dmix> = sum_j p_j dp_j
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dgq = _backward_pass(V, extra, dV, d_extra, incoming=d_extra, n=n, offsets=offsets, mask=mask, gq=gq, dmix=dmix,
                         lse=lse, delta=delta, BT=BT, D=D, eps=eps, DEFER=DEFER, HAS_EXTRA=HAS_EXTRA,
                         HAS_INCOMING=False, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, NUM_STAGES=NUM_STAGES)
    if DEFER:
        tl.store(dV + offsets, dmix, mask=mask)                      # the record, dmix in the bank's dtype
        tl.store(scalars_ptr + rows, delta, mask=row_ok)
        tl.store(scalars_ptr + BT + rows, lse, mask=row_ok)
        if pid == 0:
            tl.store(gq_row + cols, gq, mask=cols < D)
            tl.store(reads_ptr, n)
    tl.store(dgq_ptr + pid * D + cols, tl.sum(dgq, axis=0), mask=cols < D)


@jit
def _row_sum(rows_ptr, n_rows, cols, col_ok, D, BLOCK_R: tl.constexpr):
    """The sum over the first n_rows rows of the (., D) fp32 rows at rows_ptr, columns `cols` (fp32, one per column)."""
    acc = tl.zeros(cols.shape, tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        acc += tl.sum(tl.load(rows_ptr + rows[:, None] * D + cols[None, :],
                              mask=(rows < n_rows)[:, None] & col_ok[None, :], other=0.0), axis=0)
    return acc


@jit
def _query_gradients(dgq_rows, q_ptr, g_ptr, dq_ptr, dg_ptr, P, D, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dgq = the sum of the P partial rows (P, D) for columns [pid BLOCK_C, (pid + 1) BLOCK_C); dq = dgq g and
    dg = dgq q, stored in the query's and the gain's dtypes."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    dgq = _row_sum(dgq_rows, n_rows=P, cols=cols, col_ok=col_ok, D=D, BLOCK_R=BLOCK_R)
    q = tl.load(q_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(dq_ptr + cols, dgq * g, mask=col_ok)
    tl.store(dg_ptr + cols, dgq * q, mask=col_ok)


@jit
def _block_backward(V, lo, g, records, scalars_ptr, gq_ptr, reads, count, out_ptr, BT, D, eps,
                    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The pass at the top of a block of g <= BLOCK_S sources lo .. lo + g - 1 (V: from slot lo, (g, BT, D), held
    in registers together): for each source, the sum over the recorded consumers c < count that read it
    (reads[c] > its index) of the pair's dv, each record's dmix read once for the whole block; written to out_ptr
    (g, BT, D) fp32 (the top source's whole gradient; the others' sums so far, which `_source_backward` completes)."""
    pid = tl.program_id(0)
    rows, cols, row_ok, mask, offsets = _token_tile(pid, BT, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    srcs = tl.arange(0, BLOCK_S)
    in_block = (srcs < g)[:, None, None] & mask[None, :, :]
    block_offsets = srcs[:, None, None] * (BT * D) + offsets[None, :, :]
    v = tl.load(V + block_offsets, mask=in_block, other=0.0).to(tl.float32)          # (BLOCK_S, BLOCK_T, BLOCK_D)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=2) / D + eps)
    acc = tl.zeros((BLOCK_S, BLOCK_T, BLOCK_D), tl.float32)
    record, scalars, gq_row = records, scalars_ptr, gq_ptr          # advanced one consumer per step
    for c in range(0, count):
        n_read = tl.load(reads + c)
        if n_read > lo:
            dmix = tl.load(record + offsets, mask=mask, other=0.0).to(tl.float32)
            delta = tl.load(scalars + rows, mask=row_ok, other=0.0)
            lse = tl.load(scalars + BT + rows, mask=row_ok, other=0.0)
            gq = tl.load(gq_row + cols, mask=cols < D, other=0.0)
            u = tl.sum(v * gq[None, None, :], axis=2)
            read = (lo + srcs < n_read) & (srcs < g)                 # the block's sources consumer c read
            p = tl.where(read[:, None], tl.exp(r * u - lse[None, :]), 0.0)
            ds = p * (tl.sum(v * dmix[None, :, :], axis=2) - delta[None, :])
            b = ds * r
            k = -ds * u * r * r * r / D                              # through r: as in _source_gradient
            acc += p[:, :, None] * dmix[None, :, :] + b[:, :, None] * gq[None, None, :] + k[:, :, None] * v
        record, scalars, gq_row = record + BT * D, scalars + 2 * BT, gq_row + D
    tl.store(out_ptr + block_offsets, acc, mask=in_block)


@jit
def _source_backward(v_ptr, j, records, scalars_ptr, gq_ptr, reads, count, partial_ptr, base_ptr, dv_ptr, BT, D,
                     eps, HAS_BASE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The pass of source j (its slot v_ptr (BT, D)) below the top of its block: dv_j = its block's partial sum
    (partial_ptr (BT, D) fp32) + the sum over the records written since (records .. + count, from the pointers
    given) that read j (reads[c] > j) of the pair's dv, from c's dmix (the bank's dtype), delta and lse (scalars_ptr
    + 2 c BT) and gq (gq_ptr + c D), + with HAS_BASE the read-modify-write sum (base_ptr, fp32): once to dv_ptr."""
    pid = tl.program_id(0)
    rows, cols, row_ok, mask, offsets = _token_tile(pid, BT, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dv = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    if HAS_BASE:
        dv += tl.load(base_ptr + offsets, mask=mask, other=0.0)
    record, scalars, gq_row = records, scalars_ptr, gq_ptr       # advanced one consumer per step
    for c in range(0, count):
        if tl.load(reads + c) > j:
            dmix = tl.load(record + offsets, mask=mask, other=0.0).to(tl.float32)
            delta = tl.load(scalars + rows, mask=row_ok, other=0.0)
            lse = tl.load(scalars + BT + rows, mask=row_ok, other=0.0)
            gq = tl.load(gq_row + cols, mask=cols < D, other=0.0)
            pair, b = _source_gradient(v, gq, dmix, lse=lse, delta=delta, D=D, eps=eps)
            dv += pair
        record, scalars, gq_row = record + BT * D, scalars + 2 * BT, gq_row + D
    tl.store(dv_ptr + offsets, dv, mask=mask)


# ----------------------------------------------------------------------------- autograd and the bank

def record_capacity(n_max):
    """How many consumers' records a bank of n_max slots keeps: n_max (a record's dmix is one slot in the bank's
    storage dtype: the bank's own memory, half an fp32 gradient bank's in bf16; twice as many would serve Block
    AttnRes' 140 consumers little better, 1.099x against 1.103x at micro-batch 2, and Full's 140 not at all, and
    the records are allocated whole)."""
    return n_max


class Deferred:
    """What the deferred backward keeps of each consumer that has run its backward, one row per consumer in the order
    they ran, for at most `capacity` consumers (`record_capacity`): its dmix (dmix, (capacity, BT, D) in the bank's
    storage dtype), delta = <mix, dmix> and lse (scalars, (capacity, 2, BT) fp32), gq (capacity, D) and how many bank
    sources it read (reads, int32), all written by the consumer's `_mix_backward` (nothing here launches a kernel).
    A consumer past the capacity (Block AttnRes has more consumers than slots) adds its sources' gradients into the
    bank's gradient slots instead (the read-modify-write pass)."""

    def __init__(self, capacity, BT, D, slots):
        self.dmix = slots.new_empty((capacity, BT, D))
        self.scalars = torch.empty((capacity, 2, BT), dtype=torch.float32, device=slots.device)
        self.gq = torch.empty((capacity, D), dtype=torch.float32, device=slots.device)
        self.reads = torch.empty(capacity, dtype=torch.int32, device=slots.device)
        self.count = 0                                             # rows [0, count) hold consumers

    def add(self):
        """The next consumer's row (its kernel writes it)."""
        self.count += 1
        return self.count - 1


def deferred(bank, BT, D, device):
    """The bank's Deferred (made at the first consumer's backward), or None when it is full."""
    if getattr(bank, "deferred", None) is None:
        slots = bank.slots[0]
        bank.deferred = Deferred(record_capacity(bank.n_max), BT, D, slots)
    return bank.deferred if bank.deferred.count < len(bank.deferred.reads) else None


def launch_grid(B, T, D):
    """(grid, BLOCK_T, BLOCK_D) of every per-token kernel here: one program per BLOCK_T tokens."""
    BLOCK_T, BLOCK_D = blocks(B * T, D)
    return (triton.cdiv(B * T, BLOCK_T),), BLOCK_T, BLOCK_D


def query_gradients(dgq_rows, query, key_gain):
    """(dq, dg) in the query's and the gain's dtypes from dgq's partial rows (P, D): one launch."""
    P, D = dgq_rows.shape
    BLOCK_C = min(COLUMNS, next_power_of_2(D))
    dq, dg = torch.empty_like(query), torch.empty_like(key_gain)
    _query_gradients[(triton.cdiv(D, BLOCK_C),)](dgq_rows, query, key_gain, dq_ptr=dq, dg_ptr=dg, P=P, D=D,
                                                 BLOCK_R=ROWS, BLOCK_C=BLOCK_C)
    return dq, dg


class Mix(torch.autograd.Function):
    """The depth mix over the bank's first n sources and an optional extra one, by the kernels above.
    (bank, n, query (D,), key_gain (D,), token, extra (B, T, D) or None) -> (mix (B, T, D) fp32, p (m, B, T) not
    differentiable). Backward: dq, dg and the extra's gradient now; the bank sources' gradients deferred to their
    pushes (`Push`) while the bank's Deferred has room, else added into bank.gradients()[0] (which the push's pass
    starts from). No gradient for the token (it orders the backward; its value is never read)."""

    @staticmethod
    def forward(ctx, bank, n, query, key_gain, token, extra):
        V = bank.slots[0]                                                        # (n_max, B, T, D), contiguous
        B, T, D = V.shape[1:]
        m = n + (extra is not None)
        extra_in = V if extra is None else extra.contiguous()                    # a placeholder pointer without extra
        mix = V.new_empty((B, T, D), dtype=torch.float32)
        lse = V.new_empty((B * T,), dtype=torch.float32)
        p = V.new_empty((m, B, T), dtype=torch.float32)
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        _mix_forward[grid](V, extra_in, query, key_gain, mix_ptr=mix, lse_ptr=lse, p_ptr=p, n=n, m_sources=m,
                           BT=B * T, D=D, eps=bank.norm_eps, HAS_EXTRA=extra is not None, BLOCK_T=BLOCK_T,
                           BLOCK_D=BLOCK_D, NUM_STAGES=STAGES, BLOCK_J=WEIGHT_ROWS)
        ctx.save_for_backward(query, key_gain, mix, lse, *([] if extra is None else [extra_in]))
        ctx.bank, ctx.n = bank, n
        ctx.extra_dtype = None if extra is None else extra.dtype
        ctx.mark_non_differentiable(p)
        ctx.set_materialize_grads(False)                                         # no zeros for p's gradient
        return mix, p

    @staticmethod
    def backward(ctx, dmix, _):
        if dmix is None:
            return None, None, None, None, None, None
        bank, n = ctx.bank, ctx.n
        query, key_gain, mix, lse, *extra = ctx.saved_tensors
        V = bank.slots[0]
        B, T, D = V.shape[1:]
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        record = deferred(bank, B * T, D, V.device)
        if record is None:
            dV, scalars, gq_row, reads = bank.gradients()[0], lse, query, lse   # the read-modify-write pass
        else:
            c = record.add()
            dV, scalars, gq_row, reads = record.dmix[c], record.scalars[c], record.gq[c], record.reads[c:]
        d_extra = torch.empty(mix.shape, dtype=ctx.extra_dtype, device=mix.device) if extra else None
        extra_in = extra[0] if extra else V
        dgq_rows = mix.new_empty((grid[0], D))
        _mix_backward[grid](V, extra_in, query, key_gain, mix_ptr=mix, dmix_ptr=dmix.contiguous(), lse_ptr=lse,
                            dV=dV, d_extra=d_extra if extra else dV, dgq_ptr=dgq_rows, scalars_ptr=scalars,
                            gq_row=gq_row, reads_ptr=reads, n=n, BT=B * T, D=D, eps=bank.norm_eps,
                            HAS_EXTRA=bool(extra), DEFER=record is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                            NUM_STAGES=STAGES, num_warps=BACKWARD_WARPS)
        dq, dg = query_gradients(dgq_rows, query, key_gain)
        return None, None, dq, dg, None, d_extra


class Partial:
    """The block pass's result (`_block_backward`): sources lo .. hi (hi: the push that ran it), their sums over the
    records [0, start) in buffer (hi - lo + 1, B, T, D) fp32, which no kernel writes again (a new block gets a new
    buffer: a source's gradient handed on may be a view of it)."""

    def __init__(self, lo, hi, start, buffer):
        self.lo, self.hi, self.start, self.buffer = lo, hi, start, buffer


def block_pass(bank, j):
    """Run `_block_backward` for sources max(0, j - BLOCK_SOURCES + 1) .. j over every record so far: the bank's new
    Partial."""
    record, V = bank.deferred, bank.slots[0]
    lo = max(0, j - BLOCK_SOURCES + 1)
    B, T, D = V.shape[1:]
    buffer = torch.empty((j - lo + 1, B, T, D), dtype=torch.float32, device=V.device)
    BLOCK_T, BLOCK_D = blocks(B * T, D, BLOCK_SOURCES)
    _block_backward[(triton.cdiv(B * T, BLOCK_T),)](V[lo], lo, j - lo + 1, record.dmix, scalars_ptr=record.scalars,
                                                    gq_ptr=record.gq, reads=record.reads, count=record.count,
                                                    out_ptr=buffer, BT=B * T, D=D, eps=bank.norm_eps,
                                                    BLOCK_S=BLOCK_SOURCES, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                                                    num_warps=BACKWARD_WARPS)
    bank.partial = Partial(lo, j, record.count, buffer)
    return bank.partial


def deferred_gradient(bank, j, base):
    """Source j's gradient from the records (fp32), and base (the gradient slot) if it is still to be added: the
    top of a new block runs the block pass; a source below it adds the records written since to its partial sum
    (`_source_backward`, base with it), or, where none were, is its partial sum."""
    part = getattr(bank, "partial", None)
    if part is None or not part.lo <= j < part.hi:
        part = block_pass(bank, j)
        return part.buffer[j - part.lo], base
    record, v = bank.deferred, bank.slots[0][j]
    start, partial = part.start, part.buffer[j - part.lo]
    if record.count == start:
        return partial, base
    B, T, D = v.shape
    grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
    grad = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    _source_backward[grid](v, j, record.dmix[start:], scalars_ptr=record.scalars[start:], gq_ptr=record.gq[start:],
                           reads=record.reads[start:], count=record.count - start, partial_ptr=partial,
                           base_ptr=partial if base is None else base, dv_ptr=grad, BT=B * T, D=D,
                           eps=bank.norm_eps, HAS_BASE=base is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                           num_warps=BACKWARD_WARPS)
    return grad, None


def source_gradient(bank, j, dtype):
    """Slot j's gradient (B, T, D) in `dtype` from every consumer that read it: the deferred passes over the recorded
    consumers (`deferred_gradient`), what the read-modify-write pass and kernels.py's top-k mix added to the gradient
    bank, what `Read` kept, and the top-k mix's path through r_j (as kernels.Push); each term not a kernel's is one
    torch add. Zeros when nothing reached it."""
    record, v = getattr(bank, "deferred", None), bank.slots[0][j]
    base = None if bank.grads is None else bank.grads[0][j]
    grad = None
    if record is not None and record.count:
        grad, base = deferred_gradient(bank, j, base)
    terms = [base, getattr(bank, "read_grads", {}).pop(j, None)]
    if bank.d_inv_rms is not None:
        terms.append((bank.d_inv_rms[j] * bank.inv_rms[j].pow(3) / -v.size(-1))[..., None] * v.float())
    for term in terms:
        if term is not None:
            grad = term if grad is None else grad + term
    if grad is None:
        return torch.zeros(v.shape, dtype=dtype, device=v.device)
    return grad.to(dtype)


class Read(torch.autograd.Function):
    """A copy of slot j (forward); its gradient kept beside the bank (bank.read_grads[j]) for the push to add
    (backward): kernels.Read adds it into a whole gradient bank, which the deferred backward does not allocate."""

    @staticmethod
    def forward(ctx, bank, j, token):
        ctx.bank, ctx.j = bank, j
        return bank.slots[0][j].clone()

    @staticmethod
    def backward(ctx, grad):
        kept = ctx.bank.read_grads
        kept[ctx.j] = grad.float() if ctx.j not in kept else kept[ctx.j] + grad.float()
        return None, None, None


class Push(torch.autograd.Function):
    """Write v into slot j of the bank (forward: one copy, in the bank's dtype; the r_j that kernels.Push keeps are
    computed by the top-k mix, the only reader, when it runs); hand v `source_gradient` (backward). The token it
    returns only orders the backward (every later push and mix takes it): no kernel writes it."""

    @staticmethod
    def forward(ctx, bank, j, token, v):
        bank.write(j, (v,))
        ctx.bank, ctx.j, ctx.dtype = bank, j, v.dtype
        ctx.set_materialize_grads(False)                                         # no zeros for the token's gradient
        return torch.empty((), dtype=torch.float32, device=v.device)

    @staticmethod
    def backward(ctx, dtoken):
        return None, None, None, source_gradient(ctx.bank, ctx.j, ctx.dtype)


def keys_inv_rms(bank, m):
    """The bank's r_j of slots [0, m) for kernels.py's top-k mix (kernels.Push computes them at each push; the
    Triton path never reads them)."""
    if bank.inv_rms is None:
        bank.inv_rms = bank.slots[0].new_empty(bank.slots[0].shape[:-1], dtype=torch.float32)
    bank.inv_rms[:m] = kernels.inv_rms(bank.slots[0][:m].float(), bank.norm_eps)


class DepthBank(kernels.DepthBank):
    """kernels.DepthBank whose `mix` runs the Triton kernels and whose pushes hand on the deferred gradients, stored in
    bf16 under bf16 autocast (`storage_dtype`); `start` without a key norm (eps None) or where no kernel runs: cpu's."""

    @classmethod
    def start(cls, first, n_max, eps=1e-5):
        if eps is None or not runs_here(first):          # DenseFormer's and MUDD's bank (no key norm): kernels.py's
            return kernels.DepthBank.start(first, n_max, eps)
        bank = kernels.Bank(n_max, norm_eps=eps)
        bank.slots = [first.new_empty((n_max, *first.shape), dtype=storage_dtype(first))]   # Bank.write fills it
        bank.read_grads = {}                                                                 # slot -> `Read`'s gradient
        return cls(bank, 0, None).push(first)

    @torch.compiler.disable
    def push(self, v):
        bank = self.bank if kernels.linear(self.bank, self.n) else self.bank.fork(self.n)
        token = Push.apply(bank, self.n, self.token, v)
        return DepthBank(bank, self.n + 1, token)

    @torch.compiler.disable
    def newest(self):
        """The last source pushed, as a tensor autograd connects to it (a copy of its slot, in the bank's dtype)."""
        return Read.apply(self.bank, self.n - 1, self.token)

    @torch.compiler.disable
    def mix(self, query, key_gain, eps, extra=None, topk_fraction=1.0):
        m = self.n + (extra is not None)
        if eps != self.bank.norm_eps:
            raise ValueError(f"the bank's key norm uses eps {self.bank.norm_eps}, not {eps}")
        if topk_count(m, topk_fraction) < m:
            keys_inv_rms(self.bank, self.n)
            return super().mix(query, key_gain, eps, extra=extra, topk_fraction=topk_fraction)   # top-k: torch body
        mix, p = Mix.apply(self.bank, self.n, query.contiguous(), key_gain.contiguous(), self.token, extra)
        return mix, p.movedim(0, -1), extra                 # the extra's other uses: autograd adds their gradient


# ----------------------------------------------------------------------------- what a step moves (the roofline)

def traffic(n, tokens, D, extra=False, storage_bytes=2, deferred=True):
    """HBM bytes read and written, and kernel launches, of one consumer's depth mix over n bank sources (and the
    extra source, fp32, with extra) for `tokens` = B T tokens of width D; the bank and the records' dmix stored in
    `storage_bytes` per element (2: bf16, 4: fp32); q, g, mix, dmix, lse, p, delta and gradients fp32. With
    m = n + extra, S = tokens D, P = the programs of a launch (tokens / BLOCK_T), E = 4 S if extra else 0:

        forward   `_mix_forward` read n S storage_bytes + E + 8 D (q, g) + 4 tokens m (p: the logits read back)
                  written  4 S (mix) + 4 tokens (lse) + 8 tokens m (p: the logits, then exp(s - lse))
        backward  `_mix_backward`, the consumer's pass: read n S storage_bytes + E + 8 S (mix, dmix) + 4 tokens
                  (lse) + 8 D, written E (the extra's dv) + 4 P D (dgq's partial rows)
                  deferred: also written S storage_bytes + 8 tokens + 4 D + 4 (its record: dmix, delta, lse, gq, n)
                  read-modify-write: also read 4 n S (the gradient slots), written 4 n S
        query     `_query_gradients` reads 4 P D + 8 D and writes 8 D (dq, dg)

    -> {"forward" | "backward" | "query": `moved`, one launch each}. The records' reads are the sources' passes'
    (`step_traffic`)."""
    S, m = tokens * D, n + int(extra)
    P = -(-tokens // blocks(tokens, D)[0])
    E = 4 * S * int(extra)
    forward = moved(n * S * storage_bytes + E + 8 * D + 4 * tokens * m, 4 * S + 4 * tokens + 8 * tokens * m,
                    launch="_mix_forward")
    record = S * storage_bytes + 8 * tokens + 4 * D + 4 if deferred else 0      # deferred: its record
    slots = 0 if deferred else 4 * n * S                                        # else the gradient slots, both ways
    backward = moved(n * S * storage_bytes + E + 8 * S + 4 * tokens + 8 * D + slots, E + 4 * P * D + record + slots,
                     launch="_mix_backward")
    return {"forward": forward, "backward": backward, "query": moved(4 * P * D + 8 * D, 8 * D,
                                                                     launch="_query_gradients")}


def moved(read=0, written=0, launches=1, *, launch):
    """A row of the byte accounts here and in triton_attnres_chunk.py and triton_moda.py; launch: what moves its
    bytes, a Triton kernel by its function name (as scripts/kernel_probe.py names it) or a torch op ("copy")."""
    return {"read": read, "written": written, "launches": launches, "launch": launch}


class Schedule:
    """The sources' side of a bank's backward as the code runs it (`source_gradient`), for the roofline: which pass
    each push runs, and what it moves. record: the bank sources each record's consumer read, in backward order."""

    def __init__(self, tokens, D, storage_bytes):
        self.S, self.tokens, self.D, self.sb = tokens * D, tokens, D, storage_bytes
        self.records, self.gradient_bank, self.part = [], False, None          # part: (lo, hi, start)

    def record_bytes(self, records):
        """A pass's reads of `records` records it uses (dmix, delta, lse, gq)."""
        return records * (self.S * self.sb + 8 * self.tokens + 4 * self.D)

    def push_backward(self, j):
        """[moved] of push j's backward: the block pass (`_block_backward`) at the top of a new block; below it the
        source pass (`_source_backward`) over the records since (none: its partial sum as it is); a torch "add" for
        the gradient slot where no kernel took it; nothing where no consumer left a record."""
        S, count, rows = self.S, len(self.records), []
        lo, hi, start = self.part or (0, -1, 0)
        base_left = self.gradient_bank
        if not count:
            return []
        if not lo <= j < hi:
            lo = max(0, j - BLOCK_SOURCES + 1)
            self.part, g = (lo, j, count), j - lo + 1
            rows.append(moved(g * S * self.sb + self.record_bytes(sum(n > lo for n in self.records)) + 4 * count,
                              4 * g * S, launch="_block_backward"))
        elif count > start:
            used = sum(n > j for n in self.records[start:])
            rows.append(moved(S * self.sb + 4 * S * (1 + self.gradient_bank) + self.record_bytes(used)
                              + 4 * (count - start), 4 * S, launch="_source_backward"))
            base_left = False
        if base_left:
            rows.append(moved(8 * S, 4 * S, launch="add"))
        return rows


def step_traffic(reads, n_max, tokens, D, extra=False, storage_bytes=2):
    """[moved] of a whole step of one bank: `reads` = the bank sources each mixing consumer reads, in forward order
    (each reads every source pushed before it, as Full and Block AttnRes do; consumer 0 reads its newest source,
    `read_traffic`), the bank n_max slots (so `record_capacity` records), every source read by some consumer.
    Backward runs the consumers deepest first, and push j right after the first consumer that read it; each push's
    "copy" in, and the gradient bank's "zeros" at the first read-modify-write consumer."""
    plan = Schedule(tokens, D, storage_bytes)
    rows = read_traffic(tokens, D, storage_bytes)
    pushes = max(reads)
    first = {j: min(i for i, n in enumerate(reads) if n > j) for j in range(pushes)}
    for i in reversed(range(len(reads))):
        deferred = len(plan.records) < record_capacity(n_max)
        rows += traffic(reads[i], tokens, D, extra=extra, storage_bytes=storage_bytes, deferred=deferred).values()
        if deferred:
            plan.records.append(reads[i])
        elif not plan.gradient_bank:
            plan.gradient_bank = True
            rows.append(moved(0, 4 * n_max * plan.S, launch="zeros"))            # the gradient bank's zeroing
        for j in sorted((j for j in first if first[j] == i), reverse=True):
            rows.append(moved(4 * plan.S, plan.S * storage_bytes, launch="copy"))  # its forward: the copy in
            rows += plan.push_backward(j)
    return rows


def read_traffic(tokens, D, storage_bytes=2):
    """[moved] of one `newest()` read (sublayer 0's RMSNorm(e)): forward, a copy of the slot; backward, its gradient
    kept in fp32 (a cast where the bank is bf16) and added to the push's (1 launch each)."""
    S, cast = tokens * D, int(storage_bytes < 4)
    return ([moved(S * storage_bytes, S * storage_bytes, launch="copy")]
            + [moved(S * storage_bytes, 4 * S, launch="cast")] * cast + [moved(8 * S, 4 * S, launch="add")])
