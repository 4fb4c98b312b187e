"""
MoDA's GPU body (depthbench/kernels/triton_moda.py) against ops.py's joint_attention and DepthKV, on CPU tensors
under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before triton's first import; so does this file for
a run outside pytest). Without triton every test skips, saying so. Tiny shapes: the interpreter runs each program's
tile ops in numpy.

    python -m pytest -q tests/test_triton_moda.py
"""
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before any import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

import ops  # noqa: E402
from depthbench.kernels import cpu  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from test_all import assert_step_equal, assert_step_equal_to_bf16, cosine, loss_and_grads  # noqa: E402

pytest.importorskip("triton", reason="triton does not import: `pip install triton` runs these tests")

from depthbench.kernels import triton_attnres as attnres  # noqa: E402
from depthbench.kernels import triton_moda as moda  # noqa: E402

needs_interpreter = pytest.mark.skipif(not attnres.interpreted(), reason="triton was imported without "
                                       "TRITON_INTERPRET=1 in this process (run the tests with pytest from the "
                                       "repository: conftest.py sets it first)")

# name: (batch, query heads, kv heads, tokens, head width, depth slots)
# card_tile, card_tile_gqa: the card's head width (40, padded to 64) and tiles (32 tokens a program at G 1, 16 at
# G 2), the last program partial
CASES = {"gqa": (2, 4, 2, 5, 8, 3), "odd_T": (1, 2, 2, 7, 8, 4), "one_slot": (2, 2, 1, 6, 8, 1),
         "wide_head": (1, 3, 3, 4, 12, 2), "card_tile": (1, 2, 2, 37, 40, 3), "card_tile_gqa": (1, 4, 2, 37, 40, 2)}


def inputs(name, dtype=torch.float32, seed=0):
    """q, k, v and the depth slots [(key, value)] of a case, leaves with gradients."""
    B, H, Hkv, T, hd, n = CASES[name]
    g = torch.Generator().manual_seed(seed)

    def leaf(heads):
        return torch.randn(B, heads, T, hd, generator=g).to(dtype).requires_grad_()
    return leaf(H), leaf(Hkv), leaf(Hkv), [(leaf(Hkv), leaf(Hkv)) for _ in range(n)]


def joint(body, q, k, v, slots):
    """body.joint_attention over the slots pushed, in order, into body.DepthKV."""
    depth = body.DepthKV.start(n_max=len(slots) + 1)
    for key, value in slots:
        depth = depth.push(key, value)
    return depth, *body.joint_attention(q, k, v, depth)


def gradients(o, leaves, seed=5):
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o.dtype)
    return torch.autograd.grad((o.float() * do.float()).sum(), leaves)


@needs_interpreter
@pytest.mark.parametrize("name", CASES)
def test_joint_attention_equals_reference(name):
    """The Triton body's o and depth share, and the gradients of q, k, v and of every slot's key and value, equal
    ops.joint_attention's in fp32 (GQA, odd T, one slot, a head width that is no power of 2); the bank ran the
    kernels (records, and slot passes that paired the slots with equal readers)."""
    q, k, v, slots = inputs(name)
    leaves = [q, k, v] + [t for pair in slots for t in pair]
    depth, o, share = joint(moda, q, k, v, slots)
    _, o_want, share_want = joint(ops, q, k, v, slots)
    torch.testing.assert_close(o, o_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(share, share_want, rtol=1e-5, atol=1e-6)
    assert depth.bank.slots[0].shape[0] == len(slots) + 1 and depth.bank.consumers == [len(slots)]
    for i, (a, b) in enumerate(zip(gradients(o, leaves), gradients(o_want, leaves))):
        assert b.abs().max() > 0, i
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"leaf {i}")
    assert depth.bank.records.count == 1 and not depth.bank.pending


@needs_interpreter
@pytest.mark.parametrize("name", ["gqa", "odd_T"])
def test_joint_attention_in_bf16_is_the_reference_to_bf16(name):
    """bf16 q, k, v and slots (the bank stores bf16, as under autocast on the GPU; fp32 inside the kernels): o and
    every gradient have cosine >= 0.999 with ops.joint_attention's fp32 maths on the same values, o and the
    gradients in the inputs' dtype."""
    q, k, v, slots = inputs(name, dtype=torch.bfloat16)
    leaves = [q, k, v] + [t for pair in slots for t in pair]
    depth, o, _ = joint(moda, q, k, v, slots)
    assert depth.bank.slots[0].dtype == o.dtype == torch.bfloat16
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    _, o_want, _ = joint(ops, *f32[:3], list(zip(f32[3::2], f32[4::2])))
    assert cosine(o, o_want) >= 0.999
    for i, (a, b) in enumerate(zip(gradients(o, leaves), gradients(o_want, f32))):
        assert a.dtype == torch.bfloat16 and cosine(a, b) >= 0.999, i


