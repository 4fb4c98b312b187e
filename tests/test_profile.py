"""
profile_gpu.py's tests: the formulas by hand and against torch's FLOP counter, the CLI's errors, the JSON.

    python -m pytest -q tests/test_profile.py

CPU only. The measured run spawns one small process per registered design (about half a minute on 2 cores).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from depthbench.training import costs
from depthbench.evaluation import observe
import profile_gpu
import residuals
from model import GPT, GPTConfig
from residuals import RESIDUALS

ROW_KEYS = ["residual", "n_layer", "d_model", "d_ff", "ar", "seq", "batch", "params", "prefill_flops",
            "prefill_flops_head", "residual_overhead_flops", "train_flops_per_token", "kv_cache_bytes",
            "kv_cache_bytes_batch", "weight_bytes", "residual_state_bytes", "fwd_ms", "fwdbwd_ms", "tok_per_s",
            "peak_mem_bytes", "peak_mem_kind", "utilization"]


def test_formulas_paper_shape_L16_d1216():
    """The widest 400M shape at T = 4096, V = 50280, bf16: every field from arithmetic written out here."""
    a = lambda res: costs.analytic(res, n_layer=16, d_model=1216, d_ff=3248, seq=4096, batch=8, vocab=50280,
                                   params=406_534_336, elem_bytes=2)
    r = a("preln")
    # N_blk = 16 (4 * 1216^2 + 3 * 1216 * 3248) = 16 (5,914,624 + 11,848,704) = 284,213,248
    # A = 2 * 4096 * 284,213,248 + 2 * 16 * 1216 * 4096^2 = 2,328,274,927,616 + 652,835,028,992
    assert r["prefill_flops"] == 2_981_109_956_608                      # docs/diagnostics.md#cost: 2.981 T
    # + head 2 * 4096 * 1216 * 50280 = 500,862,812,160
    assert r["prefill_flops_head"] == 3_481_972_768_768                 # 3.482 T
    assert r["train_flops_per_token"] == 3 * 3_481_972_768_768 / 4096   # 2,550,273,024
    assert r["kv_cache_bytes"] == 318_767_104                           # 4 * 16 * 1216 * 4096: 318.8 MB
    assert r["kv_cache_bytes_batch"] == 2_550_136_832                   # x 8
    assert r["weight_bytes"] == 813_068_672                             # 2 bytes per parameter
    assert r["residual_state_bytes"] == 9_961_472                       # 1216 * 4096 * 2
    assert r["residual_overhead_flops"] == 0
    assert a("hc")["residual_overhead_flops"] == 15_300_820_992         # 192 * 16 * 1216 * 4096: +0.015 T
    assert a("mhc")["residual_overhead_flops"] == 38_889_586_688        # 488 * 16 * 1216 * 4096: +0.039 T
    assert a("attnres")["residual_overhead_flops"] == 11_156_848_640    # 4 * 1216 * (2 * 256 + 48) * 4096
    # MoDA: W_kv 4 * 1216^2 * 15 * 4096 = 363,394,498,560; depth keys 4 * 1216 * (16 * 15) * 4096 = 4,781,506,560
    assert a("moda")["residual_overhead_flops"] == 368_176_005_120
    assert a("hc")["residual_state_bytes"] == 4 * 9_961_472


def test_formulas_small_shape_L8_d64():
    """L = 8, d = 64, d_ff = 176, T = 32, V = 100, batch 2, fp32: 16 sublayers, so Block AttnRes (N = 8) != Full."""
    a = lambda res: costs.analytic(res, n_layer=8, d_model=64, d_ff=176, seq=32, batch=2, vocab=100,
                                   params=1000, elem_bytes=4)
    r = a("preln")
    # N_blk = 8 (4 * 64^2 + 3 * 64 * 176) = 8 (16,384 + 33,792) = 401,408
    # A = 2 * 32 * 401,408 + 2 * 8 * 64 * 32^2 = 25,690,112 + 1,048,576
    assert r["prefill_flops"] == 26_738_688
    assert r["prefill_flops_head"] == 26_738_688 + 409_600               # 2 * 32 * 64 * 100
    assert r["kv_cache_bytes"] == 131_072 and r["kv_cache_bytes_batch"] == 262_144  # 2 * 8 * 32 * 64 * 4, x 2
    assert r["weight_bytes"] == 4000
    # Full AttnRes: 2L^2 + 3L = 152 source visits, 4d FLOPs each, per token
    assert a("attnres")["residual_overhead_flops"] == 4 * 64 * 152 * 32  # 1,245,184
    # Block AttnRes, group of sublayer j = floor(j * 8 / 16) = j // 2; sublayer k >= 1 reads (k - 1) // 2 + 2 sources:
    # k = 1..15 -> 2,2,3,3,4,4,5,5,6,6,7,7,8,8,9 (sum 79), the final readout 9: 88 visits
    assert a("block_attnres")["residual_overhead_flops"] == 4 * 64 * 88 * 32  # 720,896
    # MoDA: W_kv 4 * 64^2 * 7 * 32 = 3,670,016; depth keys 4 * 64 * (8 * 7) * 32 = 458,752
    assert a("moda")["residual_overhead_flops"] == 4_128_768
    assert a("hc")["residual_overhead_flops"] == 3_145_728               # 192 * 8 * 64 * 32
    assert a("mhc")["residual_overhead_flops"] == 7_995_392              # 488 * 8 * 64 * 32
    # residual state per sequence (T * 4 bytes = 128 per unit of d = 64): 1, 4, 2L+1 = 17, N+1 = 9, 1+4L = 33 units
    assert [a(k)["residual_state_bytes"] for k in ["keel", "mhc", "attnres", "block_attnres", "moda"]] == \
           [8_192, 32_768, 139_264, 73_728, 270_336]


def attnres_sources(L, N):
    """The source visits of all depth mixes that BlockAttnRes.cost counts: its FLOPs at d = T = 1, over 4."""
    return residuals.BlockAttnRes.cost(L, 1, 1, n_groups=N)[0] // 4


@pytest.mark.parametrize("L", [1, 2, 5, 16])
def test_block_attnres_with_one_group_per_sublayer_is_full(L):
    assert attnres_sources(L, 2 * L) == 2 * L * L + 3 * L
    assert attnres_sources(L, 99) == 2 * L * L + 3 * L   # more groups than sublayers: Full


@pytest.mark.parametrize("res,visits", [("attnres", 152), ("block_attnres", 88)])
def test_attnres_source_count_matches_the_model(res, visits):
    """The analytic source count equals the sources the implemented design actually mixes (L = 8)."""
    if res not in RESIDUALS:
        pytest.skip(f"{res} is not registered")
    model = GPT(GPTConfig(vocab_size=32, n_layer=8, d_model=32, n_head=4, d_ff=96, residual=res))
    weights = observe.record(model, torch.zeros(1, 4, dtype=torch.long)).internals["attnres_weights"]
    N = 8 if res == "block_attnres" else 16
    assert sum(w.numel() for w in weights) == visits == attnres_sources(8, N)


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_flop_counter_agrees_with_analytic_preln(n_kv_head):
    """torch's FlopCounterMode on a tiny Pre-LN forward counts exactly the analytic matmuls, MHA and GQA.

    It counts every position of the LM head, and attention over the full T x T (non-causal), while formula A
    counts attention causally and leaves the head out; so compare the parts: the linear layers + head (aten.mm),
    and, with SDPA's math backend (two bmm's; CPU's fused kernel has no FLOP formula), attention = 2 x the causal term.
    """
    L, d, d_ff, T, V, B = 2, 64, 176, 16, 128, 2
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, n_layer=L, d_model=d, n_head=4, n_kv_head=n_kv_head, d_ff=d_ff))
    r = costs.analytic("preln", n_layer=L, d_model=d, d_ff=d_ff, seq=T, batch=B, vocab=V, params=model.num_params(),
                       elem_bytes=4, kv_ratio=n_kv_head / 4)
    idx = torch.randint(0, V, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(idx)
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    causal_scores = 2 * L * d * T * T                          # 65,536
    linear_and_head = r["prefill_flops_head"] - causal_scores  # 2 T N_blk + 2 T d V = 688,128 + 262,144 per sequence
    kv_width = 64 * n_kv_head // 4                             # W_k, W_v: d -> n_kv_head * head_dim
    assert linear_and_head == 2 * T * 2 * (2 * 64 ** 2 + 2 * 64 * kv_width + 3 * 64 * 176) + 2 * T * 64 * 128
    assert counts["aten.mm"] == B * linear_and_head
    assert r["kv_cache_bytes"] == 2 * L * T * kv_width * 4
    assert counts["aten.bmm"] == B * 2 * causal_scores         # non-causal: the full T x T, twice the causal count


@pytest.mark.parametrize("argv", [["--residual", "nope"], ["--shapes", "12y34"], ["--shapes", "2x64", "--seq", "0"],
                                  ["--shapes", "2x64", "--batch", "-1"], ["--shapes", "2x60"],
                                  ["--shapes", "2x64", "--params", "20M"], ["--params", "lots"]])
def test_bad_input_exits_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        profile_gpu.main(argv + ["--analytic-only"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "error:" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_bad_input_from_the_shell_has_no_traceback():
    p = subprocess.run([sys.executable, "profile_gpu.py", "--shapes", "12y34"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "12y34" in p.stderr


@pytest.mark.slow  # ~3.4 s on 2 cores (issue 67's quick-tier timing)
def test_analytic_json_acceptance_and_atomic_write(tmp_path, monkeypatch, capsys):
    """The acceptance command's numbers; the file is complete before it takes the final name."""
    out = tmp_path / "prof.json"
    out.write_text("old")
    seen = []

    def checked_replace(src, dst):  # at the moment of the swap: the new file is whole, the old one untouched
        assert os.path.dirname(os.path.abspath(src)) == str(tmp_path) and open(dst).read() == "old"
        seen.append(json.load(open(src)))
        os.rename(src, dst)

    monkeypatch.setattr(profile_gpu.os, "replace", checked_replace)
    profile_gpu.main(["--analytic-only", "--shapes", "16x1216,70x640", "--seq", "4096", "--json", "--out", str(out)])
    doc = json.loads(capsys.readouterr().out)
    assert len(seen) == 1 and json.loads(out.read_text()) == doc == seen[0]
    assert os.listdir(tmp_path) == ["prof.json"]  # no temporary file left behind
    assert doc["schema"] == "depthbench.profile/1" and doc["dtype"] == "bfloat16" and doc["peak_flops"] is None
    assert isinstance(doc["device"], str)
    assert len(doc["rows"]) == 2 * len(RESIDUALS)
    for row in doc["rows"]:
        assert set(ROW_KEYS) <= set(row)
        want = {16: (2.98e12, 318.8), 70: (4.33e12, 734.0)}[row["n_layer"]]  # FLOPs, decimal MB
        assert math.isclose(row["prefill_flops"], want[0], rel_tol=0.01)
        assert round(row["kv_cache_bytes"] / 1e6, 1) == want[1]
        assert row["fwd_ms"] is None and row["utilization"] is None


