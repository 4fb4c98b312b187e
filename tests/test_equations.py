"""
Each design's equations, written out again here from the papers (docs/designs.md) and checked against the model.

    python -m pytest -q tests/test_equations.py

Nothing below calls residuals.py's classes or ops.py to compute an expected value: the reference forward of every
design (`REFERENCE`) is a second implementation in plain PyTorch, loops and einsums over the model's own tensors by
their state_dict names, and the hand-made cases give streams and weights whose transposes, swaps and off-by-ones
change the answer. The model runs with both kernels (`GPTConfig.kernels`), every parameter perturbed away from its
init, so that zero-initialised weights hide nothing. The init tests pin the exact starting value of every design's
own tensor (one-hot positions, gains, scales, Sinkhorn's fixed point), not just shapes.
"""
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

import ops
import shapes
from model import GPT, GPTConfig
from residuals import RESIDUALS

KERNELS = ("fast", "reference")


def build(residual, kernels="fast", seed=0, perturb=0.3, **kw):
    """A tiny model (L3, d16, 4 heads of 4, or GQA with 2 kv heads) with every parameter moved off its init."""
    args = dict(vocab_size=32, n_layer=3, d_model=16, n_head=4, d_ff=40, residual=residual, kernels=kernels)
    args.update(kw)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**args))
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=7, V=32, seed=3):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the backbone, from its equations

