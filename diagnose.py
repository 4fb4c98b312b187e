"""
diagnose.py: the layer-wise diagnostics of DepthBench for one model, as one JSON file.

    python diagnose.py runs/preln_L6 --metrics all --out diag.json          # a run folder holding ckpt.pt
    python diagnose.py runs/hc_L6/ckpt.pt --metrics angular,causal --num-samples 16 --seq-len 128
    python diagnose.py --init attnres --layers 6 --width 128 --heads 4       # a fresh model, synthetic text
    python diagnose.py runs/austen_L6 --metrics nll --nll-data fixtures/nll  # NLL offline, on local JSONL
    python diagnose.py runs/austen_L6 --metrics zeroshot --zeroshot-data fixtures/zeroshot   # lm-eval, offline

A metric is one row of METRICS (its name, JSON key, definition, the release's windows and what it reads from the
recording pass) and one function that turns what it reads into its JSON object; the JSON carries the definition
next to the numbers. docs/diagnostics.md has the setup (fp32, eval mode, no gradients, fp64 sums), the depth states
(depthbench/evaluation/observe.py runs the model's own trunk loop, read in `recording` only) and the interventions (a
skipped block; a swap moves two blocks' weights with the residual's own tensors).
"""
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from depthbench.files import common  # first, before torch: its sys.excepthook makes a Ctrl-C during the imports one line
import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
from depthbench.evaluation.calibration import DiagError, calibration_groups, load_model, place
from depthbench.evaluation.interventions import swap_blocks
from depthbench.files.common import (ArgParser, CheckpointError, check_options, comma_list, fail, first_line,
                               hub_unreachable, json_object, positive, seed_number, write_json, VAL_SEED)
from depthbench.evaluation import nll as downstream, observe, zeroshot as harness
from model import GPT
from ops import dead_zone, erank  # the metrics the designs' telemetry shares
from residuals import RESIDUALS

SCHEMA = "depthbench.diagnose/2"  # 2: R_perm is over the last three quarters (1: over all pairs)


# ----------------------------------------------------------------------------- the observed forward

def recording(model, x, skip=None):
    """The observed forward on ids x (evaluation/observe.py: the model's own trunk loop, run from outside), block
    `skip` left out by the design's rule -> (logits, observe.Record). Every metric reads the trunk through this."""
    rec = observe.record(model, x, skip=skip)
    return rec.logits, rec


@dataclass
class Batch:
    """One calibration batch through the observed forward, as a need (below) reads it."""
    model: GPT              # the model diagnosed
    args: object            # the command line (the needs' settings: --eps)
    x: torch.Tensor         # (B, T) token ids
    y: torch.Tensor         # (B, T) next-token targets, -1 where there is none
    logits: torch.Tensor    # (B, T, V)
    rec: observe.Record     # depth states, lens readouts, design internals

    @cached_property
    def states(self):
        """The depth states as fp32 rows (B*T, D'), HC/mHC streams concatenated stream-major."""
        return [z.float().flatten(0, 1) for z in self.rec.states]

    @cached_property
    def updates(self):
        """(L, B*T, D'): u_l = z_(l+1) - z_l, what block l writes."""
        return torch.stack([b - a for a, b in zip(self.states, self.states[1:])])

    @cached_property
    def update_norms(self):
        """(L, B*T): |u_l| at every position."""
        return self.updates.norm(dim=-1)


@dataclass(frozen=True)
class Need:
    """A quantity the recording pass sums over a group's batches (fp64), once for all the metrics that read it."""
    name: str                        # what it is, in words
    per_batch: Callable = None       # Batch -> the batch's value (tensor, float or list of tensors; None: nothing)
    per_skip: Callable = None        # (Batch, s, the Batch with block s skipped) -> the value for skipped block s


@dataclass
class Sums:
    """The recording pass over one group's calibration batches."""
    L: int                  # blocks: a per-skip need has one total per skipped block
    windows: int = 0        # calibration windows
    tokens: int = 0         # their positions
    targets: int = 0        # positions with a next-token target
    loss: float = 0.0       # the plain model's summed next-token CE
    totals: dict = field(default_factory=dict)  # need -> its sum over the batches (per-skip: a list over blocks)

    def __getitem__(self, need):
        return self.totals.get(need)

    def add(self, need, value, s=None):
        """Add a batch's value to need's total (to skipped block s's for a per-skip need); None adds nothing."""
        if value is None:
            return
        if s is None:
            self.totals[need] = plus(self.totals.get(need), value)
        else:
            totals = self.totals.setdefault(need, [None] * self.L)
            totals[s] = plus(totals[s], value)


def plus(total, value):
    """total + value, where None is nothing yet and a list adds item by item."""
    if total is None:
        return value
    if isinstance(value, list):
        return [a + b for a, b in zip(total, value)]
    return total + value


