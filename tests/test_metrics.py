"""
Every diagnostic of docs/diagnostics.md against a value known in closed form (issue 44): constructed depth states,
distributions, transports and token matrices fed through diagnose.py's own pipeline (its recording pass and metric
functions, with `diagnose.recording` scripted to return them), and constructed models (a block that writes nothing,
a bigram model whose log-likelihoods are a table, a constant input). A metric computed in radians, a swapped KL, an
off-by-one layer index or a reversed product fails here.

    python -m pytest -q tests/test_metrics.py

CPU only, tiny models; each test well under 20 s on 2 cores.
"""
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import diagnose as dg
import ops
from data import ByteTokenizer
from depthbench.evaluation import nll, observe
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository root
ARGS = SimpleNamespace(causal_threshold=0.45, perm_threshold=0.15, dead_tau=0.05, eps=1e-8)
LOG2 = math.log(2)


def build(residual="preln", L=3, V=32, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, n_layer=L, d_model=32, n_head=2, d_ff=96, residual=residual)).eval()


def run(model, names, batches):
    """{metric name: its JSON object}, as diagnose.py computes one group of metrics on these batches."""
    rows = [dg.BY_NAME[m] for m in names]
    out = dg.run_group(rows, dg.Inputs(model, ARGS, None, device="cpu", batches=batches))
    return {m.name: out[m.key] for m in rows}


def scripted(monkeypatch, forwards):
    """diagnose.recording returns forwards[skip] = (logits, states, readouts, internals) for skip = None, 0, 1, ...;
    a list of such dicts: one per batch, in order."""
    per_batch = iter(forwards if isinstance(forwards, list) else [])

    def recording(model, x, skip=None):
        if skip is None and isinstance(forwards, list):
            recording.now = next(per_batch)
        logits, states, readouts, internals = (recording.now if isinstance(forwards, list) else forwards)[skip]
        return logits, observe.Record(logits=logits, states=states, readouts=readouts, internals=internals)
    monkeypatch.setattr(dg, "recording", recording)


def tokens(B, T, V=32):
    x = torch.zeros(B, T, dtype=torch.long)
    return x, torch.zeros(B, T, dtype=torch.long)


def grid(rows, **tol):
    """Nested lists (None where a metric leaves a cell empty) as one flat approx: shapes and empty cells must match."""
    flat = [math.nan if v is None else v for r in rows for v in (r if isinstance(r, list) else [r])]
    return pytest.approx(flat, nan_ok=True, **tol)


def flat(rows):
    return [math.nan if v is None else v for r in rows for v in (r if isinstance(r, list) else [r])]


def states_of(*rows):
    """Depth states (1, T, D) from per-state lists of T token vectors."""
    return [torch.tensor(r, dtype=torch.float32)[None] for r in rows]


# ----------------------------------------------------------------------------- angular distance

def test_angular_distance_is_the_mean_angle_over_pi(monkeypatch):
    """Two tokens, four states. Token A: e1, e2, e2, -e2 (orthogonal 0.5, identical 0, opposite 1); token B is the
    embedding e1 throughout but 10 e2 at state 1. d = the mean over tokens of angle / pi, so d(0, 1) = (0.5 + 0.5) /
    2, d(1, 2) = (0 + 0.5) / 2, d(2, 3) = (1 + 0.5) / 2, ...; subsequent[n-1][l] = d(l, l + n)."""
    e1, e2 = [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]
    m2 = [0.0, -1.0, 0.0]
    states = states_of([e1, e1], [e2, [0.0, 10.0, 0.0]], [e2, e1], [m2, e1])
    scripted(monkeypatch, {None: (torch.zeros(1, 2, 32), states, states, {})})
    got = run(build(L=3), ["angular"], [tokens(1, 2)])["angular"]
    # token A and token B, state by state: the angles in units of pi
    a = {(0, 1): 0.5, (0, 2): 0.5, (0, 3): 0.5, (1, 2): 0.0, (1, 3): 1.0, (2, 3): 1.0}
    b = {(0, 1): 0.5, (0, 2): 0.0, (0, 3): 0.0, (1, 2): 0.5, (1, 3): 0.5, (2, 3): 0.0}
    want = [[(a[i, j] + b[i, j]) / 2 if j > i else None for j in range(4)] for i in range(4)]
    assert flat(got["matrix"]) == grid(want, abs=1e-7)
    assert flat(got["subsequent"]) == grid([[want[0][1], want[1][2], want[2][3]],
                                            [want[0][2], want[1][3], None],
                                            [want[0][3], None, None]], abs=1e-7)