def rmsnorm(x, gain=None, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) * gain over the last dim."""
    out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if gain is None else out * gain


def layernorm(x, gain, eps=1e-6):
    """(x - mean) / sqrt(var + eps) * gain, no bias (DeepNorm's block norm)."""
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(x, theta=10000.0):
    """Rotate-half RoPE on (B, H, T, hd): pair channel c with c + hd/2, angle t * theta^(-2c/hd)."""
    T, hd = x.shape[-2], x.shape[-1]
    half = hd // 2
    out = torch.empty_like(x)
    for t in range(T):
        for c in range(half):
            angle = t * theta ** (-2 * c / hd)
            a, b = x[..., t, c], x[..., t, c + half]
            out[..., t, c] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, c + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def heads(x, n, hd):
    B, T, _ = x.shape
    return x.view(B, T, n, hd).transpose(1, 2)                                 # (B, n, T, hd)


def attention(P, b, h, cfg, depth=None, key_in=None, value_in=None, value_mix=None):
    """Causal attention of block b on h (B, T, d). depth: None, or (keys, values), lists of (B, Hkv, T, hd) that join
    each query's softmax at its own token (MoDA). key_in, value_in: the inputs of W_k, W_v instead of h (MUDD).
    value_mix: (v_1, (l1, l2)): the softmax averages l1 v_1 + l2 v instead of v (ResFormer).
    -> (output (B, T, d), pre-RoPE k, the layer's own v (B, Hkv, T, hd))."""
    pre = f"blocks.{b}.attn."
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.d_model // cfg.n_head
    q = heads(h @ P[pre + "wq.weight"].T, H, hd)
    k = heads((h if key_in is None else key_in) @ P[pre + "wk.weight"].T, Hkv, hd)
    v_own = heads((h if value_in is None else value_in) @ P[pre + "wv.weight"].T, Hkv, hd)
    v = v_own if value_mix is None else value_mix[1][0] * value_mix[0] + value_mix[1][1] * v_own
    qr, kr = rope(q), rope(k)
    B, _, T, _ = q.shape
    out = torch.zeros(B, H, T, hd)
    for head in range(H):
        kv = head // (H // Hkv)                                                # the kv head this query head reads
        for t in range(T):
            logits = [qr[:, head, t] @ kr[:, kv, s].T for s in range(t + 1)]    # each (B, B): keep the diagonal
            logits = [l.diagonal() / math.sqrt(hd) for l in logits]
            values = [v[:, kv, s] for s in range(t + 1)]
            for dk, dv in zip(*(depth or ([], []))):
                logits.append((qr[:, head, t] * dk[:, kv, t]).sum(-1) / math.sqrt(hd))
                values.append(dv[:, kv, t])
            a = torch.softmax(torch.stack(logits, -1), -1)                     # (B, sources)
            out[:, head, t] = torch.einsum("bs,bsc->bc", a, torch.stack(values, 1))
    y = out.transpose(1, 2).reshape(B, T, -1) @ P[pre + "wo.weight"].T
    return y, k, v_own


def mlp(P, b, h):
    pre = f"blocks.{b}.mlp."
    gate = h @ P[pre + "w1.weight"].T
    return (gate * torch.sigmoid(gate) * (h @ P[pre + "w3.weight"].T)) @ P[pre + "w2.weight"].T


def sublayer(P, i, h, cfg):
    """F_i(h): block i // 2's attention (i even) or MLP (i odd)."""
    return attention(P, i // 2, h, cfg)[0] if i % 2 == 0 else mlp(P, i // 2, h)


def gain(P, name):
    return P[f"res.{name}.weight"]


def head(P, z):
    return z @ P["lm_head.weight"].T


# ----------------------------------------------------------------------------- the designs, from their equations

def preln(P, idx, cfg, branch=1.0):
    """h = x + branch * F_i(RMSNorm_i(x)); logits = W_out RMSNorm_f(x)."""
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        x = x + branch * sublayer(P, i, rmsnorm(x, gain(P, f"norms.{i}")), cfg)
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def sandwich(P, idx, cfg):
    """h = x + RMSNorm_post,i(F_i(RMSNorm_i(x)))."""
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        y = sublayer(P, i, rmsnorm(x, gain(P, f"norms.{i}")), cfg)
        x = x + rmsnorm(y, gain(P, f"post_norms.{i}"))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def lns(P, idx, cfg, by_depth=False):
    """h = x + F_i(RMSNorm_i(x) / sqrt(b + 1)), b = the 0-based block; by_depth (the release's default_depth_scaled):
    / sqrt(L) in every block."""
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        divisor = math.sqrt(cfg.n_layer) if by_depth else math.sqrt(i // 2 + 1)
        x = x + sublayer(P, i, rmsnorm(x, gain(P, f"norms.{i}")) / divisor, cfg)
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def deepnorm(P, idx, cfg):
    """h = LN_i(alpha x + F_i(x)), alpha = (2L)^(1/4), a mean-centred LayerNorm; the head keeps an RMSNorm."""
    alpha = (2 * cfg.n_layer) ** 0.25
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        x = layernorm(alpha * x + sublayer(P, i, x, cfg), gain(P, f"norms.{i}"))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def keel(P, idx, cfg):
    """Sublayer 0: Pre-LN. Sublayer 1: RMSNorm_post(h + F(RMSNorm(h))). i >= 2: RMSNorm_post(2L h + F(RMSNorm(h)));
    post_norms.{i - 1} belongs to sublayer i."""
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        y = sublayer(P, i, rmsnorm(x, gain(P, f"norms.{i}")), cfg)
        if i == 0:
            x = x + y
        else:
            alpha = 1.0 if i == 1 else 2 * cfg.n_layer
            x = rmsnorm(alpha * x + y, gain(P, f"post_norms.{i - 1}"))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def postln(P, idx, cfg):
    """h = RMSNorm_i(x + F_i(x))."""
    x = P["wte.weight"][idx]
    for i in range(2 * cfg.n_layer):
        x = rmsnorm(x + sublayer(P, i, x, cfg), gain(P, f"norms.{i}"))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def depth_mup(alpha):
    """Pre-LN with the branch scaled by (L / 24)^(-alpha) (depth_only: the head unscaled)."""
    return lambda P, idx, cfg: preln(P, idx, cfg, branch=(cfg.n_layer / 24) ** -alpha)


def hc_maps(P, i, H, n):
    """HC's maps of sublayer i from the streams H (B, T, n, D): A (B, T, n, n + 1), rows = input stream s, column 0 =
    the branch input, column 1 + o = output stream o (the release's layout; residuals.HC's H_res[o, s] is A[s, 1 + o]);
    beta (B, T, n) [o]. Hbar = H / rms(H) per stream, eps 1e-8."""
    c = f"res.conn.{i}."
    Hbar = rmsnorm(H, eps=1e-8)
    A = P[c + "static_alpha"] + P[c + "alpha_scale"] * torch.tanh(torch.einsum("btsd,dk->btsk", Hbar, P[c + "dynamic_alpha"]))
    beta = P[c + "static_beta"] + P[c + "beta_scale"] * torch.tanh(torch.einsum("btsd,d->bts", Hbar, P[c + "dynamic_beta"]))
    return A, beta


def hc(collapse="sum", forward="mixed", n=4):
    """y = F_i(RMSNorm_i(sum_s A[s, 0] h_s)); h'_o = sum_s A[s, 1 + o] h_s + beta_o y (unmixed: h_o + beta_o y)."""
    def run(P, idx, cfg, x0=None):
        e = P["wte.weight"][idx] if x0 is None else x0
        H = e.unsqueeze(2).expand(-1, -1, n, -1)
        for i in range(2 * cfg.n_layer):
            A, beta = hc_maps(P, i, H, n)
            branch = torch.einsum("bts,btsd->btd", A[..., 0], H)
            y = sublayer(P, i, rmsnorm(branch, gain(P, f"norms.{i}")), cfg)
            if forward == "mixed":
                carried = torch.stack([torch.einsum("bts,btsd->btd", A[..., 1 + o], H) for o in range(n)], 2)
            else:
                carried = H
            H = carried + beta[..., None] * y[:, :, None]
        return head(P, collapse_streams(P, H, collapse))
    return run


def collapse_streams(P, H, mode):
    if mode == "norm_each":
        return rmsnorm(H, gain(P, "norm_f")).sum(2)
    return rmsnorm(H.sum(2) if mode == "sum" else H.mean(2), gain(P, "norm_f"))


def sinkhorn(logits, iters=20, eps=1e-6):
    """Liger's Sinkhorn on (n, n) logits (row o = output, column = input): a softmax over each row (+ eps), the columns
    normalised, then iters - 1 rounds of rows then columns, each dividing by (sum + eps)."""
    M = torch.softmax(logits, -1) + eps
    M = M / (M.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + eps)
        M = M / (M.sum(-2, keepdim=True) + eps)
    return M


def mhc_maps(P, i, H, n, iters=20):
    """mHC's maps of sublayer i: H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n) [output, input]."""
    c = f"res.conn.{i}."
    x = H.flatten(2)                                                           # [h_0; ...; h_(n-1)], stream-major
    m = rmsnorm(x) @ P[c + "phi"]                                              # r = 1/sqrt(mean(x^2) + 1e-6)
    b = P[c + "b"]
    pre = torch.sigmoid(P[c + "alpha_pre"] * m[..., :n] + b[:n])
    post = 2 * torch.sigmoid(P[c + "alpha_post"] * m[..., n:2 * n] + b[n:2 * n])
    res_logits = (P[c + "alpha_res"] * m[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n))
    return pre, post, sinkhorn(res_logits, iters)


def mhc(n=4):
    """y = F_i(RMSNorm_i(sum_s H_pre[s] h_s)); h'_o = sum_s H_res[o, s] h_s + H_post[o] y; head: the streams' mean."""
    def run(P, idx, cfg):
        H = P["wte.weight"][idx].unsqueeze(2).expand(-1, -1, n, -1)
        for i in range(2 * cfg.n_layer):
            pre, post, res = mhc_maps(P, i, H, n)
            y = sublayer(P, i, rmsnorm(torch.einsum("bts,btsd->btd", pre, H), gain(P, f"norms.{i}")), cfg)
            H = torch.einsum("btos,btsd->btod", res, H) + post[..., None] * y[:, :, None]
        return head(P, rmsnorm(H.mean(2), gain(P, "norm_f")))
    return run


def depth_softmax(P, row, sources, out_gain, eps=1e-5, topk=None):
    """AttnRes' consumer with query row `row`: p_j = softmax_j <q, g * v_j / rms(v_j)>, RMSNorm(sum_j p_j v_j). With
    learnt logit scales (the release's), q is q exp(s_row); topk (a fraction): per token only the ceil(topk S)
    largest logits enter the softmax, equal ones taken from the lower source first."""
    q, g = P["res.queries"][row], P["res.key_gains"][row]
    if "res.logit_scales" in P:
        q = q * torch.exp(P["res.logit_scales"][row])
    logits = torch.stack([(g * rmsnorm(v, eps=eps) * q).sum(-1) for v in sources], -1)
    if topk is not None:
        logits = largest_only(logits, min(len(sources), max(1, math.ceil(topk * len(sources)))))
    p = torch.softmax(logits, -1)
    mix = sum(p[..., j, None] * v for j, v in enumerate(sources))
    return rmsnorm(mix, out_gain, eps)


def largest_only(logits, k):
    """(B, T, S) logits with all but each token's k largest set to -inf; equal logits: the lower source first."""
    out = torch.full_like(logits, float("-inf"))
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[b, t].tolist()
            for j in sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]:
                out[b, t, j] = logits[b, t, j]
    return out


def groups_of(n_sub, n_groups=None, block_size=None, grouping="even"):
    if grouping == "doubling":                                                  # sizes 1, 1, 2, 4, ...
        starts = [0] + [2 ** g for g in range(n_sub.bit_length()) if 2 ** g < n_sub]
        return [sum(k >= start for start in starts) - 1 for k in range(n_sub)]
    if block_size is not None:
        return [k // block_size for k in range(n_sub)]
    n_groups = min(n_groups, n_sub)
    return [k * n_groups // n_sub for k in range(n_sub)]


def attnres(n_groups=None, block_size=None, grouping="even", topk=None):
    """Sublayer 0 reads RMSNorm_0(e). Consumer k >= 1 (query row k - 1) mixes [e, the completed groups, and its own
    group's partial sum if any]; Full AttnRes: every sublayer is a group, so k mixes [e, f_0, ..., f_(k-1)]. The head
    (row 2L - 1) mixes [e, every group], normed with the final norm's gain. x0: another start than the embedding (a
    hybrid's deep part)."""
    def run(P, idx, cfg, x0=None):
        n_sub = 2 * cfg.n_layer
        group = groups_of(n_sub, n_groups or n_sub, block_size, grouping)
        e = P["wte.weight"][idx] if x0 is None else x0
        outputs = []
        for k in range(n_sub):
            if k == 0:
                h = rmsnorm(e, gain(P, "norms.0"))
            else:
                sources = [e] + group_sums(outputs, group, upto=group[k])
                if group[k] == group[k - 1]:                                    # its own group is open: its partial
                    sources.append(sum(f for j, f in enumerate(outputs) if group[j] == group[k]))
                h = depth_softmax(P, k - 1, sources, gain(P, f"norms.{k}"), topk=topk)
            outputs.append(sublayer(P, k, h, cfg))
        sources = [e] + group_sums(outputs, group, upto=group[-1] + 1)
        return head(P, depth_softmax(P, n_sub - 1, sources, gain(P, "norm_f"), topk=topk))
    return run


def group_sums(outputs, group, upto):
    """[G_0, ..., G_(upto - 1)]: the sums of the outputs of each group below `upto`."""
    return [sum(f for j, f in enumerate(outputs) if group[j] == c) for c in range(upto)]


def moda(norm="pre"):
    """Block b's attention takes one softmax per query over its causal keys and the depth slots 0 .. 2b - 1 that earlier
    sublayers left at its own token: slot 2c = block c's attention's own pre-RoPE (k, v), slot 2c + 1 = W_kv,c of
    block c's MLP input, split [k; v] (blocks 0 .. L - 2). Pre-norm: Pre-LN's adds; post: h = RMSNorm_i(h + F_i(h)),
    attention and W_kv reading the raw stream."""
    def run(P, idx, cfg):
        Hkv, hd = cfg.n_kv_head, cfg.d_model // cfg.n_head
        x = P["wte.weight"][idx]
        keys, values = [], []
        for b in range(cfg.n_layer):
            h = x if norm == "post" else rmsnorm(x, gain(P, f"norms.{2 * b}"))
            y, k, v = attention(P, b, h, cfg, depth=(keys, values) if b > 0 else None)
            x = rmsnorm(x + y, gain(P, f"norms.{2 * b}")) if norm == "post" else x + y
            keys.append(k)
            values.append(v)
            h = x if norm == "post" else rmsnorm(x, gain(P, f"norms.{2 * b + 1}"))
            y = mlp(P, b, h)
            if b < cfg.n_layer - 1:
                kv = (h @ P[f"res.kv_proj.{b}.weight"].T).unflatten(-1, (2, Hkv, hd))       # (B, T, 2, Hkv, hd)
                keys.append(kv[:, :, 0].transpose(1, 2))
                values.append(kv[:, :, 1].transpose(1, 2))
            x = rmsnorm(x + y, gain(P, f"norms.{2 * b + 1}")) if norm == "post" else x + y
        return head(P, rmsnorm(x, gain(P, "norm_f")))
    return run


# ----------------------------------------------------------------------------- beyond the paper (issue 43)

def resformer(P, idx, cfg, learn=True):
    """Pre-LN; block b >= 1's attention averages l1 v_1 + l2 v_b, v_1 = block 0's values, (l1, l2) = lambdas[b - 1]
    (fixed 0.5, 0.5 when not learnt)."""
    x, v1 = P["wte.weight"][idx], None
    for b in range(cfg.n_layer):
        pair = P["res.lambdas"][b - 1] if learn and b > 0 else (0.5, 0.5)
        mix = None if b == 0 else (v1, pair)
        y, _, v = attention(P, b, rmsnorm(x, gain(P, f"norms.{2 * b}")), cfg, value_mix=mix)
        v1 = v if b == 0 else v1
        x = x + y
        x = x + mlp(P, b, rmsnorm(x, gain(P, f"norms.{2 * b + 1}")))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def mixln(post_fraction):
    """Post-LN, h = RMSNorm_i(x + F_i(x)), in blocks b < floor(post_fraction L); Pre-LN after them."""
    def run(P, idx, cfg):
        x = P["wte.weight"][idx]
        for i in range(2 * cfg.n_layer):
            if i // 2 < int(post_fraction * cfg.n_layer):
                x = rmsnorm(x + sublayer(P, i, x, cfg), gain(P, f"norms.{i}"))
            else:
                x = x + sublayer(P, i, rmsnorm(x, gain(P, f"norms.{i}")), cfg)
        return head(P, rmsnorm(x, gain(P, "norm_f")))
    return run


def pre_ln_block(P, b, x, cfg):
    x = x + sublayer(P, 2 * b, rmsnorm(x, gain(P, f"norms.{2 * b}")), cfg)
    return x + sublayer(P, 2 * b + 1, rmsnorm(x, gain(P, f"norms.{2 * b + 1}")), cfg)


def denseformer(P, idx, cfg):
    """X_0 = e; X_(b+1) = Pre-LN block b on x_b; x_(b+1) = sum_j a_b[j] X_j over j = 0 .. b + 1 (a_b = res.dwa.b)."""
    outputs = [P["wte.weight"][idx]]
    x = outputs[0]
    for b in range(cfg.n_layer):
        outputs.append(pre_ln_block(P, b, x, cfg))
        a = P[f"res.dwa.{b}"]
        x = sum(a[j] * X for j, X in enumerate(outputs))
    return head(P, rmsnorm(x, gain(P, "norm_f")))


def mudd_weights(P, b, x):
    """(C, B, T, b + 2) = W_2 GELU(W_1 RMSNorm(x)) + a, RMSNorm without a gain (eps 1e-6), exact (erf) GELU."""
    d = f"res.dense.{b}."
    hidden = rmsnorm(x) @ P[d + "w1"].T
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    A = hidden @ P[d + "w2"].T
    C, n = P[d + "bias"].shape
    return torch.stack([A[..., c * n:(c + 1) * n] + P[d + "bias"][c] for c in range(C)])


def mudd(P, idx, cfg):
    """Block 0: Pre-LN. After block b, streams X^c = sum_j A_b[c, j] X_j (c = Q, K, V, R; the last block: R alone);
    block b >= 1: h = X^R + Attn(q <- N_q(X^Q), k <- N_k(X^K), v <- N_v(X^V)), out = h + FFN(N(h))."""
    outputs = [P["wte.weight"][idx]]
    q = k = v = r = outputs[0]
    for b in range(cfg.n_layer):
        if b == 0:
            y = attention(P, b, rmsnorm(r, gain(P, "norms.0")), cfg)[0]
        else:
            y = attention(P, b, rmsnorm(q, gain(P, f"norms.{2 * b}")), cfg,
                          key_in=rmsnorm(k, gain(P, f"key_norms.{b - 1}")),
                          value_in=rmsnorm(v, gain(P, f"value_norms.{b - 1}")))[0]
        h = r + y
        outputs.append(h + mlp(P, b, rmsnorm(h, gain(P, f"norms.{2 * b + 1}"))))
        A = mudd_weights(P, b, outputs[-1])
        streams = [sum(A[c, ..., j, None] * X for j, X in enumerate(outputs)) for c in range(A.shape[0])]
        q, k, v, r = streams if len(streams) == 4 else streams * 4
    return head(P, rmsnorm(r, gain(P, "norm_f")))


def hybrid(deep, split):
    """Pre-LN blocks 0 .. S - 1 (S = min(floor(split L), L - 1)), then the deep design's equations on blocks S .. L - 1
    from the stream x_S, its tensors under res.deep."""
    def run(P, idx, cfg):
        L = cfg.n_layer
        S = min(int(split * L), L - 1)
        x = P["wte.weight"][idx]
        for b in range(S):
            x = pre_ln_block(P, b, x, cfg)
        Q = {"lm_head.weight": P["lm_head.weight"]}
        Q.update({"res." + k[len("res.deep."):]: t for k, t in P.items() if k.startswith("res.deep.")})
        for k, t in P.items():
            if k.startswith("blocks."):
                b, rest = k.split(".", 2)[1:]
                if int(b) >= S:
                    Q[f"blocks.{int(b) - S}.{rest}"] = t
        return deep(Q, idx, dataclasses.replace(cfg, n_layer=L - S), x0=x)
    return run


# (registry key, options) -> the design's forward from its equations. The README's design rows send a learner to the
# function here that makes each default one ("read these two"; tests/test_docs.py checks the names).
REFERENCE = {
    ("preln", None): preln, ("sandwich", None): sandwich, ("lns", None): lns, ("deepnorm", None): deepnorm,
    ("keel", None): keel, ("hc", None): hc(), ("mhc", None): mhc(), ("attnres", None): attnres(),
    ("block_attnres", None): attnres(n_groups=8), ("moda", None): moda(), ("postln", None): postln,
    ("preln_mup", None): depth_mup(0.5), ("preln_completep", None): depth_mup(1.0),
    ("hc", '{"collapse": "mean"}'): hc(collapse="mean"),
    ("hc", '{"collapse": "norm_each", "forward": "unmixed"}'): hc(collapse="norm_each", forward="unmixed"),
    ("mhc", '{"init": "uniform"}'): mhc(), ("block_attnres", '{"n_groups": 4}'): attnres(n_groups=4),
    ("block_attnres", '{"block_size": 4}'): attnres(block_size=4), ("moda", '{"norm": "post"}'): moda("post"),
    # beyond the paper, and the release's variants (issue 43)
    ("mudd", None): mudd, ("resformer", None): resformer, ("denseformer", None): denseformer,
    ("mixln", None): mixln(0.25), ("hybrid", None): hybrid(attnres(n_groups=8), 0.25),
    ("resformer", '{"learn": false}'): lambda P, idx, cfg: resformer(P, idx, cfg, learn=False),
    ("mixln", '{"post_fraction": 0.67}'): mixln(0.67),           # L3: 2 Post-LN blocks (the default: none at L3)
    ("hybrid", '{"split": 0.5}'): hybrid(attnres(n_groups=8), 0.5),
    ("hybrid", '{"deep": "hc", "split": 0.67}'): hybrid(hc(), 0.67),
    ("lns", '{"scale": "depth"}'): lambda P, idx, cfg: lns(P, idx, cfg, by_depth=True),
    ("attnres", '{"topk_fraction": 0.25}'): attnres(topk=0.25),
    ("attnres", '{"learn_logit_scale": true, "topk_fraction": 0.6}'): attnres(topk=0.6),
    ("block_attnres", '{"grouping": "doubling"}'): attnres(grouping="doubling"),
    ("block_attnres", '{"n_groups": 4, "topk_fraction": 0.5, "learn_logit_scale": true}'): attnres(n_groups=4, topk=0.5),
}


def options(text):
    import json
    return json.loads(text) if text else {}


def test_every_registered_design_has_a_reference_forward():
    assert {key for key, _ in REFERENCE} == set(RESIDUALS)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("key,opts", list(REFERENCE))
def test_logits_equal_the_equations(key, opts, kernels):
    """The model's logits equal its design's equations, computed here from its own tensors (L3: block 0, a middle and
    a last block; 4 query heads over 2 kv heads, so GQA's head pairing counts; every parameter perturbed)."""
    model = build(key, kernels, residual_args=options(opts), n_kv_head=2)
    idx = tokens()
    P = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        got = model(idx)[0]
        want = REFERENCE[key, opts](P, idx, model.cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", ["block_attnres", "attnres"])
def test_attnres_groups_at_a_depth_where_they_are_uneven(key):
    """L5: 10 sublayers over 8 groups (sizes 1 and 2 mixed) for Block AttnRes; Full AttnRes at the same depth."""
    model = build(key, n_layer=5)
    idx = tokens(T=5)
    P = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], REFERENCE[key, None](P, idx, model.cfg), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- read / write / collapse by hand

def site(model, i):
    return model.res.sites[i]


def read(model, s, i):
    return model.res.read(s, site(model, i))


def write(model, s, i, y, ctx):
    return model.res.write(s, site(model, i), y, ctx)


# four streams of width 3 that no permutation or transpose maps onto each other
STREAMS = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, -1.0], [-2.0, 1.0, 0.5], [0.5, -0.5, 4.0]])


def hand_model(residual, kernels, **kw):
    """A one-block model of width 4 with 2 heads (its sublayers are not run by these tests)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=8, n_layer=2, d_model=4, n_head=2, d_ff=8, residual=residual, kernels=kernels, **kw))


@pytest.mark.parametrize("kernels", KERNELS)
def test_hc_read_and_write_by_hand(kernels):
    """HC with set static maps and no dynamic part: A (rows = input stream s, column 0 = branch, 1 + t = output t)
    chosen asymmetric, beta = (1, 2, 3, 4). Branch input = sum_s A[s, 0] h_s (before its norm); h'_t = sum_s A[s, 1 + t]
    h_s + beta_t y. Reading A as [out, in] (a transpose) or A[:, 0] as a row changes both."""
    model = hand_model("hc", kernels)
    H = torch.cat([STREAMS, torch.tensor([[1.0], [2.0], [-1.0], [0.0]])], 1)[None, None]   # (1, 1, 4, 4)
    A = torch.tensor([[0.5, 1.0, 2.0, 0.0, 0.0],
                      [0.0, 0.0, 1.0, 3.0, 0.0],
                      [2.0, 0.0, 0.0, 1.0, 5.0],
                      [1.0, 4.0, 0.0, 0.0, 1.0]])
    beta = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with torch.no_grad():
        c = model.res.conn[1]
        c.static_alpha.copy_(A)
        c.static_beta.copy_(beta)
        c.dynamic_alpha.zero_()
        c.dynamic_beta.zero_()
        model.res.norms[1].weight.fill_(1.0)
        h, ctx = read(model, H, 1)
        branch = 0.5 * H[0, 0, 0] + 2.0 * H[0, 0, 2] + 1.0 * H[0, 0, 3]
        torch.testing.assert_close(h[0, 0], rmsnorm(branch), rtol=1e-5, atol=1e-6)
        y = torch.tensor([[[1.0, -1.0, 0.5, 2.0]]])
        out = write(model, H, 1, y, ctx)[0, 0]
        h0, h1, h2, h3 = H[0, 0]
        want = torch.stack([1.0 * h0 + 4.0 * h3, 2.0 * h0 + 1.0 * h1, 3.0 * h1 + 1.0 * h2, 5.0 * h2 + 1.0 * h3])
        want = want + beta[:, None] * y[0, 0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNELS)
def test_hc_dynamic_maps_by_hand(kernels):
    """The dynamic parts: A = A_static + s_a tanh(Hbar W_a), beta = beta_static + s_b tanh(Hbar w_b), Hbar = h_s /
    rms(h_s) per stream (no gain, eps 1e-8), with s_a = 0.5, s_b = 2 and one-hot projections, so each entry is a
    tanh of one normalised channel of one stream."""
    model = hand_model("hc", kernels)
    H = torch.cat([STREAMS, torch.tensor([[1.0], [2.0], [-1.0], [0.0]])], 1)[None, None]
    with torch.no_grad():
        c = model.res.conn[0]
        c.static_alpha.zero_()
        c.static_beta.zero_()
        c.dynamic_alpha.zero_()
        c.dynamic_alpha[1, 0] = 1.0        # the branch weight of stream s: tanh of its channel 1
        c.dynamic_alpha[2, 3] = 1.0        # output stream 2's weights: tanh of channel 2
        c.dynamic_beta.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
        c.alpha_scale.fill_(0.5)
        c.beta_scale.fill_(2.0)
        model.res.norms[0].weight.fill_(1.0)
        h, ctx = read(model, H, 0)
        Hbar = H[0, 0] / torch.sqrt(H[0, 0].pow(2).mean(-1, keepdim=True) + 1e-8)
        w_branch = 0.5 * torch.tanh(Hbar[:, 1])                                # (4,) per input stream
        torch.testing.assert_close(h[0, 0], rmsnorm((w_branch[:, None] * H[0, 0]).sum(0)), rtol=1e-5, atol=1e-6)
        y = torch.ones(1, 1, 4)
        out = write(model, H, 0, y, ctx)[0, 0]
        beta = 2.0 * torch.tanh(Hbar[:, 3])
        want = torch.zeros(4, 4)
        want[2] = (0.5 * torch.tanh(Hbar[:, 2])[:, None] * H[0, 0]).sum(0)     # only output stream t = 2 carries
        want = want + beta[:, None] * y[0, 0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNELS)
def test_mhc_transport_by_hand(kernels):
    """mHC with phi = 0: H_pre = sigmoid(b_pre), H_post = 2 sigmoid(b_post), H_res = Sinkhorn(b_res as [out, in]); a
    b_res that makes H_res a near-permutation (stream s -> output (s + 1) mod 4) must move stream s to output s + 1,
    not s - 1 (its transpose)."""
    model = hand_model("mhc", kernels)
    H = torch.cat([STREAMS, torch.tensor([[1.0], [2.0], [-1.0], [0.0]])], 1)[None, None]
    n = 4
    perm = torch.full((n, n), -12.0)
    for s in range(n):
        perm[(s + 1) % n, s] = 12.0                                            # row = output, column = input
    b_pre, b_post = torch.tensor([0.0, 1.0, -1.0, 2.0]), torch.tensor([0.5, -0.5, 0.0, 1.0])
    with torch.no_grad():
        c = model.res.conn[1]
        c.phi.zero_()
        c.b.copy_(torch.cat([b_pre, b_post, perm.flatten()]))
        c.alpha_pre.fill_(1.0)
        c.alpha_post.fill_(1.0)
        c.alpha_res.fill_(1.0)
        model.res.norms[1].weight.fill_(1.0)
        h, ctx = read(model, H, 1)
        pre = torch.sigmoid(b_pre)
        torch.testing.assert_close(h[0, 0], rmsnorm((pre[:, None] * H[0, 0]).sum(0)), rtol=1e-5, atol=1e-6)
        y = torch.tensor([[[1.0, -1.0, 0.5, 2.0]]])
        out = write(model, H, 1, y, ctx)[0, 0]
    M = sinkhorn(perm)
    want = M @ H[0, 0] + (2 * torch.sigmoid(b_post))[:, None] * y[0, 0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], H[0, 0, 0] + 2 * torch.sigmoid(b_post[1]) * y[0, 0], rtol=1e-3, atol=1e-3)


def hand_sources():
    """The embedding e and the sublayer outputs f_0 .. f_3 (one token, width 4) that the AttnRes tests mix: no two
    alike, so a swapped, dropped or shifted source changes every mix."""
    e = torch.tensor([[[1.0, 2.0, 0.0, -1.0]]])
    f = [torch.tensor([[[0.0, 1.0, 3.0, 1.0]]]), torch.tensor([[[2.0, -2.0, 1.0, 0.0]]]),
         torch.tensor([[[1.0, 1.0, 1.0, -3.0]]]), torch.tensor([[[0.5, 0.0, -1.0, 2.0]]])]
    return e, f


@pytest.mark.parametrize("kernels", KERNELS)
def test_full_attnres_reads_by_hand(kernels):
    """Full AttnRes at consumer k = 2 of three sources [e, f_0, f_1] (width 4): with query q and key gain g set,
    p = softmax_j <q, g * v_j / rms(v_j)> (eps 1e-5), the input RMSNorm_2(sum_j p_j v_j) with its gain; the head
    mixes all five sources with the last query row and the final norm's gain."""
    model = hand_model("attnres", kernels)
    e, f = hand_sources()
    q = torch.tensor([0.5, -1.0, 2.0, 0.0])
    g = torch.tensor([1.0, 2.0, 0.5, 1.5])
    out_gain = torch.tensor([1.0, 0.5, 2.0, 1.0])
    with torch.no_grad():
        res = model.res
        res.queries.zero_()
        res.key_gains.fill_(1.0)
        res.queries[1] = q                                                     # consumer 2 reads row 1
        res.key_gains[1] = g
        res.norms[2].weight.copy_(out_gain)
        res.queries[3] = -q                                                    # the head: row 2L - 1 = 3
        res.norm_f.weight.copy_(out_gain.flip(0))
        s = res.init_stream(e)
        s = write(model, s, 0, f[0], {})
        s = write(model, s, 1, f[1], {})
        h, _ = read(model, s, 2)
        s = write(model, s, 2, f[2], {})
        s = write(model, s, 3, f[3], {})
        z = res.collapse(s)

    def expected(query, gain_k, sources, out):
        logits = torch.stack([(query * gain_k * v[0, 0] / torch.sqrt(v[0, 0].pow(2).mean() + 1e-5)).sum()
                              for v in sources])
        p = torch.softmax(logits, 0)
        mix = sum(pj * v[0, 0] for pj, v in zip(p, sources))
        return out * mix / torch.sqrt(mix.pow(2).mean() + 1e-5)
    torch.testing.assert_close(h[0, 0], expected(q, g, [e, f[0], f[1]], out_gain), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z[0, 0], expected(-q, torch.ones(4), [e, *f], out_gain.flip(0)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
def test_block_attnres_partial_sums_by_hand(kernels):
    """Block AttnRes, two groups over four sublayers ({0, 1}, {2, 3}): consumer 1 mixes [e, f_0] (the open partial);
    consumer 2 opens group 1, so it mixes [e, f_0 + f_1]; consumer 3 mixes [e, f_0 + f_1, f_2]. With zero queries the
    mix is the plain mean of those sources."""
    model = hand_model("block_attnres", kernels, residual_args={"n_groups": 2})
    e, f = hand_sources()
    with torch.no_grad():
        res = model.res
        res.queries.zero_()
        s = res.init_stream(e)
        s = write(model, s, 0, f[0], {})
        got = [read(model, s, 1)[0]]
        s = write(model, s, 1, f[1], {})
        got.append(read(model, s, 2)[0])
        s = write(model, s, 2, f[2], {})
        got.append(read(model, s, 3)[0])
    sources = [[e, f[0]], [e, f[0] + f[1]], [e, f[0] + f[1], f[2]]]
    for k, (h, srcs) in enumerate(zip(got, sources), 1):
        mix = sum(srcs) / len(srcs)
        torch.testing.assert_close(h, rmsnorm(mix, res.norms[k].weight.detach(), 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
def test_moda_slots_hold_key_then_value(kernels):
    """MoDA's MLP slot: W_kv maps the MLP's normed input to [k; v] (the first half the key). With a W_kv whose value
    half is zero, block 1's depth values from that slot bring nothing back, and with its key half zero the slot's
    logit is 0: swapping the halves changes the logits (checked against the equations with both halves set)."""
    model = build("moda", kernels, n_layer=2)
    idx = tokens()
    with torch.no_grad():
        kv = model.res.kv_proj[0].weight
        kv[kv.size(0) // 2:] *= 3.0                                            # value half much larger than the key half
        P = {k: v.detach() for k, v in model.state_dict().items()}
        torch.testing.assert_close(model(idx)[0], moda()(P, idx, model.cfg), rtol=1e-4, atol=1e-4)
        swapped = dict(P)
        half = kv.size(0) // 2
        swapped["res.kv_proj.0.weight"] = torch.cat([kv[half:], kv[:half]])
        assert not torch.allclose(model(idx)[0], moda()(swapped, idx, model.cfg), atol=1e-3)


def joint_by_hand(q, k, v, q_depth, dk, dv):
    """One softmax per query over its causal sequence logits q_t . k_s and its depth logits q_depth_t . dk_j,t, all
    / sqrt(hd), mixing [v_s; dv_j,t]: q, k, v, q_depth (B, H, T, hd) (MHA), dk, dv lists of (B, H, T, hd)."""
    T, hd = q.size(2), q.size(-1)
    seq = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    DK, DV = torch.stack(dk, 3), torch.stack(dv, 3)                            # (B, H, T, S, hd)
    depth = (q_depth[..., None, :] * DK).sum(-1)                                # (B, H, T, S)
    a = (torch.cat([seq, depth], -1) / math.sqrt(hd)).softmax(-1)
    return a[..., :T] @ v + (a[..., T:, None] * DV).sum(-2)


@pytest.mark.parametrize("kernels", KERNELS)
def test_moda_rotates_the_query_not_the_depth_keys(kernels):
    """MoDA's block 1 attention (model.Attention handing its pre-RoPE q, k, v to MoDA.attend) equals the joint softmax
    of the RoPE-rotated query against the rotated sequence keys and the *unrotated* depth keys (the authors' release),
    computed here from the model's tensors; and differs from the two other readings: the depth keys rotated too, or
    the query left unrotated against them (the same maths: a depth key sits at its query's own position, so rotating
    both cancels; T = 7: RoPE moves every position but the first)."""
    model = build("moda", kernels, n_layer=2)
    idx, cfg = tokens(), model.cfg
    H, hd = cfg.n_head, cfg.head_dim
    P = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        tables = ops.rope_cos_sin(idx.size(1), hd, cfg.rope_theta, idx.device)
        s = model.blocks[0](model.res.init_stream(model.wte(idx)), (site(model, 0), site(model, 1)), model.res, tables)
        h, ctx = read(model, s, 2)
        got = model.blocks[1].attn(h, tables, ctx["attention"])[0]
        x = P["wte.weight"][idx]                                               # block 0 by hand: its two slots
        h0 = rmsnorm(x, gain(P, "norms.0"))
        dk, dv = ([heads(h0 @ P[f"blocks.0.attn.{w}.weight"].T, H, hd)] for w in ("wk", "wv"))
        x = x + attention(P, 0, h0, cfg)[0]
        h1 = rmsnorm(x, gain(P, "norms.1"))
        kv = heads(h1 @ P["res.kv_proj.0.weight"].T, 2 * H, hd)                 # [k'; v']: heads 0..H-1, then H..2H-1
        dk.append(kv[:, :H])
        dv.append(kv[:, H:])
        h2 = rmsnorm(x + mlp(P, 0, h1), gain(P, "norms.2"))
        q, k, v = (heads(h2 @ P[f"blocks.1.attn.{w}.weight"].T, H, hd) for w in ("wq", "wk", "wv"))

        def out(q_depth, keys):
            o = joint_by_hand(rope(q), rope(k), v, q_depth, keys, dv)
            return o.transpose(1, 2).reshape(h.shape) @ P["blocks.1.attn.wo.weight"].T

        torch.testing.assert_close(got, out(rope(q), dk), rtol=1e-4, atol=1e-4)
        for wrong in (out(rope(q), [rope(t) for t in dk]), out(q, dk)):
            assert (got - wrong).abs().max() > 1e-2


# ----------------------------------------------------------------------------- the init of every design's own tensors

def fresh(residual, **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=32, n_layer=3, d_model=16, n_head=4, d_ff=40, residual=residual)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_every_norm_gain_starts_at_one(residual):
    norms = [m for n, m in fresh(residual).res.named_modules() if hasattr(m, "weight") and "norm" in n]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)


@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_every_norm_takes_the_configs_eps(residual):
    """Every RMSNorm of the model, the design's own included (post-norms, MUDD's key and value norms), uses
    GPTConfig.norm_eps: built with 1e-3, none keeps ops.RMSNorm's default 1e-6."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layer=4, d_model=16, n_head=2, d_ff=32, residual=residual, norm_eps=1e-3)
    norms = [(n, m.eps) for n, m in GPT(cfg).named_modules() if isinstance(m, ops.RMSNorm)]
    assert norms and all(eps == 1e-3 for _, eps in norms), [n for n, eps in norms if eps != 1e-3]


def test_hc_init():
    """Connector i: A_static column 0 = one-hot at stream i mod n, columns 1..n = I; beta_static = 1; W_a, w_b = 0;
    s_a = s_b = 0.01."""
    res = fresh("hc").res
    for i, c in enumerate(res.conn):
        want = torch.zeros(4, 5)
        want[i % 4, 0] = 1.0
        want[:, 1:] = torch.eye(4)
        assert torch.equal(c.static_alpha, want), i
        assert torch.equal(c.static_beta, torch.ones(4))
        assert not c.dynamic_alpha.any() and not c.dynamic_beta.any()
        assert c.alpha_scale.item() == pytest.approx(0.01) and c.beta_scale.item() == pytest.approx(0.01)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_hc_family_divides_the_branch_outputs_by_sqrt_n(residual):
    """W_o and W_2 of every block are Pre-LN's (same seed) / sqrt(4) = / 2; every other backbone matrix is Pre-LN's."""
    pre, model = fresh("preln"), fresh(residual)
    for b in range(3):
        for name, factor in (("attn.wq", 1), ("attn.wk", 1), ("attn.wv", 1), ("attn.wo", 2), ("mlp.w1", 1),
                             ("mlp.w3", 1), ("mlp.w2", 2)):
            mod_a, mod_b = pre.blocks[b].get_submodule(name), model.blocks[b].get_submodule(name)
            torch.testing.assert_close(mod_b.weight * factor, mod_a.weight, rtol=0, atol=0, msg=f"{b} {name}")


def test_mhc_gap8_init_and_sinkhorn_fixed_point():
    """gap-8: phi = 0; b_pre = -8 but +8 at stream i mod n; b_post = 0; b_res = 0 on the diagonal, -8 off it; the
    three alphas 0.01. Sinkhorn of that start: diagonal 0.998991 (docs/designs.md#mhc: the row softmax's 1 / (1 + 3 e^-8)
    = 0.998995, less the 4e-6 that Sinkhorn's eps 1e-6 takes off), and the model's H_res at init is exactly that
    matrix (tests/test_docs.py checks the docs' numbers)."""
    res = fresh("mhc").res
    for i, c in enumerate(res.conn):
        want_pre = torch.full((4,), -8.0)
        want_pre[i % 4] = 8.0
        want_res = -8.0 * (1 - torch.eye(4))
        assert torch.equal(c.b, torch.cat([want_pre, torch.zeros(4), want_res.flatten()])), i
        assert not c.phi.any()
        for a in (c.alpha_pre, c.alpha_post, c.alpha_res):
            assert a.item() == pytest.approx(0.01)
    M = sinkhorn(-8.0 * (1 - torch.eye(4)))
    assert M.diagonal() == pytest.approx(torch.full((4,), 0.998995), abs=5e-6)
    assert 1 / (1 + 3 * math.exp(-8)) == pytest.approx(0.998995, abs=5e-7)
    x = torch.randn(2, 3, 4, 16)
    _, _, H_res = mhc_maps({f"res.conn.0.{k}": v for k, v in res.conn[0].state_dict().items()}, 0, x, 4)
    torch.testing.assert_close(H_res, M.expand_as(H_res), rtol=0, atol=1e-6)


def test_mhc_uniform_init():
    """uniform: b = 0, alphas 0.01, phi ~ N(0, 0.02^2) (a sample std within 5% over 24 x 4d entries)."""
    res = fresh("mhc", d_model=64, residual_args={"init": "uniform"}).res
    for c in res.conn:
        assert not c.b.any()
        assert c.phi.std().item() == pytest.approx(0.02, rel=0.05) and abs(c.phi.mean().item()) < 0.002


@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_attnres_init(residual):
    """Pseudo-queries 0 (uniform depth weights at init), key gains 1."""
    res = fresh(residual).res
    assert not res.queries.any() and torch.equal(res.key_gains, torch.ones_like(res.key_gains))


def test_deepnorm_beta_init():
    """W_v, W_o, W_1, W_2, W_3 = Pre-LN's (same seed) x beta, beta = (8L)^(-1/4); W_q, W_k unchanged."""
    pre, model = fresh("preln"), fresh("deepnorm")
    beta = (8 * 3) ** -0.25
    for b in range(3):
        for name in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3"):
            scale = 1.0 if name in ("attn.wq", "attn.wk") else beta
            torch.testing.assert_close(model.blocks[b].get_submodule(name).weight,
                                       pre.blocks[b].get_submodule(name).weight * scale, rtol=1e-6, atol=0)


def test_moda_kv_projection_init():
    """W_kv: one per block but the last, truncated normal std 0.02 cut at +-3 std."""
    res = fresh("moda", n_layer=4, d_model=64).res
    assert len(res.kv_proj) == 3
    for lin in res.kv_proj:
        assert lin.weight.abs().max() <= 0.06 and lin.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_depth_scaled_preln_branch_multipliers():
    """depth-muP (alpha 1/2) and CompleteP (alpha 1) scale the branch by (L/24)^-alpha: at L6, 2 and 4."""
    for residual, want in (("preln_mup", 2.0), ("preln_completep", 4.0)):
        model = fresh(residual, n_layer=6)
        s, y = torch.zeros(1, 1, 16), torch.ones(1, 1, 16)
        torch.testing.assert_close(write(model, s, 3, y, {}), want * y)


# ----------------------------------------------------------------------------- beyond the paper: init and hand cases

@pytest.mark.parametrize("residual", ["denseformer", "mudd"])
def test_dense_designs_start_as_pre_ln(residual):
    """DenseFormer (a_b one-hot on the newest output) and MUDD (W_2 = 0, a_b one-hot on the newest, every stream
    normed with gains 1) compute Pre-LN's logits exactly at init, on Pre-LN's weights."""
    pre, model = fresh("preln"), fresh(residual)
    model.load_state_dict(pre.state_dict(), strict=False)
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(model(idx)[0], pre(idx)[0])


def test_denseformer_init():
    """a_b has b + 2 entries, 1 on the newest output X_(b+1) and 0 elsewhere (the release's _init_weights)."""
    res = fresh("denseformer", n_layer=4).res
    for b, a in enumerate(res.dwa):
        assert a.tolist() == [0.0] * (b + 1) + [1.0]


def test_mudd_init_and_shapes():
    """Block b: W_1 (H_b, d) ~ N(0, 1/d), not truncated; W_2 (C (b + 2), H_b) = 0; a_b (C, b + 2) one-hot on the
    newest output for every stream; C = 4 but the last block's 1; H_b = 64 (floor(C (b + 2) e / 64) + 1), e = 4 for
    the last block (L20: 64 up to b = 13, then 128; the last block 128)."""
    L, d = 20, 64
    res = fresh("mudd", n_layer=L, d_model=d).res
    hidden = [m.w1.shape[0] for m in res.dense]
    assert hidden == [64] * 14 + [128] * 5 + [128]
    for b, m in enumerate(res.dense):
        C = 1 if b == L - 1 else 4
        assert m.w1.shape == (hidden[b], d) and m.w2.shape == (C * (b + 2), hidden[b]) and not m.w2.any()
        assert torch.equal(m.bias, torch.nn.functional.one_hot(torch.full((C,), b + 1), b + 2).float())
    w1 = torch.cat([m.w1.flatten() for m in res.dense])
    assert w1.std().item() == pytest.approx(d ** -0.5, rel=0.02) and w1.abs().max() > 3.5 * d ** -0.5
    assert len(res.key_norms) == len(res.value_norms) == L - 1


def test_resformer_init():
    """One (lambda_1, lambda_2) per block b >= 1, both 0.5 (the official code's fixed mix); learn=False keeps them as
    constants, no parameter."""
    res = fresh("resformer").res
    assert torch.equal(res.lambdas, torch.full((2, 2), 0.5)) and isinstance(res.lambdas, torch.nn.Parameter)
    fixed = fresh("resformer", residual_args={"learn": False})
    assert "res.lambdas" not in dict(fixed.named_parameters()) and "res.lambdas" not in fixed.state_dict()
    assert torch.equal(fixed.res.lambdas, torch.full((2, 2), 0.5))
    two, one = fresh("resformer", n_layer=2).res, fresh("resformer", n_layer=1).res
    assert isinstance(two.lambdas, torch.nn.Parameter) and two.lambdas.shape == (1, 2)
    assert not isinstance(one.lambdas, torch.nn.Parameter) and one.lambdas.shape == (0, 2)   # no block b >= 1


def test_resformer_without_its_first_block_mixes_in_zero_values():
    """Skipping block 0 in the diagnostics' pass is the model whose block 0 has zero values and writes nothing
    (W_v = W_2 = 0): later attentions mix lambda_1 * 0 into their own values."""
    from depthbench.evaluation import observe
    model = fresh("resformer", n_layer=3, n_kv_head=2).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        x = torch.randint(0, 32, (2, 6), generator=g)
        skipped = observe.record(model, x, skip=0).logits
        model.blocks[0].attn.wv.weight.zero_()
        model.blocks[0].mlp.w2.weight.zero_()
        torch.testing.assert_close(skipped, model(x)[0], rtol=1e-5, atol=1e-5)


def test_hybrid_refuses_a_split_outside_the_unit_interval_or_a_deep_design_it_lacks():
    """split in [0, 1] (1: one deep block, S = L - 1), deep one of the cross-layer designs; anything else, one line."""
    assert fresh("hybrid", residual_args={"split": 1.0}).res.n_shallow == 2
    for args in ({"split": 1.5}, {"split": -0.25}, {"deep": "preln"}, {"deep": "preln", "split": 0.5}):
        with pytest.raises(ValueError, match="hybrid deep must be one of"):
            fresh("hybrid", residual_args=args)


def test_mixln_post_fraction_bounds():
    """post_fraction 0 is Pre-LN throughout and 1 Post-LN throughout; outside [0, 1] is refused."""
    assert fresh("mixln", residual_args={"post_fraction": 0.0}).res.n_post == 0
    assert fresh("mixln", residual_args={"post_fraction": 1.0}).res.n_post == 3
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="post_fraction"):
            fresh("mixln", residual_args={"post_fraction": bad})


@pytest.mark.parametrize("fraction, L, n_post", [(0.25, 3, 0), (0.25, 4, 1), (0.25, 9, 2), (0.5, 5, 2), (1.0, 3, 3)])
def test_mixln_post_ln_blocks(fraction, L, n_post):
    """floor(alpha L) Post-LN blocks first: their sites carry the norm after the add, the others before F."""
    res = fresh("mixln", n_layer=L, residual_args={"post_fraction": fraction}).res
    posts = [site.post_norm is not None for site in res.sites]
    assert res.n_post == n_post and posts == [True] * 2 * n_post + [False] * 2 * (L - n_post)


@pytest.mark.parametrize("deep, split, L, S", [("block_attnres", 0.25, 8, 2), ("hc", 0.5, 5, 2), ("mudd", 1.0, 3, 2),
                                               ("attnres", 0.0, 3, 0)])
def test_hybrid_parts(deep, split, L, S):
    """S = min(floor(split L), L - 1) Pre-LN blocks (their norms), then the deep design built at L - S blocks: the
    hybrid's own tensors are exactly those, and its count is Pre-LN's plus the deep design's extra at L - S."""
    model = fresh("hybrid", n_layer=L, residual_args={"deep": deep, "split": split})
    alone = fresh(deep, n_layer=L - S)
    assert model.res.n_shallow == S and len(model.res.norms) == 2 * S
    assert {k[len("res.deep."):] for k in model.state_dict() if k.startswith("res.deep.")} == \
        {k[len("res."):] for k in alone.state_dict() if k.startswith("res.")}
    extra = alone.num_params() - fresh("preln", n_layer=L - S).num_params()
    assert model.num_params() == fresh("preln", n_layer=L).num_params() + extra


def test_attnres_logit_scales_start_at_zero():
    """The release's learnt logit scale: one s_k per consumer (2L), init 0, so exp(s_k) = 1 and the model is AttnRes'."""
    plain, scaled = fresh("attnres"), fresh("attnres", residual_args={"learn_logit_scale": True})
    assert torch.equal(scaled.res.logit_scales, torch.zeros(6))
    scaled.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        plain.res.queries.normal_(0, 1.0)
        scaled.res.queries.copy_(plain.res.queries)
        assert torch.equal(scaled(tokens())[0], plain(tokens())[0])


@pytest.mark.parametrize("kernels", KERNELS)
def test_attnres_topk_keeps_the_lower_source_on_ties(kernels):
    """Zero queries give every source the same logit: top-k (fraction 0.5 of four sources: two) then keeps the
    embedding and f_0, each with weight 1/2, as the release's kernel takes the lowest index among equal maxima."""
    model = hand_model("attnres", kernels, residual_args={"topk_fraction": 0.5})
    e, f = hand_sources()
    with torch.no_grad():
        res = model.res
        res.queries.zero_()
        s = res.init_stream(e)
        for i in range(3):
            s = write(model, s, i, f[i], {})
        h, _ = read(model, s, 3)
        weights = res.weights(s, 3)[0, 0]
    assert weights.tolist() == [0.5, 0.5, 0.0, 0.0]
    torch.testing.assert_close(h, rmsnorm((e + f[0]) / 2, res.norms[3].weight.detach(), 1e-5), rtol=1e-5, atol=1e-6)


def test_block_attnres_doubling_groups():
    """grouping "doubling": group g >= 1 starts at sublayer 2^(g-1), sizes 1, 1, 2, 4, ...; N follows the depth."""
    for L, want in [(3, [0, 1, 2, 2, 3, 3]), (5, [0, 1, 2, 2, 3, 3, 3, 3, 4, 4])]:
        res = fresh("block_attnres", n_layer=L, residual_args={"grouping": "doubling"}).res
        assert res.group == want and res.n_groups == want[-1] + 1


# ----------------------------------------------------------------------------- the documented parameter counts

DOCS = Path(__file__).resolve().parents[1] / "docs" / "designs.md"
OVERHEAD_SHAPES = ((24, 1024, 2736), (70, 640, 1712))            # the overhead table's two columns: (L, d, d_ff)
NOT_CLOSED_FORM = {"mudd": "a sum over blocks (test_all.py's mudd_extra)", "hybrid": "the deep design's at L - S"}


def formula(text):
    """A documented count in d and L ("2L(6d + 26)", "2d²(L − 1)", "4dL") -> a function of (d, L), or None when it is
    not a closed form of d and L alone."""
    expr = text.replace("−", "-").replace("²", "^2").replace("^", "**")
    expr = re.sub(r"(?<=[\dA-Za-z)])\s*(?=[A-Za-z(])", "*", expr)             # implicit products: 2L(6d) -> 2*L*(6*d)
    if not re.fullmatch(r"[\d dL+\-*/()]+", expr):
        return None
    return lambda d, L: eval(expr, {"__builtins__": {}}, {"d": d, "L": L})


def overhead_rows():
    """docs/designs.md's overhead table: (design keys, their options, the formula cell, {(L, d): the count given})."""
    lines = DOCS.read_text(encoding="utf-8").split("## Overhead", 1)[1].split("\n")
    rows = []
    for line in (line for line in lines if line.startswith("|")):
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[1])
        if not names:                                                   # the header and its rule
            continue
        keys = [n for n in names if not n.startswith("{")]
        opts = {k: v for n in names if n.startswith("{") for k, v in json.loads(n).items()}
        given = {(L, d): int(c.replace(",", "")) for (L, d, _), c in zip(OVERHEAD_SHAPES, cells[3:5])}
        rows.append((keys, opts, cells[2], given))
    return rows


def model_extra(key, L, d, d_ff, **opts):
    """The built model's parameters beyond Pre-LN's at (L, d, d_ff), MHA with 16 heads (shapes.count_params)."""
    return shapes.count_params(L, d, d_ff, key, **opts) - shapes.preln_params(L, d, d_ff)


@pytest.mark.slow                # ~10 s: 36 models built on the meta device, up to 70 blocks
def test_the_overhead_table_is_the_models_count():
    """Every row of docs/designs.md's overhead table: its two numbers are the built model's parameters beyond Pre-LN
    (L24 d1024, L70 d640), and its formula, evaluated, gives both; a formula that is no closed form of d and L is
    allowed only for the designs in NOT_CLOSED_FORM."""
    rows = overhead_rows()
    assert {k for keys, _, _, _ in rows for k in keys} == set(RESIDUALS)
    for keys, opts, text, given in rows:
        count = formula(text)
        assert count is not None or set(keys) <= set(NOT_CLOSED_FORM), (keys, text)
        for key in keys:
            for L, d, d_ff in OVERHEAD_SHAPES:
                real = model_extra(key, L, d, d_ff, **opts)
                assert given[L, d] == real, (key, opts, L, given[L, d], real)
                assert count is None or count(d, L) == real, (key, opts, text, L, count(d, L), real)


@pytest.mark.parametrize("key", list(dict.fromkeys(["hc", "mhc", "attnres", "block_attnres", "moda"] + [
    k for k in RESIDUALS if "`params(d, L) = " in (RESIDUALS[k].__doc__ or "")])))
def test_a_class_docstrings_parameter_formula_is_the_models_count(key):
    """The class docstring's `params(d, L) = ...` (required of HC, mHC, Full and Block AttnRes and MoDA, checked for
    every class that has one) gives the built model's parameters beyond Pre-LN at two shapes, and agrees with the
    overhead table's formula."""
    texts = re.findall(r"`params\(d, L\) = ([^`]+)`", RESIDUALS[key].__doc__)
    assert len(texts) == 1, texts
    count = formula(texts[0])
    table = {k: formula(text) for keys, opts, text, _ in overhead_rows() if not opts for k in keys}
    for L, d, d_ff in OVERHEAD_SHAPES + ((3, 64, 176),):
        real = model_extra(key, L, d, d_ff)
        assert count(d, L) == real == table[key](d, L), (key, texts[0], L, d)