@pytest.mark.slow
@pytest.mark.parametrize("flags, designs", [(["--in-process"], list(RESIDUALS)), ([], ["preln", "hc"])],
                         ids=["every-design-in-process", "a-process-per-row"])
def test_tiny_measured_run_every_design(tmp_path, flags, designs):
    """A real measured CPU run: finite positive timings for every registered design, the table on stdout; every
    design with its rows measured in profile_gpu's own process (--in-process: a process per row would be 18 more
    torch imports), and two designs in the CPU's default, a fresh process per row (the same measure(), its job and
    its numbers across a process boundary)."""
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, "profile_gpu.py", "--shapes", "2x64", "--seq", "32", "--batch", "2",
                        "--repeats", "2", "--threads", "1", "--residual", ",".join(designs), *flags, "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["device"].startswith("cpu") and doc["dtype"] == "float32" and doc["peak_flops"] > 0
    assert [r["residual"] for r in doc["rows"]] == designs
    for r in doc["rows"]:
        assert "error" not in r, r
        for k in ["fwd_ms", "fwdbwd_ms", "tok_per_s", "utilization"]:
            assert math.isfinite(r[k]) and r[k] > 0, (r["residual"], k, r[k])
        # the model's weights, then its gradients and activations on top (exact tensor bytes on CPU)
        assert r["weight_bytes"] < r["peak_mem_bytes"] and 2 * r["weight_bytes"] < r["peak_mem_train_bytes"], r
        assert r["peak_mem_kind"].startswith("cpu")
    lines = p.stdout.splitlines()
    assert all(any(line.startswith(res + " ") for line in lines) for res in designs)


