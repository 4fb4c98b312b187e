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
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before any import of triton (see the docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

import ops  # noqa: E402
from depthbench.kernels import cpu as kernels  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

triton = pytest.importorskip("triton", reason="triton does not import: `pip install triton` runs these tests")

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from depthbench import kernels as gpu  # noqa: E402
from depthbench.kernels import triton_attnres as attnres  # noqa: E402

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
    """The Triton bank's mix over vs (and extra): (mix, p)."""
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
    mix, p = triton_mix(vs, query, gain, extra)
    want_mix, want_p = reference_mix(vs, query, gain, extra)
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


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


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


def tiny_model(residual, kernels_name, checkpoint_blocks=False, **options):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layer=2, d_model=32, n_head=2, d_ff=64, residual=residual,
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
    ("attnres", {"topk_fraction": 0.5, "learn_logit_scale": True})])
def test_model_equals_reference(residual, options):
    """A tiny GPT (L2, odd T 7) under kernels "triton" has the loss and every parameter gradient of kernels
    "reference" (ops.py's), fp32: loss to 1e-6, gradients to 1e-4 relative of the largest entry each. Also with
    activation checkpointing (backward recomputes each block, pushing into the bank again) and with the release's
    top-k (cpu.py's torch mix on the Triton bank)."""
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("triton", "reference"):
        model = tiny_model(residual, name, **options)
        loss = model(x, x)[1]
        loss.backward()
        out[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    (l1, g1), (l2, g2) = out["triton"], out["reference"]
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    assert g1.keys() == g2.keys()
    for n, g in g2.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(g1[n], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=n)


@needs_interpreter
@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_model_under_bf16_autocast_is_the_reference_to_bf16(residual):
    """The GPU's precision on the CPU: under bf16 autocast (the bank in bf16) the tiny GPT's loss is the fp32-maths
    reference's under the same autocast to 2e-2, and every gradient within 10% of its norm (test_all.py's bf16 bounds)."""
    x = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("triton", "reference"):
        model = tiny_model(residual, name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)[1]
        loss.backward()
        out[name] = loss.float(), {n: p.grad for n, p in model.named_parameters()}
    (l1, g1), (l2, g2) = out["triton"], out["reference"]
    torch.testing.assert_close(l1, l2, rtol=2e-2, atol=2e-2)
    for n, g in g2.items():
        assert g1[n].dtype == g.dtype == torch.float32, n
        assert (g1[n] - g).norm() <= 0.1 * g.norm() + 1e-3, n


def test_namespaces(monkeypatch):
    """"triton" is the fast namespace with DepthBank replaced by the Triton bank and every other body cpu.py's;
    "fast" on a machine without CUDA is cpu.py's alone; a CPU tensor where the kernels cannot run (no interpreter)
    gets cpu.py's bank (the CPU path unchanged)."""
    tri, fast = ops.namespace("triton"), ops.namespace("fast")
    assert tri.DepthBank is attnres.DepthBank
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


def step_inputs(reads, has_extra, seed=0):
    """(sources, [(query, gain, extra or None)] per consumer), all leaves."""
    g = torch.Generator().manual_seed(seed)
    vs = [torch.randn(1, 5, 48, generator=g).requires_grad_() for _ in range(max(reads))]
    per = [(torch.randn(48, generator=g).requires_grad_(), torch.randn(48, generator=g).requires_grad_(),
            torch.randn(1, 5, 48, generator=g).requires_grad_() if has_extra else None) for _ in reads]
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


COMPILE_FOR_H100 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from depthbench.kernels import triton_attnres as A
assert not A.interpreted()
SCALARS = {"n": "i32", "m_sources": "i32", "BT": "i32", "D": "i32", "P": "i32", "eps": "fp32", "j": "i32",
           "count": "i32", "lo": "i32", "g": "i32"}
INTS = {"reads": "*i32", "reads_ptr": "*i32"}
def build(fn, storage, consts, warps, stored=()):
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else SCALARS.get(a, INTS.get(a, "*fp32")) for a in names}
    for a in (names[0],) + stored:                           # the bank (or the source slot), and the records' dmix
        sig[a] = storage
    triton.compile(ASTSource(fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
for storage in ("*bf16", "*fp32"):
    for extra in (False, True):
        build(A._mix_forward, storage, {"HAS_EXTRA": extra, "BLOCK_T": 4, "BLOCK_D": 1024}, 4)
        for defer in (False, True):
            consts = {"HAS_EXTRA": extra, "DEFER": defer, "BLOCK_T": 4, "BLOCK_D": 1024}
            build(A._mix_backward, storage, consts, A.BACKWARD_WARPS, ("dV",) if defer else ())
    for base in (False, True):
        consts = {"HAS_BASE": base, "BLOCK_T": 4, "BLOCK_D": 1024}
        build(A._source_backward, storage, consts, A.BACKWARD_WARPS, ("records",))
    consts = {"BLOCK_S": A.BLOCK_SOURCES, "BLOCK_T": 1, "BLOCK_D": 1024}
    build(A._block_backward, storage, consts, A.BACKWARD_WARPS, ("records",))
    build(A._query_gradients, "*fp32", {"BLOCK_R": A.ROWS, "BLOCK_C": A.COLUMNS}, 4)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100():
    """Every kernel, each variant (bf16 or fp32 bank and records; with or without the extra source; deferred or
    read-modify-write; the source's pass with or without a gradient slot; the block pass), compiles to an sm90
    binary with Triton's own compiler and ptxas (no GPU needed): what the interpreter does not
    check (the GPU's typing of loop-carried values, the branches inside loops)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