@torch.no_grad()
def sweep(model, batches, needs, args):
    """One pass over a group's calibration batches: each batch's observed forward, and when a need reads them one
    more per skipped block (shared by causal score and pruning); every need's values summed -> Sums."""
    L = model.cfg.n_layer
    skips = [n for n in needs if n.per_skip]
    sums = Sums(L=L)
    bar = tqdm(total=len(batches) * (1 + L * bool(skips)), desc="layers", unit="fwd")
    for x, y in batches:
        logits, rec = recording(model, x)
        b = Batch(model, args, x=x, y=y, logits=logits, rec=rec)
        sums.windows += x.size(0)
        sums.tokens += x.numel()
        sums.targets += int((y >= 0).sum())
        sums.loss += ce_sum(logits, y)
        for need in needs:
            if need.per_batch:
                sums.add(need, need.per_batch(b))
        bar.update()
        for s in range(L) if skips else []:
            logits_s, rec_s = recording(model, x, skip=s)
            skipped = Batch(model, args, x=x, y=y, logits=logits_s, rec=rec_s)
            for need in skips:
                sums.add(need, need.per_skip(b, s, skipped), s=s)
            bar.update()
    bar.close()
    return sums


# ----------------------------------------------------------------------------- metric math

def ce_sum(logits, y):
    """Summed CE over the targets; -1 marks a position that is no target (an answers-only synthetic run)."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum").double().item()


def angle_sums(states, chunk=1024):
    """states: S tensors (N, D') -> (S, S) fp64 sums over tokens of the angle between z_i and z_j.
    fp64, so that a state with itself gives 0, not the ~1e-4 that arccos makes of fp32 rounding."""
    out = 0
    for k in range(0, states[0].size(0), chunk):                         # bounds the fp64 copy
        Z = F.normalize(torch.stack([z[k:k + chunk] for z in states]).double(), dim=-1)  # (S, n, D')
        out = out + torch.arccos(torch.einsum("ind,jnd->ijn", Z, Z).clamp(-1.0, 1.0)).sum(-1)
    return out.cpu()


def lens_sums(model, readouts, final_logits, y):
    """(L+1, 3) sums over positions of [early-exit CE, KL(p_final || p_l), top-5 overlap] per state."""
    logp_f = final_logits.float().log_softmax(-1)
    k = min(5, logp_f.size(-1))
    top_f = logp_f.topk(k).indices
    rows = []
    for r in readouts:
        logp = model.lm_head(r).float().log_softmax(-1)
        ce = -logp.gather(-1, y.clamp_min(0)[..., None])[..., 0] * (y >= 0)  # no target: 0
        kl = (logp_f.exp() * (logp_f - logp)).sum(-1)
        overlap = (logp.topk(k).indices[..., :, None] == top_f[..., None, :]).any(-1).sum(-1) / k
        rows.append(torch.stack([v.double().sum() for v in (ce, kl, overlap)]).cpu())
    return torch.stack(rows)


def token_matrix_metrics(H):
    """H: (W, T, D) token matrices (no centering) -> (W, 3): per matrix, from its singular values s, the stable rank
    sum(s^2) / max(s)^2, the effective rank exp(-sum p log p) with p = s^2 / sum(s^2) (p floored at 1e-12, as the
    release) and the ratio ||s||_1 / ||s||_2; all three 1 for a matrix of (near) zeros, as the release."""
    s = torch.linalg.svdvals(H.double())                                 # (W, min(T, D)), descending
    s2 = s ** 2
    total = s2.sum(-1)
    p = (s2 / total[:, None]).clamp_min(1e-12)
    out = torch.stack([total / s2[:, 0], torch.exp(-(p * p.log()).sum(-1)), s.sum(-1) / total.sqrt()], -1)
    return torch.where((total < 1e-12)[:, None], torch.ones_like(out), out)


def share_above(M, threshold, L, lo=0):
    """Over the pairs lo <= a < b <= L-1 (0-based blocks): (number of pairs, how many have M[a][b] > threshold,
    their share). R_causal and R_perm use lo = ceil(L/4), the last three quarters; R_perm_all uses lo = 0."""
    pairs = [(a, b) for a in range(lo, L) for b in range(a + 1, L)]
    above = sum(M[a][b] is not None and M[a][b] > threshold for a, b in pairs)
    return len(pairs), above, (above / len(pairs) if pairs else None)


def perm_shares(P, threshold, L):
    """R_perm over the last three quarters (the headline, Fig. 6) and over all pairs (secondary)."""
    n, above, share = share_above(P, threshold, L, math.ceil(L / 4))
    n_all, above_all, share_all = share_above(P, threshold, L)
    return {"R_perm": share, "n_pairs": n, "n_above": above, "s_min": math.ceil(L / 4),
            "R_perm_all": share_all, "n_pairs_all": n_all, "n_above_all": above_all}


def triangle(M, ok):
    """Tensor -> list of lists, None where ok(i, j) is false."""
    return [[float(M[i][j]) if ok(i, j) else None for j in range(len(M[i]))] for i in range(len(M))]


@torch.no_grad()
def permutation(model, batches, threshold):
    """P(i, j) = |loss(i, j swapped) - loss| / loss for all i < j -> JSON (docs/diagnostics.md#permutation)."""
    L = model.cfg.n_layer
    if L < 2:
        return {"skipped": "needs at least 2 blocks"}

    def loss():
        return sum(ce_sum(model(x)[0], y) for x, y in batches) / sum(int((y >= 0).sum()) for _, y in batches)
    base, P = loss(), [[None] * L for _ in range(L)]
    with tqdm(total=L * (L - 1) // 2, desc="swaps", unit="pair") as bar:
        for i in range(L):
            for j in range(i + 1, L):
                swap_blocks(model, i, j)
                P[i][j] = abs(loss() - base) / base
                swap_blocks(model, i, j)
                bar.update()
    return {"matrix": P, "threshold": threshold, **perm_shares(P, threshold, L), "baseline_loss": base,
            "swap_dedup": True}


# ----------------------------------------------------------------------------- what the recording pass sums

def design_internal(key):
    """The need of a design's logged tensors `key` (one per connector or consumer, each a token mean): summed as
    mean x tokens, so that the total over the tokens is the mean over all calibration tokens; nothing for a design
    that does not log it."""
    def per_batch(b):
        values = b.rec.internals.get(key)
        return None if values is None else [v.double().cpu() * b.x.numel() for v in values]
    return Need(f"token-averaged {key}", per_batch=per_batch)


def skip_updates(b, s, skipped):
    """(2, L - s - 1) for the blocks l > s: sums over positions of |u_l(s skipped) - u_l| / max(|u_l|, eps) and of
    |u_l(s skipped) - u_l|; nothing for the last block (no update after it)."""
    L = b.model.cfg.n_layer
    if s == L - 1:
        return None
    z, u = skipped.states, b.updates
    d = torch.stack([z[l + 1] - z[l] - u[l] for l in range(s + 1, L)]).norm(dim=-1)        # (L-s-1, N)
    ratio = d / b.update_norms[s + 1:].clamp_min(b.args.eps)
    return torch.stack([ratio.double().sum(-1), d.double().sum(-1)]).cpu()


ANGLES = Need("sums over positions of the angle between every two depth states",
              per_batch=lambda b: angle_sums(b.states))
LENS = Need("sums over positions of the lens' CE, KL and top-5 overlap per depth state",
            per_batch=lambda b: lens_sums(b.model, b.rec.readouts, b.logits, b.y))
UPDATE_NORMS = Need("sums over positions of |u_l|", per_batch=lambda b: b.update_norms.double().sum(-1).cpu())
SKIP_UPDATES = Need("how much every later update changes with block s skipped", per_skip=skip_updates)
SKIP_LOSS = Need("the summed CE with block s skipped", per_skip=lambda b, s, skipped: ce_sum(skipped.logits, b.y))
TRANSPORT = design_internal("H_res")                                    # HC/mHC: each connector's stream transport
DEPTH_WEIGHTS = design_internal("attnres_weights")                      # AttnRes: each consumer's depth softmax
DENSE_WEIGHTS = design_internal("dense_weights")                        # DenseFormer, MUDD: their weights over depth
SINGULAR = Need("sums over windows of each depth state's token-matrix metrics",
                per_batch=lambda b: torch.stack([token_matrix_metrics(z).sum(0) for z in b.rec.states]).cpu())


# ----------------------------------------------------------------------------- the metrics, one function each
# Each takes Inputs and returns its JSON object, {"skipped": why} where it does not apply; what it computes is its
# row's definition in METRICS below.

@dataclass
class Inputs:
    """What a metric's function reads."""
    model: GPT              # the model diagnosed, in eval mode on its device
    args: object            # the command line as typed (thresholds, eps, data folders, batch size)
    st: object              # what it resolved to (Settings: tokenizer, context length, tasks)
    device: str             # where the model is
    batches: list = field(default_factory=list)   # the calibration windows [(x, y)] of the metric's protocol
    sums: Sums = None       # the recording pass over them: what the metric's needs summed


def angular(inp):
    L, D = inp.model.cfg.n_layer, inp.sums[ANGLES] / (inp.sums.tokens * math.pi)
    sub = [[float(D[l, l + n]) if l + n <= L else None for l in range(L)] for n in range(1, L + 1)]
    return {"matrix": triangle(D, lambda i, j: i < j), "subsequent": sub}


def causal(inp):
    L, N, args = inp.model.cfg.n_layer, inp.sums.tokens, inp.args
    if L < 2:
        return {"skipped": "needs at least 2 blocks"}
    ratio, du = torch.zeros(L, L, dtype=torch.float64), torch.zeros(L, L, dtype=torch.float64)
    for s, total in enumerate(inp.sums[SKIP_UPDATES][:L - 1]):          # row s: block s skipped
        ratio[s, s + 1:], du[s, s + 1:] = total
    u = inp.sums[UPDATE_NORMS]
    C = triangle(ratio / N, lambda s, l: s < l)
    RoM = torch.where(u > 1e-8 * N, du / u.clamp_min(1e-300), torch.zeros(()))
    n_pairs, n_above, share = share_above(C, args.causal_threshold, L, math.ceil(L / 4))
    return {"matrix": C, "matrix_ratio_of_means": triangle(RoM, lambda s, l: s < l),
            "threshold": args.causal_threshold, "s_min": math.ceil(L / 4), "R_causal": share,
            "n_pairs": n_pairs, "n_above": n_above, "variant": "mean_of_ratios", "eps": args.eps}


def perm(inp):
    return permutation(inp.model, inp.batches, inp.args.perm_threshold)


def lens(inp):
    sums = inp.sums
    means = (sums[LENS] / torch.tensor([sums.targets, sums.tokens, sums.tokens])).tolist()
    return {"final_loss": sums.loss / sums.targets, "states": [
        {"index": l, "early_exit_ce": ce, "kl_to_final": kl, "top5_overlap": top} for l, (ce, kl, top) in enumerate(means)]}


def pruning(inp):
    sums = inp.sums
    base = sums.loss / sums.targets
    losses = (torch.tensor(sums[SKIP_LOSS], dtype=torch.float64) / sums.targets).tolist()
    return {"baseline_loss": base, "metric": "lm_loss",
            "layers": [{"layer": l, "loss": v, "delta": v - base} for l, v in enumerate(losses)]}


NO_DEPTH_SOFTMAX = "AttnRes only: this design has no depth softmax"


def depth_weights(sums):
    """Token-averaged depth-softmax weights of consumers 0..2L (consumer 0 reads the embedding only), or None. L is
    the number of blocks the softmax covers: the model's, or a hybrid's deep blocks ((len - 1) / 2)."""
    total = sums[DEPTH_WEIGHTS]
    return None if total is None else [[1.0]] + [(v / sums.tokens).tolist() for v in total]


def attnres(inp):
    w = depth_weights(inp.sums)
    if w is None:
        return {"skipped": NO_DEPTH_SOFTMAX}
    L = (len(w) - 1) // 2                                                 # the blocks that mix (a hybrid's deep ones)
    n_groups = len(w[-1]) - 1                                             # the head reads every group
    rows = [r + [None] * (n_groups + 1 - len(r)) for r in w]
    block = [rows[2 * b] for b in range(L)] + [rows[2 * L]]
    if n_groups == 2 * L:             # Full AttnRes: sum per block (a block-level consumer sees both or neither)
        block = [[r[0]] + [None if r[1 + 2 * k] is None else r[1 + 2 * k] + r[2 + 2 * k]
                           for k in range(L)] for r in block]
    return {"sublayer": rows, "block": block, "n_groups": n_groups, "first_block": inp.model.cfg.n_layer - L}


def deadzone(inp):
    w = depth_weights(inp.sums)
    if w is None:
        return {"skipped": NO_DEPTH_SOFTMAX}
    L = (len(w) - 1) // 2
    return {**dead_zone(w, L, inp.args.dead_tau), "n_groups": len(w[-1]) - 1, "first_block": inp.model.cfg.n_layer - L}


STREAMS = {4: ["Q", "K", "V", "R"], 1: ["mix"]}   # MUDD's four streams; DenseFormer's one


def dense(inp):
    total = inp.sums[DENSE_WEIGHTS]
    if total is None:
        return {"skipped": "DenseFormer and MUDD only: this design has no weights over depth"}
    rows = [v / inp.sums.tokens for v in total]                           # blocks 1 .. L' - 1, then the head: (C, n)
    names, n = STREAMS[len(rows[0]) if len(rows) > 1 else 1], len(rows[-1][0])
    first = inp.model.cfg.n_layer - (n - 1)                               # a hybrid's Pre-LN blocks come first
    weights = {}
    for c, name in enumerate(names):
        matrix = [[1.0]] + [r[c].tolist() for r in rows[:-1]]             # block 0 reads the embedding alone
        matrix.append(rows[-1][0].tolist() if c == len(names) - 1 else None)   # the head: the residual stream alone
        weights[name] = [None if r is None else r + [None] * (n - len(r)) for r in matrix]
    return {"streams": names, "weights": weights, "n_sources": n, "first_block": first}


def transport(inp):
    total = inp.sums[TRANSPORT]
    if total is None:
        return {"skipped": "HC/mHC only: this design has no stream-transport matrix"}
    Ms, prod = [v / inp.sums.tokens for v in total], []
    for M in Ms:
        prod.append(M if not prod else M @ prod[-1])
    per = [erank(M) for M in Ms]
    return {"per_connector": per, "mean": sum(per) / len(per), "product": [erank(P) for P in prod],
            "per_connector_sq": [erank(M, squared=True) for M in Ms], "n_streams": len(Ms[0]),
            "matrices": [M.tolist() for M in Ms]}


def collapse(inp):
    means = (inp.sums[SINGULAR] / inp.sums.windows).T.tolist()            # 3 rows of L+1 states
    return {**dict(zip(("stable_rank", "erank", "l1_l2_ratio"), means)), "num_windows": inp.sums.windows}


def nll(inp):
    if inp.st.text_skip:
        return {"skipped": inp.st.text_skip}
    args, tok = inp.args, data.get_tokenizer(inp.st.tok_name)
    return downstream.evaluate(inp.model, tok, inp.st.nll_tasks, nll_data=args.nll_data, limit=args.nll_limit,
                               max_len=inp.st.max_len, batch_size=args.batch_size, device=inp.device)


def zeroshot(inp):
    if inp.st.text_skip:
        return {"skipped": inp.st.text_skip}
    args, tok = inp.args, data.get_tokenizer(inp.st.tok_name)
    if tok.vocab_size > inp.model.cfg.vocab_size:
        raise DiagError(f"the tokenizer {tok.name} has {tok.vocab_size} ids, the model's vocab {inp.model.cfg.vocab_size}")
    lm = harness.harness_model(inp.model, tok, inp.st.max_len, batch_size=args.batch_size, device=inp.device)
    tasks = harness.evaluate(lm, inp.st.zeroshot_tasks, data_dir=args.zeroshot_data, limit=args.zeroshot_limit)
    return {"tasks": tasks, "source": args.zeroshot_data or "huggingface hub", "max_len": inp.st.max_len,
            "lm_eval": harness.version()}


@dataclass(frozen=True)
class Metric:
    """One diagnostic: a row of METRICS. A new metric is a row here and its function above."""
    name: str                # its --metrics name
    key: str                 # its JSON key
    compute: Callable        # Inputs -> its JSON object, or {"skipped": why} where it does not apply
    definition: str          # what it computes, in one line: written into its JSON object
    protocol: tuple = None   # the release's calibration windows x tokens per window; None: it reads no windows
    needs: tuple = ()        # what it reads from the recording pass (Needs); () with windows: its own forwards


# in --metrics' order; docs/diagnostics.md has a section for each
METRICS = [
    Metric("angular", "angular_distance", angular, protocol=(128, 512), needs=(ANGLES,), definition=(
        "d(i, j) = mean over tokens of arccos(cos(z_i, z_j)) / pi for depth states i < j: z_0 = embedding, z_l = "
        "stream before the final norm (HC/mHC: n streams concatenated; AttnRes: raw depth mix at group boundaries); "
        "subsequent[n-1][l] = d(l, l+n)")),
    Metric("causal", "causal_score", causal, protocol=(16, 256), needs=(UPDATE_NORMS, SKIP_UPDATES), definition=(
        "u_l = z_(l+1) - z_l; C(s, l) = mean over tokens of |u_l(block s skipped) - u_l| / max(|u_l|, eps), s < l "
        "(design skip rules); matrix_ratio_of_means = mean |du| / mean |u|; R_causal = share of pairs ceil(L/4) <= "
        "s < l <= L-1 (0-based) with C > threshold")),
    Metric("perm", "permutation_score", perm, protocol=(12, 256), definition=(
        "P(i, j) = |loss(blocks i and j swapped) - loss| / loss, mean next-token CE; a swap moves every tensor of the "
        "two blocks incl. the residual's own (norms, HC/mHC connectors, AttnRes: MLP-side mixer + the mixer reading "
        "the block's output, LNS: its scale) exactly once; R_perm = share of pairs ceil(L/4) <= i < j <= L-1 "
        "(0-based, the last three quarters, as Fig. 6) with P > threshold; R_perm_all = the same over all pairs i < j")),
    Metric("lens", "logit_lens", lens, protocol=(32, 512), needs=(LENS,), definition=(
        "p_l = softmax(W_out Norm_f(r_l)), r_l = what the head would read at state l (HC/mHC: streams reduced as the "
        "model does; AttnRes: block l's attention-side mix, the final mix at l = L); per position: CE = -log "
        "p_l(next token), KL(p_final || p_l), |top5(p_l) & top5(p_final)| / 5; means over positions")),
    Metric("pruning", "layer_pruning", pruning, protocol=(16, 256), needs=(SKIP_LOSS,), definition=(
        "delta(l) = mean next-token CE with block l skipped (design skip rules) - baseline CE")),
    Metric("attnres", "attnres_weights", attnres, protocol=(128, 512), needs=(DEPTH_WEIGHTS,), definition=(
        "w[c][j] = depth-softmax weight of consumer c on source j, mean over tokens; consumers 0..2L (sublayers; 2L = "
        "the head's readout), sources 0 = embedding, 1 + g = group g (Full AttnRes: sublayer g, so 2k+1 = attn k, "
        "2k+2 = MLP k); null = not visible; block: rows = each block's attention-side consumer and the readout, Full "
        "AttnRes sums each block's two sources, Block AttnRes keeps groups")),
    Metric("dense", "dense_weights", dense, protocol=(128, 512), needs=(DENSE_WEIGHTS,), definition=(
        "w[s][c][j] = weight of consumer c on source j in stream s, mean over tokens (DenseFormer: its static DWA "
        "weights, stream mix; MUDD: its per-token weights, streams Q, K, V, R); consumers 0..L (block c's input, L = "
        "the head's, only the residual stream), sources 0 = embedding, 1 + k = block k's output; null = not visible; "
        "not a softmax: rows need not sum to 1")),
    Metric("erank", "transport_erank", transport, protocol=(128, 512), needs=(TRANSPORT,), definition=(
        "erank(M) = exp(H(p)), p = sigma / sum(sigma); M = a connector's token-averaged stream transport H_res as "
        "[out, in] (HC: the transpose of alpha[:, 1:], whose rows are input streams); product[k] = erank(M_k ... "
        "M_0); per_connector_sq uses p = sigma^2 / sum(sigma^2)")),
    Metric("deadzone", "dead_zone", deadzone, protocol=(128, 512), needs=(DEPTH_WEIGHTS,), definition=(
        "schedule[k] = token-averaged weight of sublayer k's depth softmax on non-embedding sources (sublayer 0 reads "
        "only the embedding: 0); dead when < tau; count_blocks = blocks with both dead; Fig. 9 is Block AttnRes', "
        "Full AttnRes (groups of one sublayer) gets the same numbers")),
    Metric("collapse", "token_collapse", collapse, protocol=(256, 512), needs=(SINGULAR,), definition=(
        "per depth state z_l and window, the token matrix H (T x D', no centering) and its singular values s: "
        "stable_rank = sum(s^2) / max(s)^2, erank = exp(-sum p log p) with p = s^2 / sum(s^2), l1_l2_ratio = "
        "sum(s) / sqrt(sum(s^2)); each 1 when the tokens share one direction; means over windows")),
    Metric("nll", "nll", nll, definition=(
        "-sum log p(answer tokens | prompt), teacher-forced; the prompt's trailing whitespace moves to the answer, "
        "answer tokens = tokens(prompt + answer) after tokens(prompt), left-truncated to max_len + 1; nll_mean = "
        "nll_sum / num_target_tokens, pooled over tokens per task, per category and over all")),
    Metric("zeroshot", "zeroshot", zeroshot, definition=(
        "lm-eval's multiple-choice accuracy, zero-shot, with lm-eval's own task definitions: acc = share of items "
        "whose right choice has the highest log p(choice | prompt), acc_norm = the same with log p divided by the "
        "choice's length in characters (WinoGrande: the choice is the context, the rest of the sentence is scored)")),
]
BY_NAME = {m.name: m for m in METRICS}


# ----------------------------------------------------------------------------- command line

@dataclass
class Settings:
    """What the command line and the checkpoint resolve to (argparse's namespace keeps what was typed)."""
    todo: set                    # the metrics to compute (names)
    nll_tasks: list              # the NLL tasks
    zeroshot_tasks: list         # the zero-shot tasks (lm-eval's names)
    seed: int = None             # seeds the windows (and --init's weights)
    samples: dict = field(default_factory=dict)  # metric -> (windows, tokens per window)
    max_len: int = None          # context length of NLL and zero-shot
    tok_name: str = None         # tokenizer of text calibration, NLL and zero-shot
    text_skip: str = None        # why NLL and zero-shot are skipped (a model of synthetic tokens), or None
    out: str = None              # the output JSON


def protocol_help():
    """The release's windows x tokens of the metrics that read windows, metrics with one setting together."""
    by_setting = {}
    for m in METRICS:
        if m.protocol:
            by_setting.setdefault(m.protocol, []).append(m.name)
    return "; ".join(f"{', '.join(names)} {n} x {t}" for (n, t), names in by_setting.items())


def build_parser():
    p = ArgParser(prog="diagnose.py", description="Layer-wise diagnostics of one DepthBench model -> JSON.")
    pos, share, whole = positive(int), positive(float, zero=True), positive(int, zero=True)
    p.add_argument("checkpoint", nargs="?", help="a run folder holding ckpt.pt, a .pt file, or an official "
                   "checkpoint: hub id, folder with stepN/ folders or a step folder (depthbench/files/official.py); or use --init")
    p.add_argument("--step", type=whole, help="official checkpoint: the stepN folder (default: the highest)")
    p.add_argument("--metrics", type=comma_list(str), default="all", help=f"comma list of {', '.join(BY_NAME)}, or all (default)")
    p.add_argument("--out", help="output JSON (default: diagnose.json in the checkpoint's folder, or here for --init)")
    g = p.add_argument_group("a fresh model instead of a checkpoint")
    g.add_argument("--init", choices=list(RESIDUALS), help="diagnose a freshly initialised model of this design")
    g.add_argument("--layers", type=pos, default=6, help="--init: blocks L (default 6)")
    g.add_argument("--width", type=pos, default=128, help="--init: d_model (default 128)")
    g.add_argument("--heads", type=pos, default=4, help="--init: attention heads (default 4)")
    g.add_argument("--vocab", type=pos, help="--init: vocab size (default: the tokenizer's, else the synthetic task's)")
    g.add_argument("--residual-args", type=json_object, default={},
                   help="--init: the design's options as JSON, e.g. '{\"n_groups\": 4}' (its class' `options`); an "
                   "official checkpoint: what its config.json cannot tell (docs/official.md)")
    g = p.add_argument_group("calibration text and compute")
    g.add_argument("--calib", default="auto", help="auto (the run's val data), synthetic, a shard folder or text files")
    g.add_argument("--token-data-glob", help="pre-tokenized .npy token shards (a glob), windows drawn by the release's "
                   "rule (files in proportion to their usable length, numpy default_rng(seed)); replaces --calib")
    g.add_argument("--tokenizer", help="gpt2, bytes or a tokenizer.json, for text files, NLL and zeroshot (default: "
                   "the run's)")
    g.add_argument("--max-gap", type=pos, default=4, help="synthetic task's max gap if the run says none (default 4)")
    g.add_argument("--num-samples", type=pos, help=f"windows, for every metric (default: the release's per metric: "
                   f"{protocol_help()})")
    g.add_argument("--seq-len", type=pos, help="tokens per window, for every metric (default: the release's per "
                   "metric, as --num-samples; at most the run's own seq_len)")
    g.add_argument("--batch-size", type=pos, default=8, help="windows (NLL, zeroshot: requests) per forward pass "
                   "(default 8)")
    g.add_argument("--seed", type=seed_number, help="seeds the windows and --init (default: the run's seed, else %d; "
                   "the release's analysis used 42)" % VAL_SEED)
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="fp32 (default), or bf16 on CUDA as the "
                   "release's analysis: weights rounded to bf16, the forward under bf16 autocast")
    p.add_kernels()
    g.add_argument("--threads", type=pos, default=1, help="CPU threads (default 1: tiny models run several "
                   "times faster single-threaded, most of all on a shared machine)")
    g = p.add_argument_group("metric settings")
    g.add_argument("--causal-threshold", type=share, default=0.45, help="R_causal counts C > this (default 0.45)")
    g.add_argument("--perm-threshold", type=share, default=0.15, help="R_perm counts P > this (default 0.15)")
    g.add_argument("--dead-tau", type=share, default=0.05, help="dead when non-embedding weight < this (0.05)")
    g.add_argument("--eps", type=positive(float), default=1e-8, help="floor of |u_l| in causal ratios (default 1e-8)")
    g = p.add_argument_group("downstream NLL and zero-shot tasks")
    g.add_argument("--nll-data", help="folder of local {task}.jsonl in each dataset's own fields (e.g. fixtures/nll)")
    g.add_argument("--nll-tasks", type=comma_list(str), default=",".join(downstream.TASKS),
                   help=f"comma list of {', '.join(downstream.TASKS)}")
    g.add_argument("--nll-limit", type=pos, help="at most this many examples per task (default: all)")
    g.add_argument("--nll-max-len", type=pos, help="context length of NLL and zeroshot, left-truncated (default: the "
                   "run's seq_len)")
    g.add_argument("--tasks", type=comma_list(str), default=",".join(harness.TASKS),
                   help=f"zeroshot: comma list of lm-eval tasks, of {', '.join(harness.TASKS)} (default: all seven)")
    g.add_argument("--zeroshot-data", help="zeroshot offline: folder of <task>.jsonl in the hub's fields (fixtures/zeroshot)")
    g.add_argument("--zeroshot-limit", type=pos, help="zeroshot: at most this many items per task (lm-eval's limit; "
                   "default: all)")
    g.add_argument("--skip-missing-tasks", action="store_true", help="--zeroshot-data: skip a task with no file (say so)")
    return p


def parse_args(argv):
    """The command line -> (args as typed, Settings with the metrics and tasks); bad input exits 2 in one line."""
    p = build_parser()
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.init is None):
        p.error("give a checkpoint or --init RESIDUAL (one of them)")
    todo = set(args.metrics)  # comma_list: an empty item was refused already
    if todo == {"all"}:
        todo = set(BY_NAME)
    if todo - set(BY_NAME):
        bad = ", ".join(sorted(todo - set(BY_NAME)))
        p.error(f"unknown metric(s) {bad}; choose from {', '.join(BY_NAME)}, all")
    for flag, given, known in (("--nll-tasks", args.nll_tasks, downstream.TASKS), ("--tasks", args.tasks, harness.TASKS)):
        if set(given) - set(known):
            p.error(f"{flag}: choose from {', '.join(known)}")
    try:
        check_options([args.init] if args.init else list(RESIDUALS), args.residual_args)
    except ValueError as e:
        p.error(f"--residual-args: {e}")
    if args.init and (args.width % args.heads or args.width // args.heads % 2):
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads} with an even head_dim (RoPE)")
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder; give the JSON file's name")
    if args.out and (why := common.cannot_write(args.out)):  # before the work, not after
        p.error(f"--out {args.out}: {why}")
    if args.tokenizer not in (None, "gpt2", "bytes") and not Path(args.tokenizer).exists():
        p.error(f"--tokenizer {args.tokenizer}: not gpt2, bytes or a tokenizer.json")
    for flag, folder in (("--nll-data", args.nll_data), ("--zeroshot-data", args.zeroshot_data)):
        if folder and not Path(folder).is_dir():
            p.error(f"{flag} {folder}: not a folder")
    harness.check_args(p, args, asked="zeroshot" in todo)  # its data, before lm-eval reads it
    seed = VAL_SEED if args.init and args.seed is None else args.seed
    return args, Settings(todo=todo, nll_tasks=args.nll_tasks, zeroshot_tasks=args.tasks, seed=seed, out=args.out)


def resolve(args, st, run):
    """Fill in what the checkpoint's run decides: the seed, each metric's windows, the tokenizer and context length
    of NLL and zero-shot; what these need and is missing (lm-eval, the hub) fails here, before any compute."""
    st.seed = run.get("seed", VAL_SEED) if st.seed is None else st.seed
    run_len = run.get("seq_len")
    for m in METRICS:
        if m.name in st.todo and m.protocol:
            N, T = m.protocol
            st.samples[m.name] = (args.num_samples or N, args.seq_len or min(T, run_len or T))
    st.max_len = args.nll_max_len or run_len or args.seq_len or 512
    st.tok_name = args.tokenizer or run.get("tokenizer")
    if st.tok_name is None or (run.get("data") == "synthetic" and not args.tokenizer):
        st.text_skip = "the model reads synthetic-task tokens, not text (--tokenizer forces a text tokenizer)"
        return
    if "zeroshot" in st.todo and (why := harness.missing()):
        raise DiagError(f"{why}; or leave zeroshot out of --metrics")
    hub = [(m, flag) for m, local, flag in (("nll", args.nll_data, "--nll-data fixtures/nll"),
                                            ("zeroshot", args.zeroshot_data, "--zeroshot-data fixtures/zeroshot"))
           if m in st.todo and not local]
    if hub and (down := hub_unreachable()):  # fail fast, before any compute
        m, flag = hub[0]
        raise DiagError(f"cannot reach the HuggingFace hub at {down[0]} ({down[1]}); offline, use "
                        f"{flag} (local JSONL) or leave {m} out of --metrics")


def setup(args, st):
    """Model, calibration batches per setting and the run's meta; every problem a user can fix is a DiagError."""
    model, run, ckpt_path, step = load_model(args, st)
    resolve(args, st, run)
    model, device, precision = place(model, args)
    groups = calibration_groups(args, st, run, model=model, device=device)
    cfg, res = model.cfg, model.res
    samples = {m: {"num_samples": N, "seq_len": T, "calibration": what}
               for (N, T), (metrics, _, what) in groups.items() for m in sorted(metrics)}
    meta = {"residual": cfg.residual, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "ar": cfg.d_model / cfg.n_layer,
            "n_head": cfg.n_head, "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size, "residual_args": cfg.residual_args,
            "n_streams": getattr(res, "n", None), "n_groups": getattr(res, "n_groups", None),
            "checkpoint": ckpt_path, "step": step, "init": args.init, "samples": samples,
            "batch_size": args.batch_size, "dtype": {"fp32": "float32", "bf16": "bfloat16 (autocast)"}[args.dtype],
            "device": str(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "seed": st.seed, "torch": torch.__version__, "timings_s": {}}
    return model, groups, meta, device, precision


def described(m, inputs):
    """Metric m's JSON object, its definition added (not to {"skipped": why})."""
    obj = m.compute(inputs)
    return obj if "skipped" in obj else {**obj, "definition": m.definition}


def run_group(rows, inputs):
    """Metrics `rows` on one group's calibration windows (inputs.batches), one recording pass for all they need
    -> {JSON key: object}."""
    needs = list(dict.fromkeys(need for m in rows for need in m.needs))
    if needs:
        inputs.sums = sweep(inputs.model, inputs.batches, needs, inputs.args)
    return {m.key: described(m, inputs) for m in rows}


def compute(model, args, st, groups, meta):
    """Every metric: group by group of calibration windows (one recording pass for what a group's metrics need),
    then those that read no windows -> {JSON key: object}."""
    out, timings = {}, meta["timings_s"]
    for (N, T), (names, batches, _) in groups.items():
        t0 = time.time()
        rows = [m for m in METRICS if m.name in names]
        out.update(run_group(rows, Inputs(model, args, st, device=meta["device"], batches=batches)))
        timings[f"{N}x{T}"] = round(time.time() - t0, 2)
    for m in METRICS:
        if m.name in st.todo and not m.protocol:
            t0 = time.time()
            out[m.key] = described(m, Inputs(model, args, st, device=meta["device"]))
            timings[m.name] = round(time.time() - t0, 2)
    return out


def main(argv=None):
    args, st = parse_args(argv)
    t_start = time.time()
    try:
        model, groups, meta, device, precision = setup(args, st)
        cfg = model.cfg
        plan = "; ".join(f"{', '.join(sorted(ms))}: {N} x {T}" for (N, T), (ms, _, _) in groups.items())
        print(f"diagnose: {cfg.residual} L={cfg.n_layer} d={cfg.d_model} on {device} ({meta['threads'] or 'GPU'} "
              f"threads), {meta['dtype']}, windows x tokens: {plan or 'none'}; "
              f"metrics: {', '.join(m for m in BY_NAME if m in st.todo)}")
        with precision:
            out = {"schema": SCHEMA, "meta": meta, **compute(model, args, st, groups=groups, meta=meta)}
    except (DiagError, CheckpointError, data.DataError) as e:
        fail("diagnose.py", first_line(e, None))
    meta["wall_s"] = round(time.time() - t_start, 2)
    path = st.out or (Path(meta["checkpoint"]).parent / "diagnose.json" if meta["checkpoint"] else "diagnose.json")
    try:
        write_json(path, out, strict=True)
    except OSError as e:  # a common.WriteError, one line naming the path and the cause (a file in the way, full)
        fail("diagnose.py", str(e))
    print(f"wrote {path} in {meta['wall_s']}s")


if __name__ == "__main__":
    with common.one_line_faults("diagnose.py", "nothing was written; run the same command again"):  # Ctrl-C: one line
        main()