def test_tensor_bytes_counts_live_storage_and_shows_the_chunked_loss_saving():
    """TensorBytes' peak is the most bytes alive at once (views and in-place results add nothing, freed
    storage leaves), and the logits-free loss peaks far below the plain one when the logits dominate."""
    import torch.nn.functional as F
    from depthbench.kernels.cpu import chunked_cross_entropy
    with profile_gpu.TensorBytes() as tb:
        a, b = torch.empty(1000), torch.empty(2000)
        del a
        c = torch.empty(500)
        b.view(-1).add_(1)
    assert tb.peak == 3000 * 4 and tb.now == 2500 * 4
    torch.manual_seed(0)
    z, w, t = torch.randn(512, 32, requires_grad=True), torch.randn(4096, 32, requires_grad=True), torch.randint(0, 4096, (512,))
    peaks = []
    for chunk in (None, 64):
        with profile_gpu.TensorBytes() as tb:
            loss = chunked_cross_entropy(z, w, t, chunk) if chunk else F.cross_entropy(F.linear(z, w), t)
            loss.backward()
        peaks.append(tb.peak)
    logits = 512 * 4096 * 4
    assert peaks[0] > 2.5 * logits and peaks[1] < 0.6 * logits, peaks  # plain: logits, softmax, gradient


