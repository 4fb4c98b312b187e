"""
gpu/attnres.py: Full and Block AttnRes' depth mix as Triton kernels, the GPU body of `DepthBank.mix`.

The maths is ops.depth_mix, for one consumer with the query row q, the key gain g and the sources v_0 .. v_(m-1)
(the bank's n sources, then Block AttnRes' open partial sum `extra` if given), per token:

    gq  = g * q                                      (D,), made in torch before the kernels
    r_j = rsqrt(mean(v_j^2) + eps),  u_j = <v_j, gq>,  s_j = r_j u_j          (the logit: <q, g * RMSNorm(v_j)>)
    p_j = softmax_j(s),  mix = sum_j p_j v_j,  lse = log sum_j exp(s_j)

The consumer's output norm, RMSNorm_k(mix), stays outside (residuals.py applies it, as with the other bodies).

Kernels (each equals the named reference, proved by the named test of tests/test_triton.py):
- `_mix_forward`: one program per block of BLOCK_T tokens, the whole width D in registers (padded to a power of 2
  and masked). One pass over the sources with an online softmax (running max m, running sum l, running weighted
  sum acc, rescaled by exp(m_old - m_new) when the max grows): r_j, u_j, s_j, p_j and mix in fp32 from sources
  stored in bf16 or fp32. Writes mix (fp32), lse (fp32) and the logits s (fp32, m x tokens: the weights p that the
  interface returns are exp(s - lse), and telemetry reads them). Equals ops.depth_mix's (mix, p):
  `test_mix_forward_equals_reference`.
- `_mix_backward`, the consumer's pass: the same blocks of tokens, one pass over its sources again. It recomputes
  r_j, u_j, s_j from the source and p_j = exp(s_j - lse) from the saved lse (nothing per source is kept from the
  forward), and with delta = <mix, dmix> = sum_j p_j dp_j (as flash attention's rowsum(dO * O)):

      dp_j = <v_j, dmix>,   ds_j = p_j (dp_j - delta)
      dv_j = p_j dmix + ds_j r_j gq - ds_j u_j r_j^3 / D  v_j          (the last term: through r_j)
      dgq  = sum_tokens sum_j ds_j r_j v_j                              (one partial row per program, summed in torch)

  It returns dgq (and the extra source's dv, written to its own tensor) at once. The bank sources' dv_j, two ways:
  * deferred (the default): the consumer keeps a record (its dmix, delta, lse, gq and how many sources it read,
    `Deferred`) and computes no dv_j; `_source_backward`, run by source j's push when backward reaches it (after
    every consumer that read it, as autograd orders the bank's tokens), sums dv_j over the recorded consumers that
    read j, from v_j read once and each consumer's dmix, and writes it once: the triangular accumulation. Per
    (consumer, source) pair the backward reads v_j (storage bytes) and dmix (4 bytes) per element, and no gradient
    bank exists. The records take as much memory as a gradient bank of the bank's n_max slots, so a bank keeps at
    most n_max records: Full AttnRes (2L consumers, 2L + 1 slots) defers every consumer.
  * read-modify-write (a consumer past that room: Block AttnRes, with more consumers than slots, from its
    (N+2)-th backward on): dv_j is added into the bank's fp32 gradient slot j in the same pass, one read and one
    write of each slot this consumer read, never of the rest of the bank; its push adds the slot's total.
  Both equal the gradients autograd takes through ops.depth_mix (query, key gain, every source):
  `test_mix_gradients_equal_reference` (each way), `test_consumers_of_several_depths_share_a_bank` (consumers that
  read different prefixes of one bank); a whole model: `test_model_equals_reference` (Block AttnRes there mixes
  the two ways), and under bf16 autocast `test_model_under_bf16_autocast_is_the_reference_to_bf16`.
- `_source_backward`: the deferred pass above, one program per block of tokens, looping over the records.

Storage: the bank (depthbench/kernels/cpu.py's `Bank` and `Push.forward`, reused) keeps its sources in bf16 when the
model runs under autocast to bf16 on the bank's device, else in the dtype of the first source; gradients accumulate in
fp32. The release's top-k variant (topk_fraction < 1) runs kernels.py's torch mix on the same bank (its gradients
join through the gradient bank, which it allocates). DenseFormer's and MUDD's banks (no key norm: eps None), and any
bank on a device where no kernel can run (a CPU tensor without the interpreter), are kernels.py's own
(`DepthBank.start`): their path, and the CPU's, is unchanged. `traffic` counts what each kernel moves.
"""
from __future__ import annotations  # the kernels' `tl.constexpr` annotations are read as text: no triton, no error

