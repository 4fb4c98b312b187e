"""
The Triton bodies (depthbench/kernels) against ops.py's reference, on CPU tensors under Triton's interpreter.

    pip install triton      # then: python -m pytest -q tests/test_triton.py

TRITON_INTERPRET=1 must be set before triton is first imported: triton decorates its own library (tl.zeros, ...) and
our kernels for the interpreter only when the flag is set at their import. The repository's conftest.py sets it
before pytest imports any test module (torch.compile's machinery imports triton early), and so does this file, for a
run outside pytest. Without triton every test here skips, saying so. Shapes are tiny: the interpreter runs each
program's tile ops in numpy.

Checked with Triton 3.9 (here) and 3.6 (the GPU image's): under both, `test_kernels_compile_for_an_h100` compiles every
kernel for sm90. Triton 3.6's interpreter fails with numpy 2.4 on any loop with a run-time bound (its `int()` of a
one-element array: "only 0-dimensional arrays can be converted"), in its own code: run these tests with triton >= 3.9.
"""
import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before any import of triton (see the docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

import ops  # noqa: E402
from depthbench.kernels import cpu as kernels  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from test_all import assert_step_equal, assert_step_equal_to_bf16, cosine, loss_and_grads  # noqa: E402

triton = pytest.importorskip("triton", reason="triton does not import: `pip install triton` runs these tests")

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from depthbench import kernels as gpu  # noqa: E402
from depthbench.kernels import triton_attnres as attnres  # noqa: E402
from depthbench.kernels import triton_attnres_chunk as chunked  # noqa: E402
from residuals import Site  # noqa: E402

INTERPRETED = isinstance(triton.language.zeros, InterpretedFunction) and attnres.interpreted()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="triton was imported without TRITON_INTERPRET=1 in this "
                                "process (conftest.py sets it first: run the tests with pytest from the repository)")


def sources(n, T, D=48, B=1, seed=0, dtype=torch.float32):
    """n sources (B, T, D) with different scales (so the key norm matters), and a query and key gain, all leaves."""
    g = torch.Generator().manual_seed(seed)
    vs = [(torch.randn(B, T, D, generator=g) * (0.5 + j % 3)).to(dtype).requires_grad_() for j in range(n)]
    query = (0.3 * torch.randn(D, generator=g)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(D, generator=g)).requires_grad_()
    return vs, query, gain


def triton_mix(vs, query, gain, extra=None):
    """The Triton bank's mix over vs (and extra): (mix, p, the extra passed on)."""
    bank = attnres.DepthBank.start(vs[0], n_max=len(vs) + 1)
    assert isinstance(bank, attnres.DepthBank)                  # the kernels run, not cpu.py's fallback
    for v in vs[1:]:
        bank = bank.push(v)
    return bank.mix(query, gain, 1e-5, extra=extra)


def reference_mix(vs, query, gain, extra=None):
    return ops.DepthBank(vs).mix(query, gain, 1e-5, extra=extra)