def test_angular_distance_of_a_real_model_ends_where_its_head_reads():
    """A Pre-LN model whose blocks write nothing (W_o = W_2 = 0): every depth state is the embedding, so every d is 0;
    one block writing again moves exactly the distances that span it."""
    model = build(L=3)
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wo.weight.zero_()
            b.mlp.w2.weight.zero_()
    batches = [(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1)), torch.zeros(2, 8).long())]
    D = run(model, ["angular"], batches)["angular"]["matrix"]
    assert all(D[i][j] == pytest.approx(0.0, abs=1e-6) for i in range(4) for j in range(i + 1, 4))
    torch.manual_seed(2)
    with torch.no_grad():
        model.blocks[1].mlp.w2.weight.normal_(0, 1.0)
    D = run(model, ["angular"], batches)["angular"]["matrix"]
    spans = {(i, j): i <= 1 < j for i in range(4) for j in range(i + 1, 4)}  # pairs (i, j) with block 1 between
    assert all((D[i][j] > 1e-3) == s for (i, j), s in spans.items()), D


# ----------------------------------------------------------------------------- causal score

def test_causal_score_by_hand(monkeypatch):
    """L = 3, two tokens, 2-d states. Token A: updates u = (1,0), (0,2), (3,0); skipping block 0 makes u_1 = (0,1) and
    leaves u_2; skipping block 1 makes u_2 = (0,3). Token B: u = (1,0), (0,1), (1,0), skips change nothing.
    C(s, l) = mean over tokens of |du_l| / |u_l|: C(0,1) = (0.5 + 0) / 2, C(0,2) = 0, C(1,2) = (sqrt(18)/3 + 0) / 2.
    The ratio of means is mean |du| / mean |u|: C(0,1) -> (1/2) / (3/2). R_causal counts pairs s >= ceil(3/4) = 1: only
    (1, 2), which is above 0.45."""
    def walk(z0, us):                  # the updates at a tenth: the scores are ratios, mean |u| per token < 1
        out = [z0]
        for u in us:
            out.append([a + 0.1 * b for a, b in zip(out[-1], u)])
        return out
    a_base, b_base = walk([0, 0], [(1, 0), (0, 2), (3, 0)]), walk([5, 5], [(1, 0), (0, 1), (1, 0)])
    a_skip = {0: walk([0, 0], [(0, 0), (0, 1), (3, 0)]), 1: walk([0, 0], [(1, 0), (0, 0), (0, 3)]),
              2: walk([0, 0], [(1, 0), (0, 2), (0, 0)])}
    b_skip = {s: walk([5, 5], [(0, 0) if k == s else u for k, u in enumerate([(1, 0), (0, 1), (1, 0)])])
              for s in range(3)}
    forwards = {None: (torch.zeros(1, 2, 32), states_of(*zip(a_base, b_base)), [], {})}
    forwards.update({s: (torch.zeros(1, 2, 32), states_of(*zip(a_skip[s], b_skip[s])), [], {}) for s in range(3)})
    scripted(monkeypatch, forwards)
    got = run(build(L=3), ["causal"], [tokens(1, 2)])["causal"]
    c12 = math.sqrt(18) / 3
    assert flat(got["matrix"]) == grid([[None, 0.25, 0.0], [None, None, c12 / 2], [None, None, None]])
    rom = [[None, (1 / 2) / (3 / 2), 0.0], [None, None, (math.sqrt(18) / 2) / (4 / 2)], [None, None, None]]
    assert flat(got["matrix_ratio_of_means"]) == grid(rom, rel=1e-6)
    assert (got["s_min"], got["n_pairs"], got["n_above"], got["R_causal"]) == (1, 1, 1, 1.0)


@pytest.mark.parametrize("L, s_min, n_pairs", [(2, 1, 0), (5, 2, 3), (8, 2, 15)])
def test_causal_and_permutation_count_the_last_three_quarters(L, s_min, n_pairs):
    """R_causal and R_perm count the pairs s_min <= a < b <= L-1 with s_min = ceil(L/4) (L5: 2, not ceil(5/5) = 1);
    two blocks are enough for the causal matrix (its one pair (0, 1) lies outside the last three quarters)."""
    got = run(build(L=L), ["causal"], [tokens(1, 4)])["causal"]
    assert (got["s_min"], got["n_pairs"]) == (s_min, n_pairs) and len(got["matrix"]) == L
    P = [[None] * L for _ in range(L)]
    shares = dg.perm_shares(P, 0.15, L)
    assert (shares["s_min"], shares["n_pairs"]) == (s_min, n_pairs)


