"""scripts/cuda_check.py, the smoke's first check: its bounds and how it picks the kernels namespaces.

    python -m pytest -q tests/test_cuda_check.py      # ~5 s: one design at L2 d32 on the CPU
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cuda_check  # noqa: E402  (scripts/ is not a package)


def test_a_row_passes_only_within_every_bound():
    """Losses and relative errors pass at most at their bound, cosines at least at theirs; a leg not run (no
    compiled leg) is not judged."""
    good = {"fp32_loss": 0.0, "fp32_grad_rel": 1e-6, "bf16_loss": 1e-3, "bf16_grad_cos": 0.999}
    assert cuda_check.passes(good)
    assert not cuda_check.passes({**good, "fp32_grad_rel": 2e-4})
    assert not cuda_check.passes({**good, "bf16_grad_cos": 0.98})
    assert not cuda_check.passes({**good, "compiled_loss": 0.0, "compiled_grad_cos": 0.99})


def test_triton_is_checked_only_where_the_model_accepts_it():
    """"fast" always; "triton" either checked or skipped with a printed reason, never both."""
    names, skipped = cuda_check.namespaces()
    assert names[0] == "fast" and ("triton" in names) != ("triton" in skipped)


def test_the_fast_kernels_equal_the_reference_on_the_cpu():
    """One design with a depth state through every leg on the CPU: fp32 exact to 1e-4, bf16 close, compiled ==
    eager (dynamo's eager backend)."""
    row = cuda_check.check_design("attnres", "fast", cuda_check.torch.device("cpu"), tiny=True)
    assert row["ok"] and row["fp32_grad_rel"] < 1e-4 and "compiled_grad_cos" in row