def gradients(out, leaves, seed=5):
    """d <out, w> / d leaves for a fixed random w: every leaf's gradient, through a non-uniform output gradient."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out.float() * w).sum(), leaves)


# (bank sources, tokens, extra source): one source; odd T; Block AttnRes' open sum after the bank; a deep bank (L32's
# head); the card's depth (L70: the head reads 2L + 1 = 141 sources; each gradient test ~0.8 s here, quick tier)
CASES = {"one_source": (1, 5, False), "odd_T": (5, 7, False), "extra": (3, 7, True), "one_source_extra": (1, 3, True),
         "deep": (65, 3, False), "card": (141, 3, False)}


def case(name, dtype=torch.float32):
    n, T, has_extra = CASES[name]
    vs, query, gain = sources(n + has_extra, T, dtype=dtype)
    extra = vs.pop() if has_extra else None
    return vs, query, gain, extra


@needs_interpreter
@pytest.mark.parametrize("name", CASES)
def test_mix_forward_equals_reference(name):
    """_mix_forward's mix and weights p == ops.depth_mix's, fp32 to 1e-5."""
    vs, query, gain, extra = case(name)
    mix, p, passed = triton_mix(vs, query, gain, extra)
    want_mix, want_p, _ = reference_mix(vs, query, gain, extra)
    assert passed is extra
    torch.testing.assert_close(mix, want_mix, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p, want_p, rtol=1e-5, atol=1e-5)


BACKWARDS = ("deferred", "read_modify_write")


def backward_mode(monkeypatch, mode):
    """Force the consumers' backward: deferred to the pushes (the default while the bank's record has room), or the
    read-modify-write of the gradient slots (what a consumer past that room does)."""
    if mode == "read_modify_write":
        monkeypatch.setattr(attnres, "deferred", lambda bank, BT, D, device: None)


@needs_interpreter
@pytest.mark.parametrize("mode", BACKWARDS)
@pytest.mark.parametrize("name", CASES)
def test_mix_gradients_equal_reference(name, mode, monkeypatch):
    """_mix_backward's (and, deferred, _source_backward's) gradients == autograd's through ops.depth_mix, for the
    query, the key gain, every bank source (handed on by the pushes) and the extra source, fp32 to 1e-5 of each
    gradient's largest entry."""
    backward_mode(monkeypatch, mode)
    vs, query, gain, extra = case(name)
    leaves = [query, gain, *vs] + ([extra] if extra is not None else [])
    got = gradients(triton_mix(vs, query, gain, extra)[0], leaves)
    want = gradients(reference_mix(vs, query, gain, extra)[0], leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        assert b.abs().max() > 0 or (i < 2 and len(leaves) == 3), i   # one source: p = 1, no query or gain gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=max(1e-5 * b.abs().max().item(), 1e-7), msg=f"leaf {i}")


@needs_interpreter
@pytest.mark.parametrize("mode", BACKWARDS)
def test_consumers_of_several_depths_share_a_bank(mode, monkeypatch):
    """Three consumers of one bank read 5, 4 and 2 of its sources (their own queries and gains; the 2-source one from
    a view kept from before the later pushes, so that its backward runs before those pushes' backward, and the
    deferred pass must leave it out of the sources it did not read), and the newest source is read too: every source's
    gradient is the sum over the consumers that read it, as autograd takes through ops.DepthBank, fp32 to 1e-5."""
    backward_mode(monkeypatch, mode)
    vs, _, _ = sources(5, 7)
    params = [sources(0, 7, seed=s)[1:] for s in (1, 2, 3)]
    leaves = vs + [t for pair in params for t in pair]
    w = [torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def loss(bank):
        views = [bank]
        for v in vs[1:]:
            views.append(views[-1].push(v))                         # views[k] holds k + 1 sources
        total = (views[-1].newest().float() * w[3]).sum()
        for (query, gain), view, weight in zip(params, (views[4], views[3], views[1]), w):
            total = total + (view.mix(query, gain, 1e-5)[0] * weight).sum()
        return total

    got = torch.autograd.grad(loss(attnres.DepthBank.start(vs[0], n_max=5)), leaves)
    want = torch.autograd.grad(loss(ops.DepthBank(vs[:1])), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        assert b.abs().max() > 0, i
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=f"leaf {i}")


@needs_interpreter
@pytest.mark.parametrize("name", ["odd_T", "extra"])
def test_mix_under_bf16_autocast_is_the_reference_to_bf16(name):
    """Under bf16 autocast the bank stores its sources in bf16 (fp32 inside the kernels, fp32 gradient bank): the mix
    and every gradient have cosine >= 0.999 with the fp32 reference's on the same fp32 sources."""
    vs, query, gain, extra = case(name)
    leaves = [query, gain, *vs] + ([extra] if extra is not None else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bank = attnres.DepthBank.start(vs[0], n_max=len(vs) + 1)
        assert bank.bank.slots[0].dtype == torch.bfloat16
        for v in vs[1:]:
            bank = bank.push(v)
        mix = bank.mix(query, gain, 1e-5, extra=extra)[0]
    want = reference_mix(vs, query, gain, extra)[0]
    assert mix.dtype == torch.float32
    assert cosine(mix, want) >= 0.999
    assert (mix - want).abs().max() > 0                           # it did round: the sources were stored in bf16
    for i, (a, b) in enumerate(zip(gradients(mix, leaves), gradients(want, leaves))):
        assert a.dtype == b.dtype == torch.float32
        assert cosine(a, b) >= 0.999, i


def tiny_model(residual, kernels_name, checkpoint_blocks=False, n_layer=2, **options):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layer=n_layer, d_model=32, n_head=2, d_ff=64, residual=residual,
                    residual_args=options, kernels=kernels_name, checkpoint_blocks=checkpoint_blocks)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))        # zero queries would hide a difference
    return model


@needs_interpreter
@pytest.mark.parametrize("residual,options", [
    ("attnres", {}), ("block_attnres", {"n_groups": 2}), ("block_attnres", {"checkpoint_blocks": True}),
    ("attnres", {"checkpoint_blocks": True}),
    ("attnres", {"topk_fraction": 0.5, "learn_logit_scale": True}),
    ("attnres", {"n_layer": 5}), ("attnres", {"n_layer": 5, "checkpoint_blocks": True}),
    ("block_attnres", {"n_layer": 5, "n_groups": 4, "checkpoint_blocks": True})])