def test_a_block_that_writes_nothing_has_no_causal_effect_and_prunes_for_free():
    """Block 1 of 4 with W_o = W_2 = 0: removing it changes no later update (row 1 of C is 0), its own update is 0
    (column 1 is 0), and skipping it costs nothing; the other blocks matter."""
    model = build(L=4)
    with torch.no_grad():
        model.blocks[1].attn.wo.weight.zero_()
        model.blocks[1].mlp.w2.weight.zero_()
    x = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    out = run(model, ["causal", "pruning"], [(x, torch.roll(x, -1, 1))])
    C, deltas = out["causal"]["matrix"], [r["delta"] for r in out["pruning"]["layers"]]
    assert C[1][2] == C[1][3] == 0.0 and C[0][1] == 0.0
    assert C[0][2] > 0 and C[0][3] > 0 and C[2][3] > 0
    assert deltas[1] == 0.0 and all(deltas[b] != 0.0 for b in (0, 2, 3))


# ----------------------------------------------------------------------------- permutation score

def test_permutation_score_equals_the_loss_of_the_model_swapped_by_hand():
    """Pre-LN L3: blocks 0 and 2 swapped by renaming the state dict (each block's weights and its two pre-norm gains,
    written out here) give loss L'; P(0, 2) = |L' - L| / L at [0][2], and the other pairs likewise."""
    model = build(L=3)
    with torch.no_grad():
        for p in model.res.norms.parameters():
            p.add_(torch.randn_like(p) * 0.3)                          # distinct norm gains: their swap shows
    x = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)

    def loss(m):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(m(x)[0].flatten(0, 1), y.flatten(), reduction="sum").item()

    def swapped(i, j):
        names = {f"blocks.{i}.": f"blocks.{j}.", f"blocks.{j}.": f"blocks.{i}.",
                 f"res.norms.{2 * i}.": f"res.norms.{2 * j}.", f"res.norms.{2 * j}.": f"res.norms.{2 * i}.",
                 f"res.norms.{2 * i + 1}.": f"res.norms.{2 * j + 1}.", f"res.norms.{2 * j + 1}.": f"res.norms.{2 * i + 1}."}
        state = {}
        for k, v in model.state_dict().items():
            prefix = next((p for p in names if k.startswith(p)), None)
            state[names[prefix] + k[len(prefix):] if prefix else k] = v
        other = build(L=3)
        other.load_state_dict(state)
        return other
    base = loss(model)
    got = run(model, ["perm"], [(x, y)])["perm"]
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert got["matrix"][i][j] == pytest.approx(abs(loss(swapped(i, j)) - base) / base, rel=1e-5)
        assert got["matrix"][j][i] is None
    assert got["baseline_loss"] == pytest.approx(base / x.numel(), rel=1e-6)


# ----------------------------------------------------------------------------- logit lens

def lens_case(monkeypatch):
    """V = d = 32 and W_out = I, so a readout is its logits. The final distribution is (1/2, 1/2) on tokens 0 and 1,
    state 1 reads (1/4, 3/4), state 0 the uniform distribution; the rest of the vocabulary gets no mass (-1e4), in an
    order that puts tokens 29-31 in the final top 5 and tokens 2-4 in state 1's. The target is token 1."""
    model = build(L=2)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(32))
    tail = torch.arange(2, 32, dtype=torch.float32)
    final = torch.cat([torch.log(torch.tensor([0.5, 0.5])), -1e4 + tail])
    state1 = torch.cat([torch.log(torch.tensor([0.25, 0.75])), -1e4 - tail])
    readouts = [torch.zeros(1, 1, 32), state1[None, None], final[None, None]]
    scripted(monkeypatch, {None: (final[None, None], [torch.zeros(1, 1, 4)] * 3, readouts, {})})
    return model, [(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))]


def test_logit_lens_ce_kl_direction_and_top5_overlap(monkeypatch):
    """State 1: CE = -log 3/4; KL(p_final || p_1) = 1/2 log 2 + 1/2 log 2/3 (0.1438; the other direction would be
    0.1308); top-5 overlap {0, 1} of 5 = 0.4. State 0, uniform over 32: CE = log 32, KL(p_final || u) = log 32 - the
    final's entropy log 2. The last state is the final itself: KL 0, overlap 1, CE = the model's loss log 2."""
    model, batches = lens_case(monkeypatch)
    got = run(model, ["lens"], batches)["lens"]
    s0, s1, s2 = got["states"]
    assert [s["index"] for s in got["states"]] == [0, 1, 2]
    assert s1["early_exit_ce"] == pytest.approx(-math.log(0.75), abs=1e-6)
    assert s1["kl_to_final"] == pytest.approx(0.5 * LOG2 + 0.5 * math.log(2 / 3), abs=1e-6)
    assert s1["top5_overlap"] == pytest.approx(0.4)
    assert s0["early_exit_ce"] == pytest.approx(math.log(32), abs=1e-5)
    assert s0["kl_to_final"] == pytest.approx(math.log(32) - LOG2, abs=1e-5)
    assert (s2["kl_to_final"], s2["top5_overlap"]) == (pytest.approx(0.0, abs=1e-7), 1.0)
    assert got["final_loss"] == pytest.approx(LOG2, abs=1e-6) == s2["early_exit_ce"]