@needs_interpreter
@pytest.mark.parametrize("reads", [[1, 2, 4], [2, 4, 6], [3, 3, 5], [3, 2, 4]])
def test_consumers_of_several_depths_share_a_bank(reads):
    """Consumers that read different prefixes of one bank, pushes between them (as a model runs them; `reads`: the
    slots each consumer sees, from the state that held that many): the sum of their outputs has every gradient of
    ops.py's, fp32. [2, 4, 6] is MoDA's pattern (every slot pass paired), [1, 2, 4] and [3, 3, 5] mix single and
    paired passes, two consumers read the same slots, and in [3, 2, 4] a consumer of an older state runs after
    later pushes (its record exists before slot 2's pass, which must leave it out)."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, T, hd = 1, 4, 2, 5, 8

    def leaf(heads):
        return torch.randn(B, heads, T, hd, generator=g).requires_grad_()
    slots = [(leaf(Hkv), leaf(Hkv)) for _ in range(max(reads))]
    queries = [(leaf(H), leaf(Hkv), leaf(Hkv)) for _ in reads]
    leaves = [t for pair in slots for t in pair] + [t for qkv in queries for t in qkv]
    total = {}
    for body in (moda, ops):
        states, out = [body.DepthKV.start(n_max=max(reads) + 1)], 0
        for n, qkv in zip(reads, queries):
            while len(states) <= n:
                states.append(states[-1].push(*slots[len(states) - 1]))
            o = body.joint_attention(*qkv, states[n])[0]
            out = out + (o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum()
        total[body] = torch.autograd.grad(out, leaves)
    for i, (a, b) in enumerate(zip(total[moda], total[ops])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"leaf {i}")


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_sequence_half_by_the_fused_kernel_equals_the_plain_maths(heads):
    """The sequence half as the fused kernel runs it (here the CPU's, the CUDA branch's twin: same arguments, the
    joint o and lse into its backward) equals math_forward / math_backward (the T x T logits), GQA expanded: so
    the merge's backward is the sequence keys' part of the joint softmax's gradient whichever kernel gives lse."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, h, 7, 8, generator=g) for h in (H, Hkv, Hkv, H))
    k, v = moda.expand_heads(k, H), moda.expand_heads(v, H)
    o, lse, saved = moda.sequence_forward(q, k, v, 8 ** -0.5)
    o_m, lse_m = moda.math_forward(q, k, v, 8 ** -0.5)
    torch.testing.assert_close(o, o_m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_m, rtol=1e-5, atol=1e-5)
    lse_joint = lse + 0.3                              # as if depth keys took a share: the joint lse is larger
    fused = moda.sequence_backward(do, q, k, v, out=(o, lse_joint), saved=saved)
    plain = moda.math_backward(do, q, k, v, out=(o, lse_joint), scale=8 ** -0.5)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert moda.fold_heads(fused[1], Hkv).shape == (2, Hkv, 7, 8)