def test_model_equals_reference(residual, options, monkeypatch):
    """A tiny GPT (L2, odd T 7) under kernels "triton" has the loss and every parameter gradient of kernels
    "reference" (ops.py's), fp32: loss to 1e-6, gradients to 1e-4 relative of the largest entry each. Also with
    activation checkpointing (backward recomputes each block, pushing into the bank again), with the release's
    top-k (cpu.py's torch mix on the Triton bank), and at L5 (10 query rows: two chunks of the two-phase mix, the
    second's first consumer inside a block, a chunk spanning blocks that a checkpointed backward recomputes apart).
    The two-phase mix serves every consumer but the variants' (its phase 1 runs once per chunk, and again per
    recompute of a chunk's first consumer)."""
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out, runs = {}, []
    monkeypatch.setattr(chunked.ChunkPass, "apply", lambda *a, f=chunked.ChunkPass.apply: runs.append(1) or f(*a))
    for name in ("triton", "reference"):
        out[name] = loss_and_grads(tiny_model(residual, name, **options), x)
    chunks = -(-2 * options.get("n_layer", 2) // chunked.CHUNK)
    assert len(runs) == (0 if "topk_fraction" in options else chunks * (1 + options.get("checkpoint_blocks", 0)))
    assert_step_equal(out["triton"], out["reference"])


@needs_interpreter
@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_model_under_bf16_autocast_is_the_reference_to_bf16(residual):
    """The GPU's precision on the CPU: under bf16 autocast (the bank in bf16) the tiny GPT's loss is the fp32-maths
    reference's under the same autocast to 2e-2, and every gradient within 10% of its norm (test_all.py's bf16 bounds)."""
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("triton", "reference"):
        out[name] = loss_and_grads(tiny_model(residual, name), x, bf16=True)
    assert_step_equal_to_bf16(out["triton"], out["reference"])


def test_namespaces(monkeypatch):
    """"triton" is the fast namespace with DepthBank replaced by the Triton bank and every other body cpu.py's;
    "fast" on a machine without CUDA is cpu.py's alone; a CPU tensor where the kernels cannot run (no interpreter)
    gets cpu.py's bank (the CPU path unchanged)."""
    tri, fast = ops.namespace("triton"), ops.namespace("fast")
    assert tri.DepthBank is chunked.DepthBank and issubclass(chunked.DepthBank, attnres.DepthBank)
    for attr in ops.TWO_BODIES:
        if attr not in gpu.triton_bodies():
            assert getattr(tri, attr) is getattr(kernels, attr), attr
    if not torch.cuda.is_available():
        assert fast.DepthBank is kernels.DepthBank
    assert type(attnres.DepthBank.start(torch.randn(1, 3, 8), n_max=2, eps=None)) is kernels.DepthBank   # DenseFormer's
    monkeypatch.setattr(attnres, "interpreted", lambda: False)
    assert type(attnres.DepthBank.start(torch.randn(1, 3, 8), n_max=2)) is kernels.DepthBank


def test_traffic_counts_the_notes_bank_reads():
    """traffic's forward reads, summed over Full AttnRes' mixes at L70 d640 B2 T2048 (sublayer k = 1 .. 139 reads its
    k + 1 sources, the head all 141), are gpu-h200.md's 10,011 source slots of 5.2 MB in bf16 less the one sublayer 0
    reads without a mix (RMSNorm(e)), plus per-token terms under 1%. Per slot a mix reads, the rest of the step
    (step_traffic: the consumers' backward, the pushes, the sources' passes) moves 2 bytes an element (the source,
    read again by the consumer's pass) + the records (bf16 dmix), read once per block of BLOCK_SOURCES sources and
    by the sources below the top, and every per-consumer and per-push term: under 1 byte more, where a record read
    per (consumer, source) pair would be 2. A read-modify-write consumer's backward moves 2 + 4 + 4 (the source, its
    gradient read and written) within 5% with its fixed terms."""
    tokens, D = 2 * 2048, 640
    slot = tokens * D
    reads = [k + 1 for k in range(1, 140)] + [141]
    slots_read = sum(reads)
    assert slots_read + 1 == 10_011
    consumers = [attnres.traffic(n, tokens, D) for n in reads]
    small = sum(c["forward"]["read"] for c in consumers) - slots_read * slot * 2
    assert 0 < small < 0.01 * slots_read * slot * 2
    step = sum(r["read"] + r["written"] for r in attnres.step_traffic(reads, 141, tokens, D))
    rest = step - sum(c["forward"]["read"] + c["forward"]["written"] for c in consumers)
    assert slots_read * slot * (2 + 2 / attnres.BLOCK_SOURCES) < rest < slots_read * slot * (2 + 1)
    rmw = sum(attnres.traffic(n, tokens, D, deferred=False)["backward"][key]
              for n in reads for key in ("read", "written"))
    assert slots_read * slot * 10 < rmw < 1.05 * slots_read * slot * 10


# (the bank sources each mixing consumer reads, in forward order; the extra source; the bank's slots): Full AttnRes'
# pattern over two blocks of sources (`BLOCK_SOURCES`), and Block AttnRes' (with more consumers than record room: the
# last three in backward order read-modify-write)
BANKS = {"full": (list(range(2, 13)), False, 12), "block": ([1, 1, 2, 2, 3, 3, 4], True, 4)}


def step_inputs(reads, has_extra, seed=0, shape=(1, 5, 48)):
    """(sources, [(query, gain, extra or None)] per consumer), all leaves; sources and extras of `shape` (B, T, D)."""
    g = torch.Generator().manual_seed(seed)
    vs = [torch.randn(shape, generator=g).requires_grad_() for _ in range(max(reads))]
    per = [(torch.randn(shape[-1], generator=g).requires_grad_(), torch.randn(shape[-1], generator=g).requires_grad_(),
            torch.randn(shape, generator=g).requires_grad_() if has_extra else None) for _ in reads]
    return vs, per


def bank_step(bank, reads, inputs):
    """A step's use of a bank, as residuals.py's AttnRes makes it: consumer 0 reads the newest source, then each
    consumer mixes (its own query and gain, and its extra source if any) every source pushed before it, pushing the
    next ones first. -> (outputs, leaves: the sources, then each consumer's query, gain, extra)."""
    vs, per = inputs
    state = bank(vs[0])
    outputs = [state.newest()]
    for n, (query, gain, extra) in zip(reads, per):
        while len(state) < n:
            state = state.push(vs[len(state)])
        outputs.append(state.mix(query, gain, 1e-5, extra=extra)[0])
    return outputs, vs + [t for row in per for t in row if t is not None]


@needs_interpreter
@pytest.mark.parametrize("pattern", BANKS)
def test_a_steps_bank_equals_reference(pattern):
    """A whole step's bank (`bank_step`: block passes, the source passes below them, records written between them,
    and for Block AttnRes read-modify-write consumers and the gradient slots the passes start from): every gradient
    (sources, queries, gains, extras) is autograd's through ops.DepthBank, fp32 to 1e-5 of its largest entry (1e-5
    absolute for one under 1: a query's gradient is a sum of terms of the sources' scale that cancel)."""
    reads, has_extra, n_max = BANKS[pattern]
    got = bank_step(lambda v: attnres.DepthBank.start(v, n_max=n_max), reads, step_inputs(reads, has_extra))
    want = bank_step(lambda v: ops.DepthBank([v]), reads, step_inputs(reads, has_extra))
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(got[0])]
    a = torch.autograd.grad(got[0], got[1], weights)
    b = torch.autograd.grad(want[0], want[1], weights)
    for i, (x, y) in enumerate(zip(a, b)):
        assert y.abs().max() > 0, i
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * max(y.abs().max().item(), 1), msg=f"leaf {i}")