@pytest.mark.slow
def test_readme_profile_commands_resolve_their_shapes(capsys):
    """Every profile_gpu.py command in the README and the docs pages parses and resolves its shapes: run
    analytically (a shape solver tightened after a command was written once left the CPU table's command
    failing). The commands live in docs/training.md (analytic, GPU sweep) and docs/speed.md (CPU table, bench)."""
    import re
    from pathlib import Path
    here = Path(__file__).resolve().parents[1]
    text = "\n".join(p.read_text() for p in [here / "README.md", *sorted((here / "docs").glob("*.md"))])
    cmds = [c.split("#")[0].split() for c in re.findall(r"^(?:OMP_NUM_THREADS=1 )?python profile_gpu\.py(.*)$", text, re.M)]
    assert len(cmds) >= 4
    for argv in cmds:
        if "--bench" in argv:
            continue
        keep = [a for a in argv if a != "--json"]
        assert profile_gpu.main([*keep, "--analytic-only"]) in (None, 0), argv
    capsys.readouterr()


def test_gpu_peak_tells_the_h100_variants_apart():
    """MFU's peak: the H100's PCIe (756) and NVL (835) variants are not the SXM's 989 bf16 TFLOP/s."""
    peaks = {name: costs.gpu_peak(name) for name in
             ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla T4"]}
    assert peaks == {"NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12, "NVIDIA H100 80GB HBM3": 989e12,
                     "NVIDIA H200": 989e12, "Tesla T4": None}


def test_a_failing_training_step_keeps_the_prefill_numbers(monkeypatch):
    """measure() times the prefill and the training step in separate windows: an error (on a GPU, running out
    of memory) in the step leaves the prefill's numbers, and the row says what failed."""
    job = {"device": "cpu", "batch": 2, "seq": 16, "threads": 1, "vocab": 64, "n_layer": 2, "d_model": 32,
           "heads": 4, "kv_heads": 2, "d_ff": 96, "residual": "hc", "residual_args": {}, "kernels": "fast",
           "dtype": "fp32", "repeats": 1}

    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(torch.Tensor, "backward", out_of_memory)
    got = profile_gpu.measure(job)
    assert got["fwd_ms"] > 0 and got["peak_mem_bytes"] > 0 and "fwdbwd_ms" not in got
    assert got["error"].startswith("train: OutOfMemoryError")


def test_memory_formulas_by_hand():
    """docs/training.md#memory written out: a block keeps 30 d + 8 d_ff + 4 d_kv + 4 heads + 8 bytes a token in eager
    bf16 (14, 6, 4, 4, 8 compiled) plus the design's a d + b (its act_bytes), a hybrid its deep design's; the rest
    of the model 10 d + 4 V + 4 with a one-chunk loss, 10 d + 4 without; the fixed part is 20 bytes a parameter, or
    under FSDP2 over W ranks 16 p / W + 8 (p - blocks) + 16 blocks / L."""
    from types import SimpleNamespace as Run
    run = Run(d_model=64, d_ff=176, n_head=4, n_kv_head=2, residual="moda", residual_args={}, world_size=1, fsdp=False,
              n_layer=8, vocab_size=100, batch_size=2, seq_len=32)
    a, b, e, f = RESIDUALS["moda"].act_bytes["bf16"]
    assert costs.token_bytes(run, "bf16") == (30 * 64 + 8 * 176 + 4 * 32 + 4 * 4 + 8 + a * 64 + b,
                                              10 * 64 + 4 * 100 + 4 + e * 64 + f)
    a, b, e, f = RESIDUALS["attnres"].act_bytes["compiled"]
    run.residual, run.residual_args, run.vocab_size, run.seq_len = "hybrid", {"deep": "attnres"}, 50304, 2048
    assert costs.token_bytes(run, "compiled") == (14 * 64 + 6 * 176 + 4 * 32 + 4 * 4 + 8 + a * 64 + b,
                                                  10 * 64 + 4 + e * 64 + f)         # the loss in chunks: no V term
    assert costs.fixed_bytes(run, 1000, 800) == 20 * 1000
    run.world_size = 4
    assert costs.fixed_bytes(run, 1000, 800) == 20 * 1000                      # DDP: every rank holds it all
    run.fsdp = True
    assert costs.fixed_bytes(run, 1000, 800) == 16 * 1000 / 4 + 8 * 200 + 16 * 800 / 8


@pytest.mark.parametrize("residual, args", [("preln", {}), ("mhc", {"n_streams": 3}), ("moda", {}),
                                            ("block_attnres", {"n_groups": 2}), ("mudd", {})])
def test_run_params_is_the_built_models_count(residual, args):
    """costs.run_params (on the meta device) counts what the model built from the run has: GQA, a vocab not a
    multiple of anything, the design's options."""
    from types import SimpleNamespace as Run
    run = Run(n_layer=3, d_model=32, d_ff=96, n_head=4, n_kv_head=2, vocab_size=77, residual=residual,
              residual_args=args)
    model = GPT(GPTConfig(vocab_size=77, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=96, residual=residual,
                          residual_args=args))
    assert costs.run_params(run) == model.num_params()


def test_analytic_row_composes_the_designs_cost():
    """costs.analytic with the design's options and GQA: the overhead is the design's own cost with the same options
    and kv ratio; training is 3 x (formula A + head + overhead) per token; the defaults are one sequence of bf16
    weights; d_ff defaults to the backbone's rule."""
    row = costs.analytic("moda", n_layer=4, d_model=64, seq=32, vocab=100, params=1000, kv_ratio=0.5)
    over, _ = RESIDUALS["moda"].cost(4, 64, 32, kv_ratio=0.5)
    assert row["residual_overhead_flops"] == over != RESIDUALS["moda"].cost(4, 64, 32)[0]
    assert row["train_flops_per_token"] == 3 * (row["prefill_flops_head"] + over) / 32
    assert row["weight_bytes"] == 2000 and row["kv_cache_bytes_batch"] == row["kv_cache_bytes"]
    grouped = costs.analytic("block_attnres", n_layer=4, d_model=64, seq=32, vocab=100, params=1000,
                             options={"n_groups": 2})
    assert grouped["residual_overhead_flops"] == RESIDUALS["block_attnres"].cost(4, 64, 32, n_groups=2)[0]
    assert grouped["residual_overhead_flops"] != costs.analytic("block_attnres", n_layer=4, d_model=64, seq=32,
                                                                vocab=100, params=1000)["residual_overhead_flops"]
    import shapes
    wide = costs.analytic("preln", n_layer=4, d_model=64, seq=32, vocab=100, params=1000, d_ff=shapes.ffn_dim(64))
    assert wide == costs.analytic("preln", n_layer=4, d_model=64, seq=32, vocab=100, params=1000)


def test_kernel_profile_counts_a_designs_extra_kernels():
    """--kernel-profile's row fields on the CPU: the leaf aten ops of one training step (the CPU proxy of a GPU's
    launches, the rule scripts/kernel_count.py shares), more for HC than for Pre-LN; no busy share without a GPU."""
    job = {"device": "cpu", "batch": 2, "seq": 16, "threads": 1, "vocab": 64, "n_layer": 2, "d_model": 32,
           "heads": 4, "kv_heads": 4, "d_ff": 96, "residual_args": {}, "kernels": "fast", "dtype": "fp32",
           "repeats": 1, "kernel_profile": True}
    got = {r: profile_gpu.measure({**job, "residual": r}) for r in ("preln", "hc")}
    assert 0 < got["preln"]["kernels"] < got["hc"]["kernels"]
    assert got["preln"]["kernel_ms"] is None and "error" not in got["hc"]
    for row in got.values():                       # where the time goes: the most first, views aside, within the count
        top = row["top_kernels"]
        assert 0 < len(top) <= profile_gpu.TOP_KERNELS and [t["ms"] for t in top] == sorted((t["ms"] for t in top),
                                                                                            reverse=True)
        assert all(t["name"].startswith("aten::") and t["name"] not in profile_gpu.NO_KERNEL for t in top)
        assert all(t["calls"] >= 1 for t in top)
    assert "aten::mm" in [t["name"] for t in got["preln"]["top_kernels"]]        # its GEMMs, among the most time