import torch

from depthbench.kernels import cpu as kernels
from ops import fp32_maths, topk_count

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; nothing here runs then (`runs_here` is False)
    triton = tl = None

TILE_ELEMENTS = 4096   # tokens x padded width one program holds per tile: BLOCK_T = TILE_ELEMENTS // BLOCK_D, >= 1
MAX_BLOCK_T = 16
BACKWARD_WARPS = 8     # the backward holds ~5 tiles (dmix, v, dv, dgq, the old gradient): more warps, fewer spills


def jit(fn):
    """triton.jit where triton imports; the plain function (never called) where it does not."""
    return fn if triton is None else triton.jit(fn)


def interpreted():
    """Whether the kernels below were decorated for Triton's CPU interpreter: TRITON_INTERPRET=1 was set before
    triton's first import in this process (then they run on CPU tensors)."""
    return type(_mix_forward).__name__ == "InterpretedFunction"


def runs_here(t):
    """Whether the kernels can run on t's device: triton imports, and t is on CUDA (or on the CPU under the
    interpreter)."""
    if triton is None:
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpreted())


def storage_dtype(first):
    """The bank's dtype: autocast's (bf16) when autocast is on for the source's device, else the source's own."""
    if torch.is_autocast_enabled(first.device.type):
        return torch.get_autocast_dtype(first.device.type)
    return first.dtype