KERNELS = ("_mix_forward", "_mix_backward", "_query_gradients", "_block_backward", "_source_backward")
NO_KERNEL = {"aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default",
             "aten.empty_strided.default"}                  # allocations: no kernel on a GPU (views neither)


class Launches(TorchDispatchMode):
    """Every launch a GPU would see: the aten ops that run a kernel (not views, not allocations) and each Triton
    kernel's launch (counted by `counted`, the interpreter's own tensor work hidden from this mode)."""

    def __init__(self, names):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in NO_KERNEL:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def counted(kernel, names):
    """kernel, whose launches (kernel[grid](...)) append its name to names and run outside any dispatch mode."""
    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names.append(kernel.__name__)
                with _disable_current_modes():
                    return kernel[grid](*args, **kwargs)
            return launch
    return Counted()


@needs_interpreter
@pytest.mark.parametrize("pattern", BANKS)
def test_step_traffic_counts_the_launches(pattern, monkeypatch):
    """The launches step_traffic() declares for a bank's step (the roofline's count) are the ones the code makes,
    torch glue included (every aten op that runs a kernel), forward and backward together."""
    reads, has_extra, n_max = BANKS[pattern]
    monkeypatch.setattr(attnres, "interpreted", lambda: True)   # the kernels below are wrapped, still interpreted
    names = []
    for name in KERNELS:
        monkeypatch.setattr(attnres, name, counted(getattr(attnres, name), names))
    weights = [torch.randn(1, 5, 48, generator=torch.Generator().manual_seed(i)) for i in range(len(reads) + 1)]
    inputs = step_inputs(reads, has_extra)
    with Launches(names):
        outputs, leaves = bank_step(lambda v: attnres.DepthBank.start(v, n_max=n_max), reads, inputs)
        torch.autograd.backward(outputs, weights)
    expect = attnres.step_traffic(reads, n_max, 5, 48, extra=has_extra, storage_bytes=4)
    assert len(names) == sum(row["launches"] for row in expect), names
    assert all(v.grad.abs().max() > 0 for v in leaves[:max(reads)])