# ----------------------------------------------------------------------------- layer pruning

def test_layer_pruning_by_hand(monkeypatch):
    """Baseline p(target) = 1/2; without block 0 the model is uniform over 32 tokens, without block 1 unchanged,
    without block 2 p(target) = 1/4: delta = (log 32 - log 2, 0, log 4 - log 2)."""
    def logits(p):
        return torch.log(torch.tensor([p] + [(1 - p) / 31] * 31))[None, None]
    states = [torch.zeros(1, 1, 4)] * 4
    scripted(monkeypatch, {None: (logits(0.5), states, [], {}), 0: (logits(1 / 32), states, [], {}),
                           1: (logits(0.5), states, [], {}), 2: (logits(0.25), states, [], {})})
    got = run(build(L=3), ["pruning"], [(torch.zeros(1, 1).long(), torch.zeros(1, 1).long())])["pruning"]
    assert got["baseline_loss"] == pytest.approx(LOG2, abs=1e-6)
    assert [r["layer"] for r in got["layers"]] == [0, 1, 2]
    assert [r["delta"] for r in got["layers"]] == pytest.approx([math.log(16), 0.0, LOG2], abs=1e-5)


# ----------------------------------------------------------------------------- AttnRes weights and the dead zone

def test_attnres_weights_and_dead_zone_of_set_weights(monkeypatch):
    """Full AttnRes L2 with its depth softmax set per consumer (1..4, consumer 4 the head) and per batch: the JSON
    holds the token-weighted mean (batch 1: 2 tokens, batch 2: 6), consumer 0 reads the embedding only, the block
    view sums a block's two sources, and the dead zone is 1 - the embedding's weight, dead below 0.05."""
    w1 = [[0.2, 0.8], [0.99, 0.005, 0.005], [0.5, 0.1, 0.2, 0.2], [0.1, 0.2, 0.3, 0.2, 0.2]]
    w2 = [[0.6, 0.4], [0.95, 0.025, 0.025], [0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]]

    def forward(B, T, w):
        return {None: (torch.zeros(B, T, 32), [torch.zeros(B, T, 4)] * 3, [],
                       {"attnres_weights": [torch.tensor(r) for r in w]})}
    scripted(monkeypatch, [forward(1, 2, w1), forward(2, 3, w2)])
    model, batches = build("attnres", L=2), [tokens(1, 2), tokens(2, 3)]
    got = run(model, ["attnres", "deadzone"], batches)
    mean = [[(2 * a + 6 * b) / 8 for a, b in zip(r1, r2)] for r1, r2 in zip(w1, w2)]
    rows = [[1.0, None, None, None, None]] + [r + [None] * (5 - len(r)) for r in mean]
    assert flat(got["attnres"]["sublayer"]) == grid(rows)
    assert got["attnres"]["n_groups"] == 4
    # blocks: consumer 0 (block 0's attention), consumer 2 (block 1's attention), the head; sources e, block 0, block 1
    block = [[1.0, None, None], [mean[1][0], mean[1][1] + mean[1][2], None],
             [mean[3][0], mean[3][1] + mean[3][2], mean[3][3] + mean[3][4]]]
    assert flat(got["attnres"]["block"]) == grid(block)
    dz = got["deadzone"]
    assert dz["schedule"] == pytest.approx([0.0, 1 - mean[0][0], 1 - mean[1][0], 1 - mean[2][0]])
    assert dz["dead"] == [True, False, True, False] and dz["count_blocks"] == 0   # 1 - 0.96 = 0.04 < 0.05
    assert dz["head"] == pytest.approx(0.9)


