"""
triton_moda.py: MoDA's joint attention on the GPU (the "triton" namespace's `joint_attention` and `DepthKV`).

The maths is ops.joint_attention: per query token t and head h, one softmax over the causal sequence logits and the
logits of the depth keys dk_j,t (j < n, the slots earlier sublayers left at token t, not rotated), all at scale
1/sqrt(hd); GQA: query head h reads kv head h // G. It runs as two halves merged by their log-sum-exps:

    sequence half   (o_s, lse_s) = the fused causal attention kernel (`sequence_forward`): on CUDA PyTorch's flash
                    kernel (aten._scaled_dot_product_flash_attention, bf16/fp16), on the CPU its CPU kernel, else the
                    plain maths (`math_forward`); no copy of q, k or v (GQA: k, v expanded to the query heads)
    depth half      `_depth_forward`, one program per (BLOCK_T tokens, batch x kv head) holding the G query heads of
                    the kv head (so each slot is read once): s_j = scale <q, dk_j>, an online softmax over j,
                    o_d = sum_j softmax(s)_j dv_j, lse_d, in fp32 registers; then the merge in the same kernel:
                    lse = logaddexp(lse_s, lse_d), share = exp(lse_d - lse), o = o_s + share (o_d - o_s)

Backward, with the joint o and lse (as ring attention merges blocks): the fused sequence backward given (o, lse) is
the sequence keys' part of the joint softmax's gradient (dq_s, dk, dv); the depth keys' part is flash attention's own
backward with the same joint lse and Delta = <do, o>:  P_j = exp(s_j - lse), ds_j = P_j (<do, dv_j> - Delta),
dq = dq_s + scale sum_j ds_j dk_j, d(dk_j) = scale sum_g ds_gj q_g, d(dv_j) = sum_g P_gj do_g.
- `_depth_backward`, the consumer's pass: reads its n slots once more for dq (and adds dq_s), and writes its record
  (q, do in q's dtype; lse and Delta fp32) into the bank's `Records`. No slot gradient is touched.
- `_slot_backward`, run by a slot's push when backward reaches it (after every consumer that read it): sums the
  slot's key and value gradients over the recorded consumers that read it, from the slot read once and each
  consumer's record, in fp32 registers, and writes them once, in the pushed tensors' dtype. MoDA's two slots of a
  block (attention's k, v and W_kv's) have the same readers, so one pass makes both (PAIR) and the second waits
  beside the bank for its push: the records are read once per block, not once per slot. No gradient bank, no
  read-modify-write per consumer. A slot no consumer read (the last attention's) gets zeros without a pass.
Equal to ops.joint_attention (forward, dq, dk, dv and every slot's key and value): tests/test_triton_moda.py.

Storage: the bank (cpu.py's Bank, reused) keeps its slots (n_max, B, Hkv, T, hd), contiguous, in bf16 under bf16
autocast (triton_attnres.storage_dtype), else in the first key's dtype. The query side (q, o, do, dq, the records)
is read and written in q's own layout, (B, T, H, hd) in memory as the projection makes it (the kernels take its
strides; `like` copies a tensor that has another, which the fused kernels' outputs do not: a test checks it).
A bank whose first key lives where no kernel runs (a CPU tensor without the interpreter) is cpu.py's DepthKV, and
joint_attention on it is cpu.py's: the CPU path does not change. `traffic` counts what each launch moves.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations are read as text: no triton, no error

import torch

from depthbench.kernels import cpu
from depthbench.kernels.triton_attnres import jit, moved, next_power_of_2, runs_here, storage_dtype, tl, triton
from ops import fp32_maths

# Rows (query tokens x the G query heads of a kv head) one program holds, and its warps. Each row's head width,
# padded to a power of 2, lies in the lanes of one warp (8 bf16 a lane: 16-byte loads, hd a constexpr), so every
# reduction over hd is shuffles, never a barrier; each loop over slots or records is software-pipelined (`STAGES`,
# a constexpr with its default in the kernels: cp.async, STAGES - 1 tiles in flight). At the card's shape (hd 40
# padded to 64, G 1, 32 tokens a program) ptxas for sm_90 (Triton 3.9) gives the forward / consumer / slot / paired
# slot pass 64 / 119 / 127 / 220 registers x 4 warps, 8 / 4 / 4 / 2 CTAs an SM, no spill, 173 / 184 / 249 / 354
# instructions and 2 barriers per iteration (per row and slot 22 / 23 / 31 / 44 warp-instructions; 16 tokens a
# program, 8 warps, scalar loads before: 86 / 96 / 120 / 198). 64 rows: the same per row, 140-255 registers, spills.
ROWS = 32
WARPS = 4


def blocks(T, G, hd):
    """(BLOCK_T, BLOCK_G, BLOCK_D): tokens per program, the padded group and the padded head width; a program's
    BLOCK_T BLOCK_G rows are at most ROWS (fewer tokens for a short sequence)."""
    BLOCK_G, BLOCK_D = next_power_of_2(G), next_power_of_2(hd)
    BLOCK_T = max(1, min(ROWS // BLOCK_G, next_power_of_2(T)))
    return BLOCK_T, BLOCK_G, BLOCK_D


# ----------------------------------------------------------------------------- the kernels

@jit
def _tiles(sB, sH, sT, H, T, G, hd: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """This program's rows, r = token BLOCK_G + query head, of BLOCK_T tokens and the G query heads of kv head bh:
    offsets into a query-side tensor (B, H, T, hd) whose batch, head and token strides are sB, sH, sT (channels
    contiguous, the tensor dense: every stride a multiple of hd), into a contiguous (B, H, T) one (`rows`), into a
    contiguous (B, Hkv, T, hd) slot (`kv_off`: each row at its token's key; a kv head's G rows read the same one),
    and the mask of the real rows' real channels -> (rows, row_ok, q_off, kv_off, mask), the tiles (R, BLOCK_D)."""
    pid_t, bh = tl.program_id(0), tl.program_id(1)                    # bh = b Hkv + kv head
    r = tl.arange(0, BLOCK_T * BLOCK_G)
    t = pid_t * BLOCK_T + r // BLOCK_G
    g = r % BLOCK_G
    c = tl.arange(0, BLOCK_D)
    row_ok = (t < T) & (g < G)
    head = bh * G + g                                                 # b H + h, h = kv head G + g
    rows = head * T + t                                               # (b H + h) T + t
    # in units of hd, then times hd: the compiler sees each row start at a multiple of hd (16-byte loads at hd 40)
    q_rows = ((head // H) * (sB // hd) + (head % H) * (sH // hd) + t * (sT // hd)) * hd
    q_off = q_rows[:, None] + c[None, :]
    kv_off = ((bh * T + t) * hd)[:, None] + c[None, :]
    mask = row_ok[:, None] & (c < hd)[None, :]
    return rows, row_ok, q_off, kv_off, mask


@jit
def _group_sum(x, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """x (BLOCK_T BLOCK_G, BLOCK_D) summed over each token's BLOCK_G rows -> (BLOCK_T, BLOCK_D); x itself at G 1."""
    if BLOCK_G == 1:
        return x
    return tl.sum(tl.reshape(x, (BLOCK_T, BLOCK_G, BLOCK_D)), axis=1)


@jit
def _token_tile(T, hd: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of this program's BLOCK_T tokens into a contiguous (B, Hkv, T, hd) slot, and their mask."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_D)
    return ((tl.program_id(1) * T + t) * hd)[:, None] + c[None, :], (t < T)[:, None] & (c < hd)[None, :]


@jit
def _depth_forward(Q, K, V, o_seq, lse_seq, O, lse_ptr, share_ptr, n, slot, sB, sH, sT, H, T, G, hd: tl.constexpr,
                   scale, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   STAGES: tl.constexpr = 3):
    """The depth half over slots [0, n) of K, V (n_max, B, Hkv, T, hd; `slot` elements apart) for queries Q
    (B, H, T, hd), merged with the sequence half (o_seq in Q's layout, lse_seq (B, H, T)): o, the joint lse and
    the depth share. Logits in base 2 (scale log2(e) folded into q), the online softmax per row in registers."""
    rows, row_ok, q_off, kv_off, mask = _tiles(sB, sH, sT, H, T=T, G=G, hd=hd, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G,
                                               BLOCK_D=BLOCK_D)
    q = tl.load(Q + q_off, mask=mask, other=0.0).to(tl.float32) * (scale * 1.4426950408889634)
    m = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_T * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    k_ptr, v_ptr = K, V                                               # advanced one slot per step
    for j in tl.range(0, n, num_stages=STAGES):
        k = tl.load(k_ptr + kv_off, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=1)                                     # log2(e) scale <q, k_j>
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(s - m_new)
        l = l * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * v
        m = m_new
        k_ptr += slot
        v_ptr += slot
    lse_d = (m + tl.log2(l)) * 0.6931471805599453
    lse_s = tl.load(lse_seq + rows, mask=row_ok, other=0.0)
    top = tl.maximum(lse_s, lse_d)
    lse = top + tl.log(tl.exp(lse_s - top) + tl.exp(lse_d - top))
    share = tl.exp(lse_d - lse)
    o_s = tl.load(o_seq + q_off, mask=mask, other=0.0).to(tl.float32)
    o = o_s + share[:, None] * (acc / l[:, None] - o_s)
    tl.store(O + q_off, o.to(O.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(share_ptr + rows, share, mask=row_ok)


@jit
def _depth_backward(Q, K, V, O, dO, lse_ptr, dq_seq, dQ, rec_q, rec_do, rec_lse, rec_delta, rec_reads, n, slot, sB,
                    sH, sT, H, T, G, hd: tl.constexpr, scale, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, STAGES: tl.constexpr = 3):
    """The consumer's pass: dQ = dq_seq + scale sum_j ds_j k_j over slots [0, n); its record (q, do, lse,
    Delta = <do, o>, and n) to rec_* (the consumer's rows of the bank's Records)."""
    rows, row_ok, q_off, kv_off, mask = _tiles(sB, sH, sT, H, T=T, G=G, hd=hd, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G,
                                               BLOCK_D=BLOCK_D)
    q_in = tl.load(Q + q_off, mask=mask, other=0.0)
    do_in = tl.load(dO + q_off, mask=mask, other=0.0)
    do = do_in.to(tl.float32)
    q2 = q_in.to(tl.float32) * (scale * 1.4426950408889634)          # base-2 logits
    delta = tl.sum(do * tl.load(O + q_off, mask=mask, other=0.0).to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    lse2 = lse * 1.4426950408889634
    dq = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    k_ptr, v_ptr = K, V
    for j in tl.range(0, n, num_stages=STAGES):
        k = tl.load(k_ptr + kv_off, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp2(tl.sum(q2 * k, axis=1) - lse2)
        ds = p * (tl.sum(do * v, axis=1) - delta)
        dq += ds[:, None] * k
        k_ptr += slot
        v_ptr += slot
    dq = dq * scale + tl.load(dq_seq + q_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(dQ + q_off, dq.to(dQ.dtype.element_ty), mask=mask)
    tl.store(rec_q + q_off, q_in.to(rec_q.dtype.element_ty), mask=mask)
    tl.store(rec_do + q_off, do_in.to(rec_do.dtype.element_ty), mask=mask)
    tl.store(rec_lse + rows, lse, mask=row_ok)
    tl.store(rec_delta + rows, delta, mask=row_ok)
    tl.store(rec_reads, n)                                            # every program stores the same n


@jit
def _pair_gradient(q, do, lse2, delta, k2, v):
    """One (consumer, slot) pair, per row: (ds q, p do), each (R, BLOCK_D), k2 the slot's key at log2(e) scale."""
    p = tl.exp2(tl.sum(q * k2, axis=1) - lse2)
    ds = p * (tl.sum(do * v, axis=1) - delta)
    return ds[:, None] * q, p[:, None] * do


@jit
def _slot_backward(K, V, j, reads, count, rec_q, rec_do, rec_lse, rec_delta, dK, dV, slot, sB, sH, sT, H, T, G,
                   hd: tl.constexpr, scale, PAIR: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, STAGES: tl.constexpr = 3):
    """Slot j's key and value gradients summed over the recorded consumers c < count that read it (reads[c] > j),
    in fp32, written once to dK, dV ((1 + PAIR), B, Hkv, T, hd) in their dtype (the pushed tensors'). K, V point at
    the slot (PAIR False) or at slot j - 1, which has the same readers, and the kernel makes both (PAIR True: dK, dV
    hold slot j - 1's, then slot j's, `slot` elements apart). Each record is read once for both; a consumer that did
    not read the slot is loaded under a false mask (no bytes) and adds zeros. Per row (a query head's), summed over
    the G rows of each token once, at the end."""
    rows, row_ok, q_off, kv_off, mask = _tiles(sB, sH, sT, H, T=T, G=G, hd=hd, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G,
                                               BLOCK_D=BLOCK_D)
    log2e = 1.4426950408889634
    k = tl.load(K + PAIR * slot + kv_off, mask=mask, other=0.0).to(tl.float32) * (scale * log2e)
    v = tl.load(V + PAIR * slot + kv_off, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)          # slot j - 1 (PAIR only)
    v2 = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    if PAIR:
        k2 = tl.load(K + kv_off, mask=mask, other=0.0).to(tl.float32) * (scale * log2e)
        v2 = tl.load(V + kv_off, mask=mask, other=0.0).to(tl.float32)
    dk = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    dk2 = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    dv2 = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    queries = G * (slot // hd)                                        # one record's rows, B H T (its q: B H T hd)
    r_q, r_do, r_lse, r_delta = rec_q, rec_do, rec_lse, rec_delta     # advanced one consumer per step
    for c in tl.range(0, count, num_stages=STAGES):
        read = tl.where(tl.load(reads + c) > j, row_ok, False)        # (not `&`: the interpreter's mask dtype)
        q = tl.load(r_q + q_off, mask=mask & read[:, None], other=0.0).to(tl.float32)
        do = tl.load(r_do + q_off, mask=mask & read[:, None], other=0.0).to(tl.float32)
        lse2 = tl.load(r_lse + rows, mask=read, other=0.0) * log2e    # not read: q = do = 0, so ds q = p do = 0
        delta = tl.load(r_delta + rows, mask=read, other=0.0)
        a, b = _pair_gradient(q, do, lse2, delta, k2=k, v=v)
        dk += a
        dv += b
        if PAIR:
            a, b = _pair_gradient(q, do, lse2, delta, k2=k2, v=v2)
            dk2 += a
            dv2 += b
        r_q += queries * hd
        r_do += queries * hd
        r_lse += queries
        r_delta += queries
    kv_off_t, mask_t = _token_tile(T, hd=hd, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)       # the G rows summed: tokens
    dk_t = _group_sum(dk, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D) * scale
    tl.store(dK + PAIR * slot + kv_off_t, dk_t.to(dK.dtype.element_ty), mask=mask_t)
    tl.store(dV + PAIR * slot + kv_off_t, _group_sum(dv, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
             .to(dV.dtype.element_ty), mask=mask_t)
    if PAIR:
        dk2_t = _group_sum(dk2, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D) * scale
        tl.store(dK + kv_off_t, dk2_t.to(dK.dtype.element_ty), mask=mask_t)
        tl.store(dV + kv_off_t, _group_sum(dv2, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D)
                 .to(dV.dtype.element_ty), mask=mask_t)


# ----------------------------------------------------------------------------- the sequence half

def flash_on_cuda(q):
    """Whether PyTorch's CUDA flash kernel takes q: a CUDA tensor in fp16/bf16, head width a multiple of 8 up to 256."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0 and q.size(-1) <= 256


def expand_heads(k, H):
    """k (B, Hkv, T, hd) repeated to H heads (query head h reads kv head h // G); itself when Hkv == H."""
    return k if k.size(1) == H else k.repeat_interleave(H // k.size(1), dim=1)


def fold_heads(dk, Hkv):
    """The inverse of expand_heads for a gradient: the G query heads of each kv head summed."""
    return dk if dk.size(1) == Hkv else dk.unflatten(1, (Hkv, dk.size(1) // Hkv)).sum(2)


def math_forward(q, k, v, scale):
    """Causal attention with its log-sum-exp, in fp32 from the T x T logits (where no fused kernel runs):
    (o in q's dtype, lse (B, H, T) fp32)."""
    T = q.size(2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    s = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(future, float("-inf"))
    lse = s.logsumexp(-1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def math_backward(do, q, k, v, out, scale):
    """The sequence keys' part of the joint softmax's gradient, given out = the joint (o, lse) (flash attention's
    backward in plain maths): (dq, dk, dv) in fp32."""
    o, lse = out
    T = q.size(2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    p = torch.exp((qf @ kf.transpose(-1, -2) * scale).masked_fill(future, float("-inf")) - lse[..., None])
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * o.float()).sum(-1, keepdim=True))
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, p.transpose(-1, -2) @ dof


def flash_forward(q, k, v, scale):
    """PyTorch's CUDA flash kernel (the same op and arguments on PyTorch 2.11 and 2.13): (o, lse (B, H, T) fp32,
    what its backward takes: cum_seq_q, cum_seq_k, max_q, max_k, the rng state's two tensors)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p=0.0, is_causal=True,
                                                             return_debug_mask=False, scale=scale)
    return out[0], out[1], tuple(out[2:8])


def flash_backward(do, q, k, v, out, saved):
    """Its backward given out = the joint (o, lse) and what flash_forward saved: (dq, dk, dv), at scale 1/sqrt(hd)."""
    o, lse = out
    scale = q.size(-1) ** -0.5
    cum_seq_q, cum_seq_k, max_q, max_k, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out=o, logsumexp=lse, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k, max_q=max_q, max_k=max_k,
        dropout_p=0.0, is_causal=True, philox_seed=seed, philox_offset=offset, scale=scale)


def sequence_forward(q, k, v, scale):
    """The sequence half, k and v already at the query heads: (o_s, lse_s (B, H, T) fp32, what its backward needs)."""
    if flash_on_cuda(q):
        return flash_forward(q, k, v, scale)
    if q.device.type == "cpu":
        hd, pad = q.size(-1), cpu.head_pad(q)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*cpu.padded((q, k, v), pad),
                                                                            is_causal=True, scale=scale)
        return o[..., :hd], lse, ()
    return (*math_forward(q, k, v, scale), ())


def sequence_backward(do, q, k, v, out, saved):
    """(dq_s, dk, dv) of the sequence half given out = the joint (o, lse) (k, v at the query heads) and what
    sequence_forward saved; at scale 1/sqrt(hd), as sequence_forward's caller sets it."""
    o, lse = out
    scale = q.size(-1) ** -0.5
    if flash_on_cuda(q):
        return flash_backward(do, q, k, v, out=out, saved=saved)
    if q.device.type == "cpu":
        hd, pad = q.size(-1), cpu.head_pad(q)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *cpu.padded((do, q, k, v, o), pad), logsumexp=lse, dropout_p=0.0, is_causal=True, scale=scale)
        return tuple(g[..., :hd] for g in grads)
    return math_backward(do, q, k, v, out=out, scale=scale)


# ----------------------------------------------------------------------------- autograd and the bank

def launch_grid(q, Hkv):
    """(grid, BLOCK_T, BLOCK_G, BLOCK_D) of every kernel here: one program per BLOCK_T tokens of one kv head."""
    B, H, T, hd = q.shape
    BLOCK_T, BLOCK_G, BLOCK_D = blocks(T, H // Hkv, hd)
    return (triton.cdiv(T, BLOCK_T), B * Hkv), BLOCK_T, BLOCK_G, BLOCK_D


class Records:
    """What the slot passes need of each consumer that has run its backward, one row per consumer in the order they
    ran: q and do (B, H, T, hd) in q's dtype and layout, lse and Delta (B, H, T) fp32, and how many slots it read
    (reads, int32), all written by its `_depth_backward`. Made at the first consumer's backward with a row for every
    consumer the forward ran (bank.consumers)."""

    def __init__(self, capacity, q):
        self.q, self.do = (torch.empty_strided((capacity, *q.shape), (q.numel(), *q.stride()), dtype=q.dtype,
                                               device=q.device) for _ in range(2))          # rows in q's layout
        self.lse = q.new_empty((capacity, *q.shape[:-1]), dtype=torch.float32)
        self.delta = q.new_empty((capacity, *q.shape[:-1]), dtype=torch.float32)
        self.reads = torch.zeros(capacity, dtype=torch.int32, device=q.device)
        self.count = 0

    def add(self):
        """The next row, for the consumer whose backward runs now."""
        if self.count == self.reads.numel():
            raise ValueError(f"MoDA's bank keeps records for {self.count} consumers: more ran their backward")
        self.count += 1
        return self.count - 1


def like(t, stride):
    """t with these strides (the query side's layout: MoDA's q is (B, T, H, hd) in memory, as the projection made
    it), copied only where it has others."""
    if t.stride() == tuple(stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def layout(q):
    """The query side's strides and heads, as the kernels take them."""
    return {"sB": q.stride(0), "sH": q.stride(1), "sT": q.stride(2), "H": q.size(1)}


def records(bank, q):
    if getattr(bank, "records", None) is None:
        bank.records = Records(len(bank.consumers), q)
    return bank.records


class Joint(torch.autograd.Function):
    """MoDA's joint attention over the sequence (q, k, v) and the bank's first n slots, by the kernels above.
    -> (o (B, H, T, hd) in q's dtype, share (B, H, T) fp32, not differentiable). Backward: dq, dk, dv now; the slots'
    gradients at their pushes, from the record this consumer leaves (`Push`)."""

    @staticmethod
    def forward(ctx, bank, n, token, q, k, v):
        K, V = bank.slots
        if bank.layout is None:                   # the first consumer's q sets the layout of the query side
            kept = torch.empty_like(q).stride()   # q's strides if dense, else contiguous ones
            bank.layout = kept if kept[-1] == 1 else q.contiguous().stride()
        q = like(q, bank.layout)
        scale = q.size(-1) ** -0.5
        ke, ve = expand_heads(k, q.size(1)), expand_heads(v, q.size(1))
        o_seq, lse_seq, saved = sequence_forward(q, ke, ve, scale)
        o = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        share = torch.empty_like(lse)
        grid, BLOCK_T, BLOCK_G, BLOCK_D = launch_grid(q, K.size(2))
        _depth_forward[grid](q, K, V, o_seq=like(o_seq, q.stride()), lse_seq=lse_seq.contiguous(), O=o, lse_ptr=lse,
                             share_ptr=share, n=n, slot=K[0].numel(), **layout(q), T=q.size(2),
                             G=q.size(1) // K.size(2), hd=q.size(-1), scale=scale, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G,
                             BLOCK_D=BLOCK_D, num_warps=WARPS)
        ctx.save_for_backward(q, ke, ve, o, lse)
        ctx.bank, ctx.n, ctx.scale, ctx.Hkv, ctx.sequence = bank, n, scale, k.size(1), saved
        ctx.mark_non_differentiable(share)
        bank.consumers.append(n)
        return o, share

    @staticmethod
    def backward(ctx, do, _):
        q, ke, ve, o, lse = ctx.saved_tensors
        do = like(do, q.stride())
        dq_seq, dk, dv = sequence_backward(do, q, ke, ve, out=(o, lse), saved=ctx.sequence)
        bank, K, V = ctx.bank, *ctx.bank.slots
        rec = records(bank, q)
        c = rec.add()
        dq = torch.empty_like(q)
        grid, BLOCK_T, BLOCK_G, BLOCK_D = launch_grid(q, ctx.Hkv)
        _depth_backward[grid](q, K, V, o, dO=do, lse_ptr=lse, dq_seq=like(dq_seq, q.stride()), dQ=dq, rec_q=rec.q[c],
                              rec_do=rec.do[c], rec_lse=rec.lse[c], rec_delta=rec.delta[c], rec_reads=rec.reads[c:],
                              n=ctx.n,
                              slot=K[0].numel(), **layout(q), T=q.size(2), G=q.size(1) // ctx.Hkv, hd=q.size(-1),
                              scale=ctx.scale, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, num_warps=WARPS)
        dk, dv = (fold_heads(g, ctx.Hkv).to(t.dtype) for g, t in ((dk, ke), (dv, ve)))
        return None, None, None, dq, dk, dv


def shares_readers(bank, j):
    """Whether slot j - 1 has the readers slot j has: no consumer the forward ran read exactly j slots."""
    return j >= 1 and j not in bank.consumers


def slot_gradients(bank, j):
    """(dk_j, dv_j) fp32 (B, Hkv, T, hd) from every recorded consumer that read slot j: the slot pass
    (`_slot_backward`), which also makes slot j - 1's when it has the same readers (kept in bank.pending for its
    push). Zeros when no consumer read it."""
    if j in bank.pending:
        return bank.pending.pop(j)
    K, V = bank.slots
    rec = getattr(bank, "records", None)
    if rec is None or max(bank.consumers, default=0) <= j:                    # no consumer read slot j
        return tuple(torch.zeros(K[j].shape, dtype=dtype, device=K.device) for dtype in bank.dtypes)
    pair = shares_readers(bank, j)
    lo = j - int(pair)
    dK, dV = (torch.empty((1 + int(pair), *K[j].shape), dtype=dtype, device=K.device) for dtype in bank.dtypes)
    B, Hkv, T, hd = K[j].shape
    G = rec.q.size(2) // Hkv
    BLOCK_T, BLOCK_G, BLOCK_D = blocks(T, G, hd)
    _slot_backward[(triton.cdiv(T, BLOCK_T), B * Hkv)](
        K[lo], V[lo], j, reads=rec.reads, count=rec.count, rec_q=rec.q, rec_do=rec.do, rec_lse=rec.lse,
        rec_delta=rec.delta, dK=dK, dV=dV, slot=K[j].numel(), **layout(rec.q[0]), T=T, G=G, hd=hd, scale=hd ** -0.5,
        PAIR=pair, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, num_warps=WARPS)
    if pair:
        bank.pending[lo] = (dK[0], dV[0])
    return dK[-1], dV[-1]


class Push(torch.autograd.Function):
    """Write key and value into slot j of the bank (forward, cpu.Bank.write); hand them their slot's gradients
    (backward, `slot_gradients`). The token it returns is empty: it carries only the order (each consumer and later
    push takes it, so autograd runs this backward after theirs), and its gradient is never materialised."""

    @staticmethod
    def forward(ctx, bank, j, token, key, value):
        ctx.set_materialize_grads(False)
        bank.write(j, (key, value))
        ctx.bank, ctx.j, ctx.dtypes = bank, j, (key.dtype, value.dtype)
        return key.new_empty((0,), dtype=torch.float32)           # the token: an order, no data (no launch)

    @staticmethod
    def backward(ctx, dtoken):
        grads = slot_gradients(ctx.bank, ctx.j)
        return (None, None, None, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


class DepthKV(cpu.DepthKV):
    """cpu.DepthKV's bank (slots (n_max, B, Hkv, T, hd), as attention makes them) whose pushes hand on the slot
    passes' gradients and which `joint_attention` reads with the kernels above. Its first push decides: where no
    kernel runs on the key's device, the state becomes cpu.DepthKV itself."""

    @classmethod
    def start(cls, n_max):
        return cls(cpu.Bank(n_max), 0, None)

    @torch.compiler.disable
    def push(self, key, value):
        if self.n == 0 and self.bank.slots is None:
            if not runs_here(key):
                return cpu.DepthKV.start(self.bank.n_max).push(key, value)
            self.bank.slots = [key.new_empty((self.bank.n_max, *key.shape), dtype=storage_dtype(key)) for _ in "kv"]
            self.bank.consumers, self.bank.pending, self.bank.layout = [], {}, None
            self.bank.dtypes = (key.dtype, value.dtype)           # of the slots' gradients
        bank = self.bank if cpu.linear(self.bank, self.n) else fork(self.bank, self.n)
        token = Push.apply(bank, self.n, self.token, key, value)
        return DepthKV(bank, self.n + 1, token)

    @torch.compiler.disable
    def joint(self, q, k, v):
        with fp32_maths(q):
            return Joint.apply(self.bank, self.n, self.token, q, k, v)


def fork(bank, n):
    """cpu.Bank.fork with this file's bookkeeping (a diagnostic's second continuation: no gradients)."""
    other = bank.fork(n)
    other.consumers, other.pending, other.layout, other.dtypes = [], {}, None, bank.dtypes
    return other


def joint_attention(q, k, v, depth):
    """ops.joint_attention by the kernels above when `depth` is this file's DepthKV (its bank on a device where they
    run) and holds a slot; cpu.py's body otherwise."""
    if not isinstance(depth, DepthKV):
        return cpu.joint_attention(q, k, v, depth)
    if depth.n == 0:                                              # no slot yet: the sequence half alone
        return cpu.causal_attention(q, k, v), q.new_zeros(q.shape[:-1], dtype=torch.float32)
    o, share = depth.joint(q, k, v)
    return o, share.detach()


# ----------------------------------------------------------------------------- what MoDA moves (the roofline)

CONSUMER_PARTS = ("forward", "backward", "heads", "deferred")   # traffic's parts a consumer moves
SLOT_PARTS = ("push", "slot")                                   # and those each slot moves, once


def traffic(n, tokens, heads, kv_heads, head_dim, storage_bytes=2):
    """HBM bytes read and written, and kernel launches, of the GPU body beyond Pre-LN's attention (the fused
    sequence kernel, forward and backward, is Pre-LN's own), for one consumer that reads n slots, `tokens` = B T;
    q, k, v, o, their gradients, the records and the slots in storage_bytes (sb; bf16 under autocast); lse and Delta
    fp32. With Q = tokens heads head_dim (a query-side tensor), S = tokens kv_heads head_dim (one slot's key or
    value), R = tokens heads (rows), X = 2 sb (S + Q) when kv_heads < heads, else 0:

        forward   `_depth_forward`: read q, o_s (2 Q sb), the slots' keys and values (2 n S sb), lse_s (4 R);
                  written o (Q sb), lse and share (8 R); launches 1
        backward  `_depth_backward`: read q, o, do, dq_s (4 Q sb), 2 n S sb, lse (4 R); written dq (Q sb) and the
                  record (q, do: 2 Q sb; lse, Delta: 8 R; n: 4 bytes); launches 1
        heads     torch ("expand and fold heads"): with kv_heads < heads, k and v expanded to the query heads for the
                  fused kernel (2 launches), their gradients folded back (2): read 2 X, written 2 X
        deferred  `_slot_backward`, what this consumer adds to the slot passes: each pass over a pair of its slots
                  (n / 2 passes; one per slot when n is odd) reads its record, 2 Q sb + 8 R
        push      each slot, once, whatever its consumers, torch ("push's copies and sums"). Forward:
                  residuals.MoDA.write's contiguous copies of the key and value (read and write 2 S sb) and the copy
                  into the bank (the same); launches 4. Backward: the gradients' way back into the projections (the
                  view's reshape copy, the sum with attention's own dk, dv or the W_kv slices' scatter: about read
                  4 S sb, written 2 S sb); launches 3
        slot      each slot, once: `_slot_backward`'s half a slot pass (the slot's key and value read, 2 S sb; their
                  gradients written, 2 S sb); launches 0.5

    -> {part: `moved`} (CONSUMER_PARTS, SLOT_PARTS). A step: the sum over the consumers of CONSUMER_PARTS, plus
    SLOT_PARTS per slot. Per (consumer, slot) and element of the slot's key and value: forward 2 sb, backward 2 sb,
    the slot pass G sb / 2 (G = heads / kv_heads; the record read once for a pair of slots)."""
    Q, S, R, sb = tokens * heads * head_dim, tokens * kv_heads * head_dim, tokens * heads, storage_bytes
    gqa = int(kv_heads < heads)
    X = 2 * sb * (S + Q) * gqa
    return {"forward": moved(2 * Q * sb + 2 * n * S * sb + 4 * R, Q * sb + 8 * R, launch="_depth_forward"),
            "backward": moved(4 * Q * sb + 2 * n * S * sb + 4 * R, 3 * Q * sb + 8 * R + 4, launch="_depth_backward"),
            "heads": moved(2 * X, 2 * X, launches=4 * gqa, launch="expand and fold heads"),
            "deferred": moved(-(-n // 2) * (2 * Q * sb + 8 * R), 0, launches=0, launch="_slot_backward"),
            "push": moved(4 * S * sb + 4 * S * sb, 4 * S * sb + 2 * S * sb, launches=7,
                          launch="push's copies and sums"),
            "slot": moved(2 * S * sb, 2 * S * sb, launches=0.5, launch="_slot_backward")}