# (the bank sources consumer row i = 0, 1, .. reads, in forward order; the extra source; the bank's slots): Full
# AttnRes' pattern over three chunks (the last cut short), Block AttnRes' (rows 0 .. 3 before the second push, the
# chunk's later rows reading sources pushed since phase 1), a deep bank (the card's head, 141 sources, in one chunk),
# and consumers of older states (rows 2 and 4 read fewer sources than their chunk's phase 1: triton_attnres's mix,
# its deferred records, on the same bank)
CHUNKED = {"full": (list(range(2, 22)), False, 21), "block": ([1, 1, 1, 1, 2, 2, 3, 3, 3, 4], True, 5),
           "deep": ([139, 140, 141], False, 141), "older": ([4, 5, 2, 6, 3, 6, 7, 7, 2, 8], False, 8)}


def chunk_inputs(reads, has_extra, seed=0, shape=(1, 5, 48)):
    """`step_inputs`, and the consumers' queries and key gains stacked (rows, D) as new leaves: (vs, per, Q, G)."""
    vs, per = step_inputs(reads, has_extra, seed, shape=shape)
    stacked = [torch.stack([row[i] for row in per]).detach().requires_grad_() for i in (0, 1)]
    return vs, per, *stacked


def chunk_step(reads, inputs, fast=True, pick=True):
    """A step's use of the chunked bank as residuals.py's AttnRes makes it (`bank_step` with the queries and key gains
    stacked (rows, D), each consumer's row picked, its Site given to the mix); fast False: ops.DepthBank's.
    pick False: each consumer's query and gain are the leaves of their own equal to its rows (no glue around the
    bank). An extra but the last has a second use, as Block AttnRes' open sum has (its next write's sum, or the push
    that closes its group): the extra as the mix passed it on is an output too, after the mix. -> (outputs, p of
    each mix, leaves: the sources, the stacked queries and gains, the extras)."""
    vs, per, Q, G = inputs
    extras = [e for q, g, e in per if e is not None]
    state = chunked.DepthBank.start(vs[0], n_max=max(reads), queries=Q, key_gains=G) if fast else ops.DepthBank([vs[0]])
    outputs, weights, states = [state.newest()], [], [state]          # states[i]: the bank of i + 1 sources
    for r, (n, (query, gain, extra)) in enumerate(zip(reads, per)):
        while len(states) < n:
            states.append(states[-1].push(vs[len(states)]))
        state = states[n - 1]
        site = Site(r + 1, None, row=r)
        mix, p, passed = state.mix(site.pick(Q) if pick else query, site.pick(G) if pick else gain, 1e-5,
                                   extra=extra, site=site)
        outputs.append(mix)
        weights.append(p)
        if extra is not None and r < len(reads) - 1:
            outputs.append(passed)
    return outputs, weights, vs + [Q, G] + extras


@needs_interpreter
@pytest.mark.parametrize("pattern", [pytest.param(name, marks=pytest.mark.slow) if name == "deep" else name
                                     for name in CHUNKED])   # deep: 141 sources, ~3 s: the slow tier's
def test_chunked_bank_equals_reference(pattern):
    """The two-phase mix (chunks of CHUNK consumers: phase 1 over the sources at the chunk's first consumer, phase 2
    over the ones pushed since and the extra; backward, the consumers' passes and the chunk's) against ops.DepthBank:
    every mix and weight p to 1e-5, and every gradient (sources, the stacked queries and key gains, the extras) fp32
    to 1e-5 of its largest entry (1e-5 absolute for one under 1)."""
    assert_chunked_equals_reference(pattern)


@needs_interpreter
def test_backward_programs_over_several_tiles(monkeypatch):
    """The chunk's and each consumer's backward with fewer programs than tiles of tokens (2 programs over 5
    one-token tiles: each sums its consumers' dgq over 2 or 3 tiles, as at the card's shape, where 264 programs
    share 4,096 or 2,048 tiles) are still ops.DepthBank's, every mix and gradient to 1e-5: Block AttnRes' pattern
    (two chunks, sources pushed inside one, the extra)."""
    monkeypatch.setattr(chunked, "PROGRAMS", 2)
    monkeypatch.setattr(attnres, "blocks", lambda BT, D, sources=1: (1, attnres.next_power_of_2(D)))
    assert chunked.chunk_programs(5, 48) == chunked.merge_programs(5, 48) == 2
    assert_chunked_equals_reference("block")