def blocks(BT, D):
    """(BLOCK_T, BLOCK_D): the padded width, and how many tokens a program holds so that a tile stays
    TILE_ELEMENTS wide (fewer for a short sequence)."""
    BLOCK_D = next_power_of_2(D)
    BLOCK_T = max(1, min(MAX_BLOCK_T, TILE_ELEMENTS // BLOCK_D, next_power_of_2(BT)))
    return BLOCK_T, BLOCK_D


def next_power_of_2(x):
    """The least power of 2 >= x (triton.next_power_of_2, without triton)."""
    return 1 << max(x - 1, 0).bit_length()


# ----------------------------------------------------------------------------- the kernels

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
def _mix_forward(V, extra, gq_ptr, mix_ptr, lse_ptr, logits_ptr, n, BT, D, eps,
                 HAS_EXTRA: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """mix and lse for tokens [pid BLOCK_T, (pid + 1) BLOCK_T) over the n bank sources V (n_max, BT, D) and, with
    HAS_EXTRA, the extra source (BT, D) after them; logits (m, BT)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < BT
    mask = row_ok[:, None] & (cols[None, :] < D)
    offsets = rows[:, None] * D + cols[None, :]                  # within one source slot
    gq = tl.load(gq_ptr + cols, mask=cols < D, other=0.0)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_T,), tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    slot = V                                                     # advanced one slot (BT * D) per source: no int32 overflow
    logits = logits_ptr
    for j in range(0, n):
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
    tl.store(mix_ptr + offsets, acc / l[:, None], mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


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
def _mix_backward(V, extra, gq_ptr, mix_ptr, dmix_ptr, lse_ptr, dV, d_extra, dgq_ptr, n, BT, D, eps,
                  HAS_EXTRA: tl.constexpr, DEFER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The consumer's pass. Its share of dgq to row pid of dgq_ptr (programs, D); the extra source's dv to d_extra.
    The bank sources' dv: DEFER False, added into the gradient bank dV (n_max, BT, D) fp32, one read-modify-write of
    each slot read; DEFER True, not computed here: dV is the consumer's row of the deferred record, which gets dmix
    and delta (then `_source_backward` computes dv when it reaches the source)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < BT
    mask = row_ok[:, None] & (cols[None, :] < D)
    offsets = rows[:, None] * D + cols[None, :]
    gq = tl.load(gq_ptr + cols, mask=cols < D, other=0.0)
    dmix = tl.load(dmix_ptr + offsets, mask=mask, other=0.0)
    delta = tl.sum(tl.load(mix_ptr + offsets, mask=mask, other=0.0) * dmix, axis=1)    # <mix, dmix> = sum_j p_j dp_j
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dgq = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    slot = V
    grad = dV
    for j in range(0, n):
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
        tl.store(d_extra + offsets, dv, mask=mask)
        dgq += b[:, None] * v
    if DEFER:
        tl.store(dV + offsets, dmix, mask=mask)                      # the record: dmix, delta (lse, gq: in torch)
        tl.store(dV + BT * D + rows, delta, mask=row_ok)
    tl.store(dgq_ptr + pid * D + cols, tl.sum(dgq, axis=0), mask=cols < D)


@jit
def _source_backward(v_ptr, j, records, reads, lse_ptr, gq_ptr, count, dv_ptr, BT, D, eps,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The deferred pass of source j (its slot v_ptr (BT, D)): dv_j = sum over the recorded consumers c that read it
    (reads[c] > j) of the pair's dv, from c's dmix and delta (records[c]: BT D + BT floats), lse (lse_ptr + c BT)
    and gq (gq_ptr + c D); written once to dv_ptr (BT, D) fp32."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < BT
    mask = row_ok[:, None] & (cols[None, :] < D)
    offsets = rows[:, None] * D + cols[None, :]
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dv = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    record, lse_row, gq_row = records, lse_ptr, gq_ptr            # advanced one consumer per step
    for c in range(0, count):
        if tl.load(reads + c) > j:
            dmix = tl.load(record + offsets, mask=mask, other=0.0)
            delta = tl.load(record + BT * D + rows, mask=row_ok, other=0.0)
            lse = tl.load(lse_row + rows, mask=row_ok, other=0.0)
            gq = tl.load(gq_row + cols, mask=cols < D, other=0.0)
            pair, b = _source_gradient(v, gq, dmix, lse=lse, delta=delta, D=D, eps=eps)
            dv += pair
        record += BT * D + BT
        lse_row += BT
        gq_row += D
    tl.store(dv_ptr + offsets, dv, mask=mask)


# ----------------------------------------------------------------------------- autograd and the bank

class Deferred:
    """What the deferred backward keeps of each consumer that has run its backward, one row per consumer in the order
    they ran, for at most `capacity` (the bank's n_max: no more memory than a gradient bank) consumers: its dmix and
    delta = <mix, dmix> (records, (capacity, BT D + BT) fp32), lse (capacity, BT), gq (capacity, D) and how many
    bank sources it read (reads, int32). A consumer past the capacity (Block AttnRes has more consumers than slots)
    adds its sources' gradients into the bank's gradient slots instead (the read-modify-write pass)."""

    def __init__(self, capacity, BT, D, device):
        self.records = torch.empty((capacity, BT * D + BT), dtype=torch.float32, device=device)
        self.lse = torch.empty((capacity, BT), dtype=torch.float32, device=device)
        self.gq = torch.empty((capacity, D), dtype=torch.float32, device=device)
        self.reads = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.count = 0                                             # rows [0, count) hold consumers

    def add(self, n, gq, lse):
        """A row for the next consumer, which read n bank sources: its index (dmix and delta: the kernel's to write)."""
        c = self.count
        self.lse[c].copy_(lse)
        self.gq[c].copy_(gq)
        self.reads[c] = n
        self.count += 1
        return c


def deferred(bank, BT, D, device):
    """The bank's Deferred (made at the first consumer's backward), or None when it is full."""
    if getattr(bank, "deferred", None) is None:
        bank.deferred = Deferred(bank.n_max, BT, D, device)
    return bank.deferred if bank.deferred.count < bank.n_max else None


def launch_grid(B, T, D):
    """(grid, BLOCK_T, BLOCK_D) of every kernel here: one program per BLOCK_T tokens."""
    BLOCK_T, BLOCK_D = blocks(B * T, D)
    return (triton.cdiv(B * T, BLOCK_T),), BLOCK_T, BLOCK_D


class Mix(torch.autograd.Function):
    """The depth mix over the bank's first n sources and an optional extra one, by the kernels above.
    (bank, n, gq (D,) fp32, token, extra (B, T, D) or None) -> (mix (B, T, D) fp32, p (m, B, T) not differentiable).
    Backward: dgq and the extra's gradient now; the bank sources' gradients deferred to their pushes (`Push`) while
    the bank's Deferred has room, else added into bank.gradients()[0] (which the push adds too, as kernels.Mix's)."""

    @staticmethod
    def forward(ctx, bank, n, gq, token, extra):
        V = bank.slots[0]                                                        # (n_max, B, T, D), contiguous
        B, T, D = V.shape[1:]
        m = n + (extra is not None)
        extra_in = V if extra is None else extra.contiguous()                    # a placeholder pointer without extra
        mix = V.new_empty((B, T, D), dtype=torch.float32)
        lse = V.new_empty((B * T,), dtype=torch.float32)
        logits = V.new_empty((m, B, T), dtype=torch.float32)
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        _mix_forward[grid](V, extra_in, gq, mix_ptr=mix, lse_ptr=lse, logits_ptr=logits, n=n, BT=B * T, D=D,
                           eps=bank.norm_eps, HAS_EXTRA=extra is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
        p = torch.exp(logits - lse.view(1, B, T))
        ctx.save_for_backward(gq, mix, lse, *([] if extra is None else [extra_in]))
        ctx.bank, ctx.n = bank, n
        ctx.extra_dtype = None if extra is None else extra.dtype
        ctx.mark_non_differentiable(p)
        return mix, p

    @staticmethod
    def backward(ctx, dmix, _):
        bank, n = ctx.bank, ctx.n
        gq, mix, lse, *extra = ctx.saved_tensors
        V = bank.slots[0]
        B, T, D = V.shape[1:]
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        record = deferred(bank, B * T, D, V.device)
        if record is None:
            dV = bank.gradients()[0]                                             # the read-modify-write pass
        else:
            dV = record.records[record.add(n, gq, lse)]
        d_extra = torch.empty_like(mix) if extra else None
        extra_in = extra[0] if extra else V
        dgq_rows = mix.new_empty((grid[0], D))
        _mix_backward[grid](V, extra_in, gq, mix, dmix_ptr=dmix.float().contiguous(), lse_ptr=lse, dV=dV,
                            d_extra=d_extra if extra else dV, dgq_ptr=dgq_rows, n=n, BT=B * T, D=D,
                            eps=bank.norm_eps, HAS_EXTRA=bool(extra), DEFER=record is not None, BLOCK_T=BLOCK_T,
                            BLOCK_D=BLOCK_D, num_warps=BACKWARD_WARPS)
        if d_extra is not None:
            d_extra = d_extra.to(ctx.extra_dtype)
        return None, None, dgq_rows.sum(0), torch.zeros_like(gq[0]), d_extra


def source_gradient(bank, j):
    """Slot j's gradient (B, T, D) fp32 from every consumer that read it: the deferred pass over the recorded
    consumers (`_source_backward`), plus what the read-modify-write pass and kernels.py's top-k mix added to the
    gradient bank and `Read` kept, plus the top-k mix's path through r_j (as kernels.Push). None when nothing
    reached it."""
    record, v = getattr(bank, "deferred", None), bank.slots[0][j]
    grad = None
    if record is not None and record.count:
        B, T, D = v.shape
        grid, BLOCK_T, BLOCK_D = launch_grid(B, T, D)
        grad = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        _source_backward[grid](v, j, record.records, reads=record.reads, lse_ptr=record.lse, gq_ptr=record.gq,
                               count=record.count, dv_ptr=grad, BT=B * T, D=D, eps=bank.norm_eps,
                               BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=BACKWARD_WARPS)
    if bank.grads is not None:
        grad = bank.grads[0][j] if grad is None else grad + bank.grads[0][j]
    read = getattr(bank, "read_grads", {}).pop(j, None)
    if read is not None:
        grad = read if grad is None else grad + read
    if bank.d_inv_rms is not None:
        norm = (bank.d_inv_rms[j] * bank.inv_rms[j].pow(3) / -v.size(-1))[..., None] * v.float()
        grad = norm if grad is None else grad + norm
    return grad


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
        return None, None, torch.zeros((), dtype=torch.float32, device=grad.device)


class Push(kernels.Push):
    """kernels.Push's forward (write slot j, its r_j); backward hands the pushed tensor `source_gradient`."""

    @staticmethod
    def backward(ctx, dtoken):
        grad = source_gradient(ctx.bank, ctx.j)
        if grad is None:
            grad = torch.zeros(ctx.bank.slots[0].shape[1:], dtype=torch.float32, device=dtoken.device)
        dtoken_in = torch.zeros_like(dtoken) if ctx.had_token else None
        return None, None, dtoken_in, grad.to(ctx.dtypes[0])


class DepthBank(kernels.DepthBank):
    """kernels.DepthBank (the same bank, reads and top-k mix) whose `mix` runs the Triton kernels and whose pushes hand
    on the deferred gradients, on a bank stored in bf16 under bf16 autocast (`storage_dtype`). `start` without a key
    norm (eps None), or on a device the kernels cannot run on, returns kernels.DepthBank itself."""

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
        if topk_count(m, topk_fraction) < m:
            return super().mix(query, key_gain, eps, extra=extra, topk_fraction=topk_fraction)   # top-k: torch body
        if eps != self.bank.norm_eps:
            raise ValueError(f"the bank's key norm uses eps {self.bank.norm_eps}, not {eps}")
        with fp32_maths(query):
            gq = (key_gain.float() * query.float()).contiguous()
            mix, p = Mix.apply(self.bank, self.n, gq, self.token, extra)
        return mix, p.movedim(0, -1)


# ----------------------------------------------------------------------------- what a consumer moves (the roofline)

def traffic(n, tokens, D, extra=False, storage_bytes=2, deferred=True):
    """HBM bytes read and written, and kernel launches, of one consumer's depth mix over n bank sources (and the
    extra source, fp32, with extra) for `tokens` = B T tokens of width D; the bank stored in `storage_bytes` per
    element (2: bf16, 4: fp32); mix, dmix, lse, logits, records and gradients fp32. With m = n + extra, S = tokens D,
    P = the programs of a launch (tokens / BLOCK_T), E = 4 S if extra else 0:

        forward   read     n S storage_bytes + E + 4 D (gq) + 4 tokens (2 m + 1) (p = exp(s - lse): s, lse, then s - lse)
                  written  4 S (mix) + 4 tokens (lse) + 12 tokens m (logits; s - lse; p)
                  launches 4: gq = g q, _mix_forward, the subtraction and the exp that make p
        backward  (the consumer's pass) read n S storage_bytes + E + 8 S (mix, dmix) + 4 tokens + 4 D + 4 P D
                  deferred: written 4 S + 4 tokens (its record: dmix, delta) + 4 tokens + 4 D (lse, gq copied) + E
                            + 4 P D + 4 D; launches 8: 3 copies into the record, _mix_backward, dgq's row sum, the
                            token's zero, dq = dgq g and dg = dgq q
                  read-modify-write: also read 4 n S (the gradient slots), written 4 n S + E + 4 P D + 4 D;
                            launches 5 (no record)
        deferred  (deferred only) what this consumer adds to the passes of the n sources it read, run by their pushes:
                  read n (4 S + 8 tokens + 4 D) (its dmix, delta, lse, gq, once per source), no write, no launch
        push      (each source, once, whatever its consumers) forward: kernels.Push's copy into the bank, then
                  r_j = 1 / rms for the top-k path: read 4 S + S storage_bytes (+ 4 S in bf16: r_j reads a fp32 copy),
                  written S storage_bytes (+ 4 S) + 4 tokens; backward: _source_backward reads v_j (S storage_bytes)
                  and writes dv_j (4 S); launches 7 (8 in bf16) + 3 (the pass, the token's zero, the copy to fp32)

    -> {"forward" | "backward" | "deferred" | "push": {"read": bytes, "written": bytes, "launches": count}}. A design's
    step: the sum over its consumers of forward, backward and deferred, plus push per source. Per (consumer, source)
    pair and element the backward moves storage_bytes + 4 deferred, storage_bytes + 8 by read-modify-write."""
    S, m = tokens * D, n + int(extra)
    P = -(-tokens // blocks(tokens, D)[0])
    E = 4 * S * int(extra)
    bf16_copy = 4 * S * int(storage_bytes < 4)
    forward = {"read": n * S * storage_bytes + E + 4 * D + 4 * tokens * (2 * m + 1),
               "written": 4 * S + 4 * tokens + 12 * tokens * m, "launches": 4}
    backward = {"read": n * S * storage_bytes + E + 8 * S + 4 * tokens + 4 * D + 4 * P * D,
                "written": E + 4 * P * D + 4 * D, "launches": 5}
    later = {"read": 0, "written": 0, "launches": 0}
    if deferred:
        backward["written"] += 4 * S + 8 * tokens + 4 * D
        backward["launches"] += 3
        later["read"] = n * (4 * S + 8 * tokens + 4 * D)
    else:
        backward["read"] += 4 * n * S
        backward["written"] += 4 * n * S
    push = {"read": 4 * S + 2 * S * storage_bytes + bf16_copy,
            "written": S * storage_bytes + bf16_copy + 4 * tokens + 4 * S, "launches": 10 + int(storage_bytes < 4)}
    return {"forward": forward, "backward": backward, "deferred": later, "push": push}