def test_dense_weights_of_denseformer_are_its_set_weights():
    """DenseFormer L3 with its static weights set by hand: Figure 7's matrix is those weights whatever the tokens
    (consumer c = block c's input reads a_(c-1) over the embedding and blocks 0..c-1, the head a_2), consumer 0 reads
    the embedding alone, the unseen sources are empty, and a row is not renormalised (a_1 sums to 0.9)."""
    set_weights = [[0.3, 0.7], [0.1, 0.2, 0.6], [0.4, -0.2, 0.5, 0.3]]
    model = build("denseformer", L=3)
    with torch.no_grad():
        for a, w in zip(model.res.dwa, set_weights):
            a.copy_(torch.tensor(w))
    batches = [tokens(1, 4), (torch.arange(6).view(2, 3), torch.zeros(2, 3, dtype=torch.long))]
    got = run(model, ["dense"], batches)["dense"]
    assert got["streams"] == ["mix"] and got["n_sources"] == 4 and got["first_block"] == 0
    rows = [[1.0, None, None, None]] + [w + [None] * (4 - len(w)) for w in set_weights]
    assert flat(got["weights"]["mix"]) == grid(rows, abs=1e-6)


def test_dense_weights_of_mudd_are_the_token_mean_of_its_weights():
    """MUDD L3 with w2 = 0, so that every token's weights are the bias: Figure 7's matrices are the biases, one per
    stream (Q, K, V, R) for blocks 1 and 2, and the head's row, the residual stream's alone, is the last block's."""
    model = build("mudd", L=3)
    biases = []
    with torch.no_grad():
        for b, m in enumerate(model.res.dense):
            m.w2.zero_()
            m.bias.copy_(torch.arange(m.bias.numel(), dtype=torch.float32).view(m.bias.shape) / 10 + b)
            biases.append(m.bias.tolist())
    got = run(model, ["dense"], [tokens(2, 3)])["dense"]
    assert got["streams"] == ["Q", "K", "V", "R"] and got["n_sources"] == 4
    for c, name in enumerate(got["streams"]):
        head = biases[2][0] if name == "R" else None
        rows = [[1.0], biases[0][c], biases[1][c], head]
        rows = [None if r is None else r + [None] * (4 - len(r)) for r in rows]
        assert flat(got["weights"][name]) == grid(rows, abs=1e-6), name


def test_dead_zone_counts_blocks_whose_two_sublayers_are_dead():
    """L3, tau 1/8: sublayers 2, 3 and 5 put less than tau beyond the embedding (sublayer 4 exactly tau: not below,
    so alive), so block 1 (sublayers 2, 3) is the one dead block; block 2 has one dead sublayer, and dead sublayers of two
    neighbouring blocks (3 and 5 around 4) make no block.
    The weights are binary fractions, exact in floating point."""
    beyond = [0.5, 0.25, 0.0, 0.09375, 0.125, 0.03125]
    weights = [[1.0 - b, b] for b in beyond] + [[0.25, 0.75]]               # consumers 0..5, then the head
    got = ops.dead_zone(weights, 3, 0.125)
    assert got["dead"] == [False, False, True, True, False, True]
    assert (got["count_sublayers"], got["count_blocks"]) == (3, 1) and got["head"] == pytest.approx(0.75)


def test_attnres_weights_of_zero_queries_are_uniform():
    """Full AttnRes with its pseudo-queries at zero (their init): every consumer weighs its visible sources equally,
    consumer c (1..2L) on c + 1 sources; the block view's row b sums pairs: 1/(2b+1) for the embedding, 2/(2b+1) per
    earlier block."""
    model = build("attnres", L=3)
    assert float(model.res.queries.detach().abs().max()) == 0.0
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    got = run(model, ["attnres"], [(x, x)])["attnres"]
    for c, row in enumerate(got["sublayer"]):
        assert row == pytest.approx([1 / (c + 1)] * (c + 1) + [None] * (6 - c))
    for b, row in enumerate(got["block"][:3]):
        assert row == pytest.approx([1 / (2 * b + 1)] + [2 / (2 * b + 1)] * b + [None] * (3 - b))


# ----------------------------------------------------------------------------- transport erank