@needs_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["full", "block"])
def test_chunked_bank_at_the_cards_tiles(pattern):
    """At the card's tiles (phase 1: PHASE1_TOKENS tokens a program, COLUMNS_TILE columns a loop step, the tiles of
    d640 and 4,096 tokens), on 2 x 19 tokens of width 160: the last program's tokens and the last column tile cut
    short (masked), sources read in several column tiles; every mix, weight and gradient is ops.DepthBank's (1e-5).
    A column or token mask dropped, or a source loop that starts or steps wrong, changes o1 and fails here."""
    assert chunked.phase1_blocks(4096, 640) == chunked.phase1_blocks(38, 160) == (16, 64)
    assert_chunked_equals_reference(pattern, shape=(2, 19, 160))


def assert_chunked_equals_reference(pattern, shape=(1, 5, 48)):
    """The chunked bank's mixes, weights and every gradient on CHUNKED[pattern] (sources of `shape`) are
    ops.DepthBank's: 1e-5, the gradients' of their largest entry (1e-5 absolute for one under 1); every reference
    gradient non-zero."""
    reads, has_extra, n_max = CHUNKED[pattern]
    inputs = chunk_inputs(reads, has_extra, shape=shape)
    got, want = chunk_step(reads, inputs), chunk_step(reads, inputs, fast=False)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(got[0])]
    a = torch.autograd.grad(got[0], got[2], weights)
    b = torch.autograd.grad(want[0], want[2], weights)
    for i, (x, y) in enumerate(zip(a, b)):
        assert y.abs().max() > 0, i
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * max(y.abs().max().item(), 1), msg=f"leaf {i}")


def assert_taken_gradients_equal(got, want, taken):
    """The gradients of a loss on the outputs `taken` (indices into `chunk_step`'s outputs, random weights) of the
    chunked bank's step `got` and ops.DepthBank's `want`: every leaf's equal (fp32, 1e-5 of its largest entry, 1e-5
    absolute under 1); a leaf the reference gives no gradient gets none, or zeros."""
    weights = [torch.randn(got[0][i].shape, generator=torch.Generator().manual_seed(i)) for i in taken]
    a = torch.autograd.grad([got[0][i] for i in taken], got[2], weights, allow_unused=True)
    b = torch.autograd.grad([want[0][i] for i in taken], want[2], weights, allow_unused=True)
    for i, (x, y) in enumerate(zip(a, b)):
        if y is None:
            assert x is None or not x.any(), i
            continue
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * max(y.abs().max().item(), 1), msg=f"leaf {i}")


@needs_interpreter
def test_chunked_bank_with_consumers_outside_the_loss():
    """Consumers whose mix the loss does not take (a chunk's first, one in its middle, and every one of the third
    chunk) run no backward: the chunk's pass leaves their records and phase-2 rows out, and every gradient is still
    ops.DepthBank's (fp32, 1e-5 of its largest entry)."""
    reads, has_extra, n_max = CHUNKED["full"]
    inputs = chunk_inputs(reads, has_extra)
    got, want = chunk_step(reads, inputs), chunk_step(reads, inputs, fast=False)
    taken = [i for i in range(len(got[0])) if i not in (1, 5) and not 17 <= i <= 20]
    assert_taken_gradients_equal(got, want, taken)


@needs_interpreter
def test_an_extra_passed_on_keeps_its_gradient_when_its_mix_is_unused():
    """Block AttnRes' pattern with the loss on every extra passed on but only on every other mix: a consumer whose
    mix the loss does not take still hands its extra the gradient of the extra's later use (Merge's backward without
    dmix), and one whose mix it takes adds the two in its kernel; every gradient is ops.DepthBank's (fp32, 1e-5 of
    its largest entry)."""
    reads, has_extra, n_max = CHUNKED["block"]
    inputs = chunk_inputs(reads, has_extra)
    got, want = chunk_step(reads, inputs), chunk_step(reads, inputs, fast=False)
    mixes = [1 + 2 * r for r in range(len(reads) - 1)] + [len(got[0]) - 1]        # outputs: e, then mix, passed, ...
    taken = [i for i in mixes[::2]] + [i + 1 for i in mixes[:-1]]
    assert_taken_gradients_equal(got, want, taken)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 5, 48), pytest.param((2, 19, 160), marks=pytest.mark.slow)])
def test_chunked_bank_under_bf16_autocast_is_the_reference_to_bf16(shape):
    """Under bf16 autocast (the bank, o1 and the records in bf16) the two-phase mix of Block AttnRes' pattern is
    ops.DepthBank's over the same bf16 sources: every gradient's cosine >= 0.999; small tiles, and the card's
    (`test_chunked_bank_at_the_cards_tiles`' shape: phase 1's last program and column tile cut short)."""
    reads, has_extra, n_max = CHUNKED["block"]
    inputs = chunk_inputs(reads, has_extra, shape=shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_step(reads, inputs)
    vs, *rest = inputs
    rounded = ([v.detach().bfloat16().float().requires_grad_() for v in vs], *rest)
    want = chunk_step(reads, rounded, fast=False)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(got[0])]
    a = torch.autograd.grad(got[0], got[2], weights)
    b = torch.autograd.grad(want[0], want[2], weights)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == torch.float32 and cosine(x, y) >= 0.999, i