class Spy:
    """A kernel's stand-in that notes each launch's grid in `seen`, then launches the kernel."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        self.seen.append(grid)
        return self.kernel[grid]


def tiny_moda(kernels_name, **options):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=64, residual="moda",
                    kernels=kernels_name, **options)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@needs_interpreter
@pytest.mark.parametrize("options", [{}, {"checkpoint_blocks": True}])
def test_model_equals_reference(options, monkeypatch):
    """A tiny MoDA GPT (L3: consumers reading 2 and 4 slots; GQA 4 heads on 2; odd T 7) under kernels "triton" has
    the loss and every parameter gradient of kernels "reference", fp32: loss to 1e-6, gradients to 1e-4 relative of
    the largest entry each; also with activation checkpointing (backward recomputes each block and pushes again).
    The Triton body ran, with the launches traffic() counts: one forward and one backward pass per consumer (the
    forward again per recomputed block), one slot pass per pair of slots with equal readers; the push of each of
    the 4 slots a consumer read asked for its gradients (the last attention's slot, read by none, is off the loss's
    graph)."""
    asked, launches = [], {name: [] for name in ("_depth_forward", "_depth_backward", "_slot_backward")}
    slot_gradients = moda.slot_gradients
    monkeypatch.setattr(moda, "slot_gradients", lambda bank, j: asked.append(j) or slot_gradients(bank, j))
    for name, seen in launches.items():
        monkeypatch.setattr(moda, name, Spy(getattr(moda, name), seen))
    recompute = int(options.get("checkpoint_blocks", False))
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("triton", "reference"):
        out[name] = loss_and_grads(tiny_moda(name, **options), x)
    assert sorted(asked) == [0, 1, 2, 3]
    assert {name: len(seen) for name, seen in launches.items()} == {"_depth_forward": 2 * (1 + recompute),
                                                                   "_depth_backward": 2, "_slot_backward": 2}
    assert_step_equal(out["triton"], out["reference"])


@needs_interpreter
def test_model_under_bf16_autocast_is_the_reference_to_bf16():
    """Under bf16 autocast (the bank in bf16) the tiny MoDA GPT's loss is the reference's under the same autocast to
    2e-2, and every gradient fp32 and within 10% of its norm (test_all.py's bf16 bounds)."""
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {name: loss_and_grads(tiny_moda(name), x, bf16=True) for name in ("triton", "reference")}
    assert_step_equal_to_bf16(out["triton"], out["reference"])


def test_a_bank_where_no_kernel_runs_is_cpu_pys(monkeypatch):
    """A key on the CPU without the interpreter starts cpu.py's DepthKV, and joint_attention on it is cpu.py's:
    the CPU path does not change."""
    monkeypatch.setattr(attnres, "interpreted", lambda: False)
    q, k, v, slots = inputs("gqa")
    depth, o, share = joint(moda, q, k, v, slots)
    assert type(depth) is cpu.DepthKV
    _, o_want, _ = joint(ops, q, k, v, slots)
    torch.testing.assert_close(o, o_want, rtol=1e-5, atol=1e-5)


def test_the_bf16_flash_calls_bind_and_keep_the_query_layout():
    """The CUDA branch's two aten calls (flash_forward, flash_backward: keyword names as PyTorch 2.11 and 2.13 name
    them), on meta tensors in bf16 with MoDA's query layout (B, T, H, hd) in memory and hd 40 (the card's): they bind,
    and o and dq come back in q's layout (so `like` copies nothing), lse (B, H, T) fp32."""
    q = torch.empty(2, 8, 16, 40, device="meta", dtype=torch.bfloat16).transpose(1, 2)      # (B, H, T, hd) view
    k = torch.empty(2, 16, 8, 40, device="meta", dtype=torch.bfloat16)
    o, lse, saved = moda.flash_forward(q, k, k, scale=40 ** -0.5)
    assert o.stride() == q.stride() and lse.shape == (2, 16, 8) and lse.dtype == torch.float32
    dq, dk, dv = moda.flash_backward(o, q, k, k, out=(o, lse), saved=saved)
    assert dq.stride() == q.stride() and dk.shape == dv.shape == k.shape


def test_traffic_counts_the_notes_slot_reads():
    """traffic's slot reads, forward and backward, summed over MoDA's consumers at L70 d640 B2 T2048 (block b reads
    2b slots' keys and values), are gpu-h200.md's bound exactly: 4 passes over 4,830 slot-sized tensors of 5.2 MB
    in bf16 (101 GB); each pass of a pair of slots reads a consumer's record (q and do) once."""
    tokens, heads, hd = 2 * 2048, 16, 40
    S = tokens * heads * hd
    notes = 4 * sum(2 * b for b in range(70)) * S * 2
    assert round(notes / 1e9) == 101
    base = moda.traffic(0, tokens, heads, heads, hd)
    slots = sum(moda.traffic(2 * b, tokens, heads, heads, hd)[part]["read"] - base[part]["read"]
                for b in range(1, 70) for part in ("forward", "backward"))
    assert slots == notes
    record = 2 * S * 2 + 8 * tokens * heads
    assert moda.traffic(6, tokens, heads, heads, hd)["deferred"]["read"] == 3 * record


COMPILE_FOR_H100 = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from depthbench.kernels import triton_moda as M
from depthbench.kernels import triton_attnres as A
assert not A.interpreted()
INTS = ("n", "slot", "sB", "sH", "sT", "H", "T", "G", "j", "count")
STAGES = inspect.signature(M._depth_forward.fn).parameters["STAGES"].default   # the kernels' default
FP32 = ("o_seq", "lse_seq", "lse_ptr", "share_ptr", "dq_seq", "rec_lse", "rec_delta", "dK", "dV")
def build(fn, storage, consts, warps):
    sig = {}
    for a in fn.arg_names:
        kind = "*i32" if a in ("reads", "rec_reads") else ("*fp32" if a in FP32 else storage)
        sig[a] = "constexpr" if a in consts else ("i32" if a in INTS else ("fp32" if a == "scale" else kind))
    triton.compile(ASTSource(fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
for storage, G in (("*bf16", 1), ("*fp32", 1), ("*bf16", 4)):
    blocks = dict(zip(("BLOCK_T", "BLOCK_G", "BLOCK_D"), M.blocks(2048, G, 40)), hd=40, STAGES=STAGES)
    build(M._depth_forward, storage, blocks, M.WARPS)
    build(M._depth_backward, storage, blocks, M.WARPS)
    for pair in (False, True):
        build(M._slot_backward, storage, {**blocks, "PAIR": pair}, M.WARPS)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100():
    """Every kernel, each variant (bf16 or fp32 storage; the slot pass single or paired), at the card's blocks
    (hd 40 padded to 64, one query head per kv head; and 4, GQA) compiles to an sm90 binary with Triton's own
    compiler and ptxas (no GPU needed): what the interpreter does not check (the GPU's typing of loop-carried
    values, the branches inside loops)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