def test_transport_erank_of_a_known_product(monkeypatch):
    """Connectors M0 = diag(2, 1, 1, 0), M1 = the cyclic shift e_k -> e_(k+1), M2 = diag(0, 1, 1, 0). erank uses
    p = sigma / sum sigma: M0 -> 2^1.5, the shift 4, M2 2; with p = sigma^2 / sum sigma^2, M0 -> 2.3811. The running
    product M2 M1 M0 = 2 e2 e1^T + e3 e2^T (sigma 2, 1: 1.8899); the reversed order M0 M1 M2 has rank 1."""
    shift = torch.roll(torch.eye(4), 1, 0)                 # column k holds e_(k+1): [out, in]
    Ms = [torch.diag(torch.tensor([2.0, 1, 1, 0])), shift, torch.diag(torch.tensor([0.0, 1, 1, 0]))]
    scripted(monkeypatch, {None: (torch.zeros(1, 3, 32), [torch.zeros(1, 3, 4)] * 3, [], {"H_res": Ms})})
    got = run(build("hc", L=1), ["erank"], [tokens(1, 3)])["erank"]
    h = lambda p: math.exp(-sum(v * math.log(v) for v in p))  # noqa: E731
    assert got["per_connector"] == pytest.approx([2 ** 1.5, 4.0, 2.0])
    assert got["mean"] == pytest.approx((2 ** 1.5 + 6) / 3)
    assert got["product"] == pytest.approx([2 ** 1.5, 2 ** 1.5, h([2 / 3, 1 / 3])])
    assert got["per_connector_sq"] == pytest.approx([h([4 / 6, 1 / 6, 1 / 6]), 4.0, 2.0])
    assert got["n_streams"] == 4 and got["matrices"][1] == shift.tolist()
    assert ops.erank(Ms[0] @ shift @ Ms[2]) == pytest.approx(1.0)          # the order matters


# ----------------------------------------------------------------------------- token collapse

def test_token_matrix_metrics_known_answers():
    """A rank-1 matrix: 1, 1, 1. Orthogonal rows of equal norm (T = 4 < D = 8): 4, 4 and sqrt(4) = 2. Orthogonal rows
    of norms 2, 1, 1, 1: stable rank 7/4, erank exp(H(4/7, 1/7, 1/7, 1/7)), L1/L2 5/sqrt(7). Zeros: 1, 1, 1."""
    u, v = torch.arange(1.0, 5.0), torch.linspace(-1, 2, 8)
    eye = torch.eye(8)[:4]
    unequal = eye * torch.tensor([2.0, 1, 1, 1])[:, None]
    h = -(4 / 7 * math.log(4 / 7) + 3 / 7 * math.log(1 / 7))
    want = [[1, 1, 1], [4, 4, 2], [7 / 4, math.exp(h), 5 / math.sqrt(7)], [1, 1, 1]]
    for scale in (1.0, 1e-3):          # scale-free: only a matrix of (near) zeros, sum s^2 < 1e-12, is special
        got = dg.token_matrix_metrics(scale * torch.stack([torch.outer(u, v), eye, unequal, torch.zeros(4, 8)]))
        assert flat(got.tolist()) == grid(want, rel=1e-6), scale


def test_token_collapse_per_state_and_mean_over_windows(monkeypatch):
    """Two windows, three depth states: state 0 rank 1 in both; state 1 orthogonal in window 1, rank 1 in window 2
    (means (4 + 1) / 2, ...); state 2 orthogonal with unequal norms in both. The JSON lists follow the states."""
    u, v = torch.arange(1.0, 5.0), torch.linspace(-1, 2, 8)
    rank1, eye = torch.outer(u, v), torch.eye(8)[:4]
    unequal = eye * torch.tensor([2.0, 1, 1, 1])[:, None]
    states = [torch.stack([rank1, 3 * rank1]), torch.stack([eye, rank1]), torch.stack([unequal, unequal])]
    scripted(monkeypatch, {None: (torch.zeros(2, 4, 32), states, [], {})})
    got = run(build(L=2), ["collapse"], [tokens(2, 4)])["collapse"]
    h = math.exp(-(4 / 7 * math.log(4 / 7) + 3 / 7 * math.log(1 / 7)))
    assert got["num_windows"] == 2
    assert got["stable_rank"] == pytest.approx([1.0, 2.5, 7 / 4], rel=1e-6)
    assert got["erank"] == pytest.approx([1.0, 2.5, h], rel=1e-6)
    assert got["l1_l2_ratio"] == pytest.approx([1.0, 1.5, 5 / math.sqrt(7)], rel=1e-6)


def test_token_collapse_of_a_constant_input_is_rank_one():
    """Every position the same token: causal attention mixes identical values, so every depth state's token matrix
    has identical rows (rank 1), whatever the weights: all three metrics 1 at every state."""
    got = run(build(L=3), ["collapse"], [(torch.full((2, 16), 7), torch.zeros(2, 16).long())])["collapse"]
    for key in ("stable_rank", "erank", "l1_l2_ratio"):
        assert got[key] == pytest.approx([1.0] * 4, abs=1e-4), key


# ----------------------------------------------------------------------------- NLL and zero-shot on a bigram model