@needs_interpreter
@pytest.mark.parametrize("pattern", ["full", "block"])
def test_chunked_step_traffic_counts_the_launches(pattern, monkeypatch):
    """The launches triton_attnres_chunk.step_traffic() declares for a bank's step are the ones the code makes, torch
    glue included, forward and backward together; the consumers' queries and gains are leaves of their own (no
    pick around the bank), so the stacked ones get only the chunks' gradients (phase 2's included: its dgq rows are
    summed by the chunk's pass): autograd adds all but the first chunk's pair into them, two launches fewer than
    step_traffic counts. Each extra source but the last has a second use (`chunk_step`), whose gradient its mix's
    backward adds: no launch of autograd's for it, and none counted."""
    reads, has_extra, n_max = CHUNKED[pattern]
    monkeypatch.setattr(attnres, "interpreted", lambda: True)
    names = []
    for module, kernels_ in ((attnres, ("_query_gradients",)),
                             (chunked, ("_chunk_forward", "_merge_forward", "_merge_backward", "_chunk_backward",
                                        "_chunk_query_gradients"))):
        for name in kernels_:
            monkeypatch.setattr(module, name, counted(getattr(module, name), names))
    inputs = chunk_inputs(reads, has_extra)
    weights = [torch.ones(1, 5, 48) for _ in range(len(reads) + 1 + has_extra * (len(reads) - 1))]
    with Launches(names):
        outputs, _, leaves = chunk_step(reads, inputs, pick=False)
        torch.autograd.backward(outputs, weights)
    expect = chunked.step_traffic(reads, max(reads), 5, 48, extra=has_extra, storage_bytes=4)
    assert len(names) == sum(row["launches"] for row in expect) - 2, " ".join(names)
    assert all(v.grad.abs().max() > 0 for v in leaves)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_compiled_blocks_keep_their_graphs_with_the_chunked_bank(residual, monkeypatch):
    """Compiled per block (compile_model's "blocks", the "eager" backend counting graphs), kernels "triton": the
    two-phase mix runs (phase 1 once per chunk of CHUNK rows) and dynamo makes test_train.py's 5 graphs at L4 and L8
    (the bank reads the consumer's row from its Site in eager code: no graph per depth); loss and gradients are
    eager's."""
    from torch._dynamo.utils import counters
    from depthbench.training.compiled import compile_model
    runs = []
    monkeypatch.setattr(chunked.ChunkPass, "apply", lambda *a, f=chunked.ChunkPass.apply: runs.append(1) or f(*a))
    for L in (4, 8):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, n_layer=L, d_model=32, n_head=4, d_ff=48, residual=residual,
                              kernels="triton"))
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(x, x)[1]
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        runs.clear()
        loss_c = compile_model(model, "blocks", backend="eager")(x, x)[1]
        loss_c.backward()
        assert counters["stats"]["unique_graphs"] == 5 and len(runs) == 2 * L // chunked.CHUNK, L
        torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()