def bigram_model(seed=0, L=2):
    """Pre-LN on bytes (V = 257) whose blocks write nothing (W_o = W_2 = 0): the head reads the current token's
    embedding, so log p(next | context) = TABLE[current, next], a bigram table (embedding and head at std 1)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=257, n_layer=L, d_model=32, n_head=2, d_ff=96)).eval()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wo.weight.zero_()
            b.mlp.w2.weight.zero_()
        model.wte.weight.normal_(0, 1)
        model.lm_head.weight.normal_(0, 1)
    return model


def bigram_table(model):
    """[current, next] log-probabilities, from the weights: RMSNorm (eps 1e-6, the final gain), then W_out."""
    e = model.wte.weight.detach().double()
    h = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6) * model.res.norm_f.weight.detach().double()
    return (h @ model.lm_head.weight.detach().double().T).log_softmax(-1)


def bigram_ll(table, ids, start):
    """sum of log p(ids[k] | ids[k-1]) for k >= start."""
    return sum(float(table[ids[k - 1], ids[k]]) for k in range(start, len(ids)))


def test_nll_of_a_bigram_model_by_hand():
    """Every task's nll_sum is the bigram table summed over its answer bytes (the prompt's trailing whitespace moved
    to the answer), each scored from the byte before it; categories and the aggregate pool the sums."""
    model, tok = bigram_model(), ByteTokenizer()
    table = bigram_table(model)
    out = nll.evaluate(model, tok, list(nll.TASKS), nll_data=ROOT / "fixtures" / "nll", max_len=4096, batch_size=3)
    for task in nll.TASKS:
        want, count = 0.0, 0
        for row in nll.nll_rows(task, ROOT / "fixtures" / "nll", None):
            prompt, target = nll.nll_pair(task, row)
            cut = len(prompt) - len(prompt.rstrip())
            ids = list((prompt + target).encode())
            start = len(prompt[:len(prompt) - cut].encode())
            want -= bigram_ll(table, ids, start)
            count += len(ids) - start
        got = out["tasks"][task]
        assert (got["nll_sum"], got["num_target_tokens"]) == (pytest.approx(want, rel=1e-5), count), task
        assert got["nll_mean"] == pytest.approx(want / count, rel=1e-5)
    math_sum = out["tasks"]["gsm8k"]["nll_sum"] + out["tasks"]["math500"]["nll_sum"]
    assert out["categories"]["math"]["nll_sum"] == pytest.approx(math_sum)


def test_the_nll_metric_passes_its_options_through():
    """diagnose.py's nll row: the run's tokenizer, tasks and max_len, the command line's data folder, item limit and
    batch size reach nll.evaluate (two items a task, three tasks, a context of 48 bytes); a run without text skips."""
    model, tok = bigram_model(), ByteTokenizer()
    tasks = list(nll.TASKS)[:3]
    st = SimpleNamespace(text_skip=None, tok_name="bytes", nll_tasks=tasks, max_len=48)
    args = SimpleNamespace(nll_data=ROOT / "fixtures" / "nll", nll_limit=2, batch_size=3)
    got = dg.nll(dg.Inputs(model, args, st, device="cpu", batches=[]))
    want = nll.evaluate(model, tok, tasks, nll_data=ROOT / "fixtures" / "nll", limit=2, max_len=48, batch_size=3)
    assert got == want and set(got["tasks"]) == set(tasks)
    full = nll.evaluate(model, tok, tasks, nll_data=ROOT / "fixtures" / "nll", max_len=4096, batch_size=3)
    assert got["tasks"][tasks[0]]["num_target_tokens"] < full["tasks"][tasks[0]]["num_target_tokens"]
    skipped = dg.nll(dg.Inputs(model, args, SimpleNamespace(text_skip="no text"), device="cpu", batches=[]))
    assert skipped == {"skipped": "no text"}


def hellaswag_text(text):
    """lm-eval's HellaSwag clean-up, as its task's utils describe it: strip, ' [title]' -> '. ', drop [bracketed]
    markup, then double spaces -> one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def layout(task, doc):
    """(contexts, continuations, gold, choices): each task's prompt and answer choices written from lm-eval's task
    definitions; one context for all choices, except WinoGrande (partial evaluation: a context per option, the rest
    of the sentence is the one continuation). acc_norm divides by len(choice)."""
    if task == "winogrande":
        cut = doc["sentence"].index("_")
        options = [doc["sentence"][:cut] + o for o in (doc["option1"], doc["option2"])]
        rest = " " + doc["sentence"][cut + 1:].strip()
        return options, [rest, rest], int(doc["answer"]) - 1, options
    if task == "hellaswag":
        ctx = hellaswag_text(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
        choices, gold = [hellaswag_text(e) for e in doc["endings"]], int(doc["label"])
    elif task == "openbookqa":
        ctx, choices = doc["question_stem"], doc["choices"]["text"]
        gold = doc["choices"]["label"].index(doc["answerKey"].lstrip())
    elif task in ("arc_easy", "arc_challenge"):
        ctx, choices = f"Question: {doc['question']}\nAnswer:", doc["choices"]["text"]
        gold = doc["choices"]["label"].index(doc["answerKey"])
    elif task == "social_iqa":
        ctx, choices = f"Q: {doc['context']} {doc['question']}\nA:", [doc[f"answer{k}"] for k in "ABC"]
        gold = int(doc["label"]) - 1
    else:  # piqa
        ctx, choices, gold = f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], doc["label"]
    return [ctx] * len(choices), [" " + c for c in choices], gold, choices