COMPILE_FOR_H100 = """
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from depthbench.kernels import triton_attnres as A
from depthbench.kernels import triton_attnres_chunk as K
assert not A.interpreted()
SCALARS = {"n": "i32", "m_sources": "i32", "BT": "i32", "D": "i32", "P": "i32", "eps": "fp32", "j": "i32",
           "count": "i32", "lo": "i32", "g": "i32", "n1": "i32", "n2": "i32", "m2": "i32", "C": "i32", "P2": "i32"}
INTS = {"reads": "*i32", "reads_ptr": "*i32", "ran_ptr": "*i32"}
def build(fn, storage, consts, warps, stored=(), maxnreg=None):
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else SCALARS.get(a, INTS.get(a, "*fp32")) for a in names}
    for a in (names[0],) + stored:                           # the bank (or the source slot), and the records' dmix
        sig[a] = storage
    triton.compile(ASTSource(fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "maxnreg": maxnreg})
for storage in ("*bf16", "*fp32"):
    for extra in (False, True):
        build(A._mix_forward, storage, {"HAS_EXTRA": extra, "BLOCK_T": 4, "BLOCK_D": 1024, "NUM_STAGES": A.STAGES,
                                        "BLOCK_J": A.WEIGHT_ROWS}, 4)
        for defer in (False, True):
            consts = {"HAS_EXTRA": extra, "DEFER": defer, "BLOCK_T": 4, "BLOCK_D": 1024, "NUM_STAGES": A.STAGES}
            build(A._mix_backward, storage, consts, A.BACKWARD_WARPS, ("dV",) if defer else ())
    for base in (False, True):
        consts = {"HAS_BASE": base, "BLOCK_T": 4, "BLOCK_D": 1024}
        build(A._source_backward, storage, consts, A.BACKWARD_WARPS, ("records",))
    consts = {"BLOCK_S": A.BLOCK_SOURCES, "BLOCK_T": 1, "BLOCK_D": 1024}
    build(A._block_backward, storage, consts, A.BACKWARD_WARPS, ("records",))
    build(A._query_gradients, "*fp32", {"BLOCK_R": A.ROWS, "BLOCK_C": A.COLUMNS}, 4)
    T0, D0 = K.phase1_blocks(4096, 640)
    phase1 = {"BLOCK_C": K.CHUNK, "BLOCK_T": T0, "BLOCK_D": D0, "NUM_STAGES": K.STAGES, "D": 640}
    build(K._chunk_forward, storage, phase1, K.PHASE1_WARPS, ("o1_ptr",))
    J1, D1 = K.backward_blocks(4096, 640)
    bank = torch.bfloat16 if storage == "*bf16" else torch.float32
    stages = K.backward_stages(2 if storage == "*bf16" else 4)
    chunk = {"BLOCK_C": K.CHUNK, "BLOCK_J": J1, "BLOCK_D": D1, "NUM_STAGES": stages, "D": 640,
             "PRECISION": K.backward_precision(bank)}
    build(K._chunk_backward, storage, chunk, K.backward_warps(2 if storage == "*bf16" else 4), ("records",))
    for extra in (False, True):
        consts = {"HAS_EXTRA": extra, "BLOCK_T": 4, "BLOCK_D": 1024, "NUM_STAGES": A.STAGES}
        build(K._merge_forward, storage, {**consts, "BLOCK_J": A.WEIGHT_ROWS}, K.WARPS, ("o1_ptr",))
        build(K._merge_backward, storage, {**consts, "BLOCK_T": 2}, K.WARPS, ("record_ptr",))
    build(K._chunk_query_gradients, "*fp32", {"BLOCK_R": A.ROWS, "BLOCK_C": A.COLUMNS}, 4)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100():
    """Every kernel, each variant (bf16 or fp32 bank and records; with or without the extra source; deferred or
    read-modify-write; the source's pass with or without a gradient slot; the block pass; the two-phase mix's
    phase 1 and 2 each way, o1 and the records in the bank's dtype), compiles to an sm90 binary with Triton's own
    compiler and ptxas (no GPU needed): what the interpreter does not check (the GPU's typing of loop-carried
    values, the branches inside loops)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


CHUNK_BACKWARD_ON_AN_H100 = """
import json, sys, torch
sys.path.insert(0, "scripts")
import kernel_probe as kp
from depthbench.kernels import triton_attnres_chunk as K
from depthbench.reports import compiled_code as cc
fn = K._chunk_backward
J, BD = K.backward_blocks(4096, 640)
consts = {"D": 640, "BLOCK_C": K.CHUNK, "BLOCK_J": J, "BLOCK_D": BD, "NUM_STAGES": K.backward_stages(2),
          "PRECISION": K.backward_precision(torch.bfloat16)}
types = {"V": "*bf16", "records": "*bf16", "ran_ptr": "*i32", "n1": "i32", "C": "i32", "P": "i32", "BT": "i32",
         "eps": "fp32"}
sig = {a: "constexpr" if a in consts else types.get(a, "*fp32") for a in fn.arg_names}
launch = kp.Launch(kernel=f"{fn.fn.__module__}:_chunk_backward", grid=[264], signature=sig, constexprs=consts,
                   aligned=[a for a, t in sig.items() if t.startswith("*")] + ["BT"], ints={},
                   options={"num_warps": K.backward_warps(2)})
v = kp.probe_variant(launch, kp.find_tools())
print(json.dumps({"ctas": cc.ctas_per_sm(v.registers, v.warps, v.shared), "async": v.async_ttgir,
                  "loop_local": sum(n for where, n in v.sass.local.items() if where >= 0)}))
"""


@pytest.mark.slow
def test_chunk_backward_on_an_h100_is_pipelined_at_two_programs_a_multiprocessor():
    """`_chunk_backward` at the card's launch (d640, 4,096 tokens, bf16 bank: its blocks, stages and warps) compiled
    for sm_90 (ptxas, no GPU) fits 2 programs on a multiprocessor and touches no local memory inside a loop (8 warps
    capped at 128 registers did under Triton 3.6); under Triton 3.9 its source loop is software-pipelined (async
    copies; Triton 3.6 pipelines no loop with its atomic adds: docs/speed.md)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", CHUNK_BACKWARD_ON_AN_H100], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ctas"] >= 2 and got["loop_local"] == 0
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9):
        assert got["async"] > 0