def hand_scores(table, task, docs):
    """(acc, acc_norm, per-document lls) by hand from the bigram table."""
    hits, hits_norm, lls = 0, 0, []
    for doc in docs:
        contexts, continuations, gold, choices = layout(task, doc)
        ll = [bigram_ll(table, list((c + t).encode()), len(c.encode())) for c, t in zip(contexts, continuations)]
        norm = [v / len(c) for v, c in zip(ll, choices)]
        hits += max(range(len(ll)), key=lambda k: (ll[k], -k)) == gold
        hits_norm += max(range(len(ll)), key=lambda k: (norm[k], -k)) == gold
        lls.append(ll)
    return hits / len(docs), hits_norm / len(docs), lls


def test_zeroshot_accuracy_is_lm_evals_on_every_task_layout():
    """The bigram model through lm-eval on the seven fixture tasks (five items each): every request's log-likelihood
    is the table's sum over the continuation, and acc / acc_norm are what those give by hand for each task's layout
    (lm-eval's prompts, choices and gold written out in `layout`); WinoGrande and SIQA report acc only."""
    pytest.importorskip("lm_eval")
    from depthbench.evaluation import zeroshot as zs
    model = bigram_model(seed=1)
    table = bigram_table(model)
    lm = zs.harness_model(model, ByteTokenizer(), max_len=512, batch_size=3)
    out = zs.evaluate(lm, list(zs.TASKS), data_dir=ROOT / "fixtures" / "zeroshot", samples=True)
    accs = []
    for task in zs.TASKS:
        docs = [json.loads(line) for line in (ROOT / "fixtures" / "zeroshot" / f"{task}.jsonl").read_text().splitlines()]
        acc, acc_norm, lls = hand_scores(table, task, docs)
        got = out[task]
        assert got["num_examples"] == 5 and got["num_fewshot"] == 0
        assert got["acc"] == pytest.approx(acc), task
        assert ("acc_norm" in got) == (task not in ("winogrande", "social_iqa")), task
        assert got.get("acc_norm", acc_norm) == pytest.approx(acc_norm), task
        for sample in got["samples"]:
            resps = [r[0][0] for r in sample["resps"]]
            assert resps == pytest.approx(lls[sample["doc_id"]], abs=1e-4), (task, sample["doc_id"])
        accs.append((acc, acc_norm))
    assert len(set(accs)) > 2   # the table tells the items apart: not one accuracy everywhere


def test_zeroshot_model_scores_batched_rolling_and_refuses_generation():
    """score: batches of 3 equal one at a time; loglikelihood_rolling of a 40-byte text in windows of 8 tokens is the
    bigram sum over every byte once, the first from the end-of-text id; generate_until is one line, refused."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from depthbench.evaluation import zeroshot as zs
    model, tok = bigram_model(seed=2), ByteTokenizer()
    table = bigram_table(model)
    pairs = [(list(b"ab"), list(b" cde")), (list(b"x" * 20), list(b"yz")), (list(b"q"), list(b" r"))]
    one = [zs.score(model, [p], max_len=64)[0] for p in pairs]
    assert zs.score(model, pairs, max_len=64, batch_size=3) == [(pytest.approx(a, abs=1e-5), g) for a, g in one]
    lm = zs.harness_model(model, tok, max_len=8, batch_size=4)
    text = "The quick brown fox jumps over the dog."
    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    ids = [tok.eot] + list(text.encode())
    assert lm.loglikelihood_rolling([req])[0] == pytest.approx(bigram_ll(table, ids, 1), abs=1e-4)
    with pytest.raises(NotImplementedError) as e:
        lm.generate_until([req])
    assert len(str(e.value).splitlines()) == 1 and "generate_until" in str(e.value)
