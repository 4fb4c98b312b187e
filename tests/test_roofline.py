"""scripts/roofline.py, the H200 step estimate without a GPU: its arithmetic on cases checkable by hand, its
calibration reproducing the rows it was fitted on, the plug-in point of the Triton modules' traffic() functions,
the time model (each probed kernel's bytes its own traffic rows, the committed docs/kernel_probe*.json against the
rows' tags) and the GPU path's peak memory (GPU_ACT_BYTES against a fresh measurement under the interpreter: slow).

    python -m pytest -q -m "not slow" tests/test_roofline.py       # ~3 s: no model is built
"""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import roofline  # noqa: E402  (scripts/ is not a package)

ONE = {"layers": 1, "width": 3, "seq": 1, "batch": 1, "vocab": 1, "heads": 1}


def test_slots_and_flops_by_hand():
    """The counts a reader can redo: Full AttnRes at L1 has consumers reading 1, 2 and 3 sources (6 slots); Block
    AttnRes at L2 with 8 groups (each sublayer its own group, k * 8 // 4 = 2k) reads 2 + 2k at k = 0..4 (30); HC 4
    streams x 6 sublayers at L3 (24); MoDA 2b at b = 0, 1, 2 (6). The backbone at L1 d3 T1 B1 V1 (d_ff 16):
    3 x 2 x (4 d^2 + 3 d d_ff + d V) = 6 x 183 GEMM FLOPs and 3.5 x 2 x 2 x T^2 / 2 x d = 21 attention FLOPs."""
    assert roofline.slots_read("attnres", 1) == 6
    assert roofline.slots_read("block_attnres", 2) == 30
    assert roofline.slots_read("hc", 3) == roofline.slots_read("mhc", 3) == 24
    assert roofline.slots_read("moda", 3) == 6 and roofline.slots_read("preln", 3) == 0
    assert roofline.d_ff(3) == 16 and roofline.d_ff(640) == 1712  # shapes.ffn_dim's rule
    assert roofline.flops(ONE) == (6 * 183, 21)
    # bytes: passes x slots x B T d x element bytes = 2 x 6 x 3 x 2
    assert roofline.mixing_bytes("attnres", ONE, {"attnres": 2}, 2) == 72


def test_the_card_bound_matches_the_notes():
    """gpu-h200.md's last table at L70 d640 B2 T2048 in bf16: Full AttnRes reads 10,011 slots of 5.2 MB twice
    (105 GB), HC n = 4 streams three passes forward and backward (18 GB), MoDA 4 passes (101 GB)."""
    gb = {d: roofline.mixing_bytes(d, roofline.CARD, roofline.FUSED_PASSES, 2) / 1e9 for d in ("attnres", "hc", "moda")}
    assert roofline.slots_read("attnres", 70) == 10011
    assert gb["attnres"] == pytest.approx(105, abs=0.5) and gb["hc"] == pytest.approx(17.6, abs=0.5)
    assert gb["moda"] == pytest.approx(101, abs=0.5)


def test_step_is_the_sum_of_its_terms():
    """With hand-picked constants, today's step of Full AttnRes at L70 is the backbone's time plus its fp32 bytes over
    eta x peak plus its kernels x tau: each term computed here from the tables, independently of step_today's code."""
    c = {"F_gemm": 1e15, "F_attn": 5e14, "c_elem": 1e-12, "tau": 1e-5, "fusion": 2.0, "eta": 0.5, "hbm": 4.8e12}
    shape = {**roofline.CARD, "batch": 1}
    gemm, attention = roofline.flops(shape)
    slot32 = 1 * 2048 * 640 * 4
    expect = (gemm / 1e15 + attention / 5e14 + 1e-12 * 70 * 2048 * 640
              + roofline.TODAY_PASSES["attnres"] * 10011 * slot32 / (0.5 * roofline.PEAK_HBM)
              + roofline.CPU_KERNELS_L70["attnres"] * 2.0 * 1e-5)
    assert roofline.step_today("attnres", shape, c) == pytest.approx(expect, rel=1e-12)


def test_hc_and_mhc_take_pre_lns_norm_and_add_out_of_the_backbone(monkeypatch):
    """The GPU path of HC and mHC is the backbone and Pre-LN's kernels, less Pre-LN's norm and add (34 bytes a
    sublayer, token and channel at the GPU path's eta; 2 launches a sublayer), plus their traffic; MoDA, whose kernels
    keep Pre-LN's norm and add, takes nothing out. Each term here from a fake traffic and the constants by hand."""
    fake = types.ModuleType("depthbench.kernels.triton_hc")
    fake.traffic = lambda design, tokens, d_model: [{"read": 1000 * tokens * d_model, "written": 0, "launches": 5}]
    monkeypatch.setitem(sys.modules, "depthbench.kernels.triton_hc", fake)
    c = {"F_gemm": 1e15, "F_attn": 5e14, "c_elem": 1e-12, "tau": 1e-5, "fusion": 2.0, "eta": 0.5, "eta_gpu": 0.8,
         "hbm": 4.8e12}
    shape = {**roofline.CARD, "layers": 3}
    tokens, sublayers = shape["batch"] * shape["seq"], 6
    base = roofline.backbone(shape, c) + roofline.CPU_KERNELS_L70["preln"] * 2.0 * 3 / 70 * 1e-5
    for design in ("hc", "mhc"):
        r = roofline.estimate(design, shape, c)
        moved = sublayers * tokens * 640 * (1000 - 34)
        expect = base + sublayers * (5 - 2) * 1e-5 + moved / (0.8 * roofline.PEAK_HBM)
        assert r["gpu_ms"] == pytest.approx(1e3 * expect)
        assert r["replaced_launches"] == 12 and r["gpu_mix_bytes"] == sublayers * 1000 * tokens * 640
    assert roofline.replaced("moda", shape) == (0, 0) and roofline.replaced("attnres", shape) == (0, 0)


def test_each_gpus_bandwidth_by_name_and_the_gpus_the_model_estimates():
    """HBM peaks by device name (kernel_bench's eta divides by them): an H100 PCIe is not taken for the SXM part
    (whose name is in its), an H200 is not an H100, an unknown device has none; the model estimates the H200 and the
    H100 SXM only (the PCIe part differs in compute too)."""
    peak, gpu = roofline.hbm_peak, roofline.model_gpu
    assert peak("NVIDIA H100 PCIe") == 2.0e12 and peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak("NVIDIA H200") == 4.8e12 and peak("CPU (Triton's interpreter)") is None
    assert gpu("NVIDIA H100 80GB HBM3") == "H100" and gpu("NVIDIA H200") == "H200"
    assert gpu("NVIDIA H100 PCIe") is None and gpu("NVIDIA H100 NVL") is None and gpu("none") is None


def test_an_h100_is_the_h200_model_with_its_bandwidth():
    """calibrate(gpu="H100"): the H200's fit (GEMM, attention, tau, eta) kept, the backbone's elementwise term and
    every HBM term scaled by 4.8 / 3.35 (the bandwidth-bound parts), so at the card a design's step grows by
    exactly those parts: checked against the H200's terms by hand."""
    h200, h100 = roofline.calibrate(), roofline.calibrate(gpu="H100")
    assert all(h100[k] == h200[k] for k in ("F_gemm", "F_attn", "tau", "eta", "fusion"))
    assert h100["hbm"] == 3.35e12 and h100["c_elem"] == pytest.approx(h200["c_elem"] * 4.8 / 3.35)
    card, ratio = roofline.CARD, 4.8 / 3.35
    elem = h200["c_elem"] * roofline.activations(card)
    for design in ("preln", "hc", "moda"):
        a, b = roofline.estimate(design, card, h200), roofline.estimate(design, card, h100)
        mixing = (a["gpu_mix_bytes"] - a["replaced_bytes"]) / (0.8 * roofline.PEAK_HBM)    # Pre-LN's: none
        assert b["gpu_ms"] - a["gpu_ms"] == pytest.approx(1e3 * (ratio - 1) * (elem + mixing), rel=1e-9)
    with pytest.raises(ValueError, match="models H200, H100"):
        roofline.calibrate(gpu="A100")


@pytest.mark.parametrize("fit_on", ["hc", "mhc", "attnres", "moda"])
def test_calibration_reproduces_the_rows_it_was_fitted_on(fit_on):
    """Fitted on Pre-LN's row and one more, the model gives back Pre-LN's step, busy time and kernels, and the other
    row's step, as measured (the rows it did not fit on are predictions: their errors are reported, not bounded)."""
    c = roofline.calibrate(fit_on)
    card, measured = roofline.CARD, roofline.MEASURED
    assert 1e3 * roofline.step_today("preln", card, c) == pytest.approx(measured["preln"]["step_ms"], rel=1e-9)
    assert 1e3 * roofline.backbone(card, c) == pytest.approx(measured["preln"]["busy_ms"], rel=1e-9)
    assert roofline.today_kernels("preln", card, c["fusion"]) == pytest.approx(measured["preln"]["kernels"])
    assert 1e3 * roofline.step_today(fit_on, card, c) == pytest.approx(measured[fit_on]["step_ms"], rel=1e-9)
    assert 0 < c["eta"] <= 1  # a physical fraction of HBM bandwidth (block_attnres' row gives none: see --loo)


def test_a_gpu_module_traffic_replaces_the_analytic_bound(monkeypatch, capsys):
    """Where depthbench.kernels.triton_hc imports, its per-sublayer traffic() rows (x 2L sublayers) are the HC path's
    bytes and extra launches; where it does not, the analytic bound is used, named, and said once on stderr."""
    monkeypatch.setitem(sys.modules, "depthbench.kernels.triton_hc", None)  # import fails: the analytic bound
    monkeypatch.setattr(roofline, "FALLBACKS", set())
    shape = {**ONE, "layers": 3}
    assert roofline.gpu_traffic("hc", shape) == (6 * 24 * 3 * 2, 6 * 6, "analytic bound")
    assert roofline.gpu_traffic("hc", shape)[2] == "analytic bound"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("roofline: hc's GPU path from the analytic bound ("), said
    fake = types.ModuleType("depthbench.kernels.triton_hc")
    fake.traffic = lambda design, tokens, d_model: [{"read": 10 * tokens, "written": d_model, "launches": 2}]
    monkeypatch.setitem(sys.modules, "depthbench.kernels.triton_hc", fake)
    assert roofline.gpu_traffic("mhc", shape) == (6 * (10 + 3), 6 * 2, "depthbench.kernels.triton_hc.traffic")


@pytest.mark.slow
def test_the_command_prints_every_design_and_refuses_bad_shapes():
    ok = subprocess.run([sys.executable, "scripts/roofline.py", "--loo"], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert all(f"| {d} |" in ok.stdout for d in roofline.DESIGNS) and "eta fitted on mhc" in ok.stdout
    bad = subprocess.run([sys.executable, "scripts/roofline.py", "--batch", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    timed = ok.stdout.split("time model, H100 SXM")[1]          # docs/kernel_probe*.json: every design, its terms
    assert all(f"| {d} | " in timed for d in roofline.DESIGNS) and "(issue)" in timed and "(bytes)" in timed
    gone = subprocess.run([sys.executable, "scripts/roofline.py", "--probe", "nowhere.json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2 and len(gone.stderr.strip().splitlines()) == 1


def test_the_gpu_path_peak_is_the_measured_peak_moved_by_what_the_paths_keep(monkeypatch):
    """At the card's shape the GPU path's peak is today's measured peak plus tokens x (GPU_ACT_BYTES - today's
    act_bytes), in the L (a d + b) + e d + f form; none at another shape; a design whose predicted peak exceeds its
    measured one does not meet the targets."""
    from residuals import RESIDUALS
    card, tokens = roofline.CARD, roofline.CARD["batch"] * roofline.CARD["seq"]
    assert roofline.gpu_peak_gb("preln", card) == roofline.MEASURED["preln"]["peak_gb"]
    a, b, e, f = (x - y for x, y in zip(roofline.GPU_ACT_BYTES["hc"], RESIDUALS["hc"].act_bytes["compiled"]))
    by_hand = roofline.MEASURED["hc"]["peak_gb"] + tokens * (70 * (a * 640 + b) + e * 640 + f) / 1e9
    assert roofline.gpu_peak_gb("hc", card) == pytest.approx(by_hand, rel=1e-12)
    assert roofline.gpu_peak_gb("hc", {**card, "batch": 8}) is None
    c = roofline.calibrate()
    assert roofline.table(card, c, ["preln", "attnres"])["attnres"]["meets"]
    monkeypatch.setitem(roofline.GPU_ACT_BYTES, "attnres", (40, 0, 0, 0))   # 40 d bytes more a layer: +7 GB
    row = roofline.table(card, c, ["preln", "attnres"])["attnres"]
    assert not row["memory_ok"] and not row["meets"]


@pytest.mark.slow
def test_gpu_act_bytes_reproduce_a_fresh_measurement():
    """GPU_ACT_BYTES (fitted by scripts/calibrate_memory.py --kernels triton --modes compiled) predicts what the
    Triton path keeps, measured again at one of the fit's shapes under the interpreter, for a design of each kernel
    family: a kernel that keeps more or less than when they were fitted fails here (refit them). ~30 s, one process."""
    pytest.importorskip("triton", reason="triton does not import: `pip install triton` (its interpreter runs here)")
    shape, designs = (2, 64, 176, 4, 4, 64), ["hc", "mhc", "attnres", "block_attnres", "moda"]
    code = ("import json, calibrate_memory as c; c.KERNELS = 'triton'; print(json.dumps("
            f"[c.per_token(d, {shape}, 'compiled') - c.per_token('preln', {shape}, 'compiled') for d in {designs}]))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "scripts")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = dict(zip(designs, json.loads(out.stdout.strip().splitlines()[-1])))
    for design in designs:
        predicted = roofline.kept_per_token(roofline.GPU_ACT_BYTES[design], {"layers": 2, "width": 64})
        assert measured[design] == pytest.approx(predicted, abs=1.0), design


def probe_row(kernel, **fields):
    """A kernel row of scripts/kernel_probe.py's JSON with only what the time model reads."""
    return {"design": "hc", "kernel": kernel, "launches": 2, "arguments": 10, "warp_instructions": 0.0,
            "fp32_flops": 0.0, "dot_flops": {}, "access_bytes": 1.0, **fields}


def test_a_kernels_time_is_the_largest_of_its_terms():
    """Issue rate 132 x 4 x 1.755 GHz; eta 0.5 of 2 TB/s. 2 ms of warp-instructions, 1 ms of fp32 FLOPs at 67
    TFLOP/s + 0.5 ms of bf16 dots at 989 (fp32 "ieee" dots are in the SASS' FFMAs: not added), 3 GB = 3 ms of bytes:
    bytes bind at 3 ms; at 1 GB the issue floor binds at 2 ms."""
    rate = 132 * 4 * 1.755e9
    c = {"eta_gpu": 0.5, "hbm": 2e12}
    row = probe_row("k", warp_instructions=2e-3 * rate, fp32_flops=67e12 * 1e-3,
                    dot_flops={"bf16": 989e12 * 0.5e-3, "fp32": 1e15})
    t = roofline.kernel_time(row, 3e9, c)
    assert t["binds"] == "bytes" and t["seconds"] == pytest.approx(3e-3)
    assert t["issue"] == pytest.approx(2e-3) and t["flops"] == pytest.approx(1.5e-3)
    t = roofline.kernel_time(row, 1e9, c)
    assert t["binds"] == "issue" and t["seconds"] == pytest.approx(2e-3)


def test_the_time_model_adds_each_kernels_max_and_the_host(monkeypatch):
    """HC with two Triton kernels: _a's traffic rows move 2 GB (one row), _b's 6 GB (two rows), whatever their loads
    name (1 : 3 here, 1 : 1 below: the same times); the torch ops' 1 GB is an entry of its own, bound on bytes, and its
    6 launches are at tau, less the 2L norm-and-add launches and bytes HC replaces; host: the eager step beyond
    Pre-LN's (scaled by depth), 4 launches x 10 arguments x the per-argument cost, and 1 break a block beyond Pre-LN's
    x L x the break's cost."""
    rate = 132 * 4 * 1.755e9
    c = {**roofline.calibrate("attnres", gpu="H100"), "eta_gpu": 0.5}
    shape = {**roofline.CARD, "layers": 2}
    rows = [{"launch": "_a", "read": 2e9, "written": 0, "launches": 2},
            {"launch": "_b", "read": 3e9, "written": 2e9, "launches": 1},
            {"launch": "_b", "read": 0, "written": 1e9, "launches": 1},
            {"launch": "copy", "read": 0.5e9, "written": 0.5e9, "launches": 6}]
    monkeypatch.setattr(roofline, "traffic_rows", lambda design, shape: (rows, "fake"))
    host = {"shape": {"layers": 1}, "per_argument_us": 2.0, "break_us": 100.0,
            "designs": {"preln": {"eager_ms": 10.0, "breaks_per_block": 0}, "hc": {"eager_ms": 15.0,
                                                                                   "breaks_per_block": 1}}}
    probe = {"rows": [probe_row("_a", access_bytes=1.0, warp_instructions=1e-3 * rate),
                      probe_row("_b", access_bytes=3.0)], "host": host}
    got = roofline.time_model("hc", shape, c, probe)
    bw = 0.5 * c["hbm"]
    base = roofline.backbone(shape, c) + roofline.today_kernels("preln", shape, c["fusion"]) * c["tau"]
    gone_bytes, gone_launches = roofline.replaced("hc", shape)
    kernels = max(2e9 / bw, 1e-3) + 6e9 / bw + 1e9 / bw
    device = base + (6 - gone_launches) * c["tau"] - gone_bytes / bw + kernels
    host_s = (15.0 - 10.0) / 1e3 * 2 + 4 * 10 * 2e-6 + 1 * 2 * 100e-6
    assert got["device_ms"] == pytest.approx(1e3 * device) and got["host_ms"] == pytest.approx(1e3 * host_s)
    assert got["step_ms"] == pytest.approx(1e3 * (device + host_s))
    assert [(k["kernel"], k["binds"]) for k in got["kernels"]] == [
        ("_a", "issue" if 1e-3 > 2e9 / bw else "bytes"), ("_b", "bytes"), (roofline.TORCH_OPS, "bytes")]
    assert [k["named_x"] for k in got["kernels"][:2]] == [1.0 / 2e9, 3.0 / 6e9]
    probe["rows"][1]["access_bytes"] = 1.0
    assert roofline.time_model("hc", shape, c, probe)["device_ms"] == pytest.approx(got["device_ms"], rel=1e-15)
    assert roofline.time_model("preln", shape, c, probe)["step_ms"] == pytest.approx(1e3 * base)


PROBE = roofline.load_probe(sorted(roofline.DOCS.glob("kernel_probe*.json")))
TIMED = [d for d in roofline.DESIGNS if d != "preln"]


@pytest.mark.parametrize("design", TIMED)
def test_each_probed_kernel_has_its_own_traffic_rows(design):
    """At the card's shape every traffic row of the design's step names what moves it: the tagged rows' bytes and
    launches add up to gpu_traffic's totals; the Triton tags (a leading underscore) are the kernels the committed
    probe recorded for the design, each an attribute of the kernel files, each launched as often as the probe saw it
    (MoDA's slot pass: half a launch a slot, 69.5 for 69 pairs), and none booked over twice the bytes its compiled
    loads and stores name (a row on the wrong kernel); the torch ops' tags are no kernel's name."""
    from depthbench.kernels import triton_attnres, triton_attnres_chunk, triton_hc, triton_hc_read, triton_moda
    modules = (triton_attnres, triton_attnres_chunk, triton_hc, triton_hc_read, triton_moda)
    rows, _ = roofline.traffic_rows(design, roofline.CARD)
    total, launches, _ = roofline.gpu_traffic(design, roofline.CARD)
    assert sum(r["read"] + r["written"] for r in rows) == total and sum(r["launches"] for r in rows) == launches
    probed = {r["kernel"]: r["launches"] for r in PROBE["rows"] if r["design"] == design}
    tags = {r["launch"] for r in rows}
    kernels = {tag for tag in tags if roofline.is_triton(tag)}
    assert kernels == set(probed)
    assert all(any(hasattr(m, k) for m in modules) for k in kernels)
    assert not any(hasattr(m, tag) for m in modules for tag in tags - kernels)
    for kernel, seen in probed.items():
        counted = sum(r["launches"] for r in rows if r["launch"] == kernel)
        assert abs(counted - seen) <= 0.5, (kernel, counted, seen)
    own, torch_bytes, _ = roofline.booked(design, roofline.CARD, list(probed))
    assert sum(own.values()) + torch_bytes == total
    named = {r["kernel"]: r["access_bytes"] for r in PROBE["rows"] if r["design"] == design}
    assert all(own[k] <= 2 * named[k] for k in own), own        # a kernel moves no bytes its code does not name


@pytest.mark.parametrize("design", TIMED)
def test_a_kernels_named_bytes_move_no_other_kernels_time(design):
    """Re-tiling one kernel so its loads name a fifth of the bytes (its code changed, its siblings' did not) leaves
    every kernel's modelled seconds as they were: each kernel's bytes are its own traffic rows'. (Split in proportion
    to the named bytes, as before, the siblings' ms rose.)"""
    c = {**roofline.calibrate("attnres", gpu="H100"), "eta_gpu": roofline.ETA_GPU}
    before = roofline.time_model(design, roofline.CARD, c, PROBE)["kernels"]
    for changed in [r["kernel"] for r in PROBE["rows"] if r["design"] == design]:
        rows = [dict(r, access_bytes=r["access_bytes"] / 5) if r["design"] == design and r["kernel"] == changed
                else r for r in PROBE["rows"]]
        after = roofline.time_model(design, roofline.CARD, c, {**PROBE, "rows": rows})["kernels"]
        assert [(k["kernel"], k["seconds"]) for k in after] == [(k["kernel"], k["seconds"]) for k in before], changed


def test_a_kernel_without_its_rows_is_reported_in_one_line(tmp_path, capsys):
    """A probe kernel with no traffic row, and traffic rows of a Triton kernel the probe did not record, are errors
    the model names (not a 0 ms kernel, not bytes left out); the command says so in one line and exits 2."""
    c = {**roofline.calibrate("attnres", gpu="H100"), "eta_gpu": roofline.ETA_GPU}
    ghost = dict(next(r for r in PROBE["rows"] if r["design"] == "hc"), kernel="_ghost_bwd")
    with pytest.raises(roofline.AccountError, match="hc: the probe's kernel _ghost_bwd has no traffic row"):
        roofline.time_model("hc", roofline.CARD, c, {**PROBE, "rows": PROBE["rows"] + [ghost]})
    fewer = [r for r in PROBE["rows"] if not (r["design"] == "mhc" and r["kernel"] == "_depth_bwd")]
    with pytest.raises(roofline.AccountError, match="mhc: traffic rows name Triton kernel _depth_bwd, which the probe"):
        roofline.time_model("mhc", roofline.CARD, c, {**PROBE, "rows": fewer})
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({**PROBE, "rows": PROBE["rows"] + [ghost]}))
    with pytest.raises(SystemExit) as out:
        roofline.main(["--probe", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert out.value.code == 2 and len(err) == 1 and "_ghost_bwd" in err[0], err


def test_the_host_term_is_the_compiled_step_beyond_preln_where_measured():
    """With compiled_ms for the design and Pre-LN, the host term is (design's compiled step - Pre-LN's) x the depth
    ratio + each launch's argument specialisation, its breaks inside the measurement (0 added); the eager account
    ((eager - Pre-LN's eager) x depth + arguments + breaks beyond Pre-LN's x L x a break) stays beside it; and the
    table's header names which one the model used."""
    shape = {**roofline.CARD, "layers": 4}
    host = {"shape": {"layers": 2}, "per_argument_us": 2.0, "break_us": 100.0,
            "designs": {"preln": {"eager_ms": 10.0, "compiled_ms": 6.0, "breaks_per_block": 0},
                        "attnres": {"eager_ms": 15.0, "compiled_ms": 9.0, "breaks_per_block": 3}}}
    rows = [probe_row("a", launches=5, arguments=7)]
    got = roofline.host_time("attnres", rows, host, shape)
    arguments = 5 * 7 * 2e-6
    assert got["compiled"] and got["breaks"] == 0.0
    assert got["total"] == pytest.approx((9.0 - 6.0) / 1e3 * 2 + arguments)
    assert got["eager_total"] == pytest.approx((15.0 - 10.0) / 1e3 * 2 + arguments + 3 * 4 * 100e-6)
    assert "compiled per block" in roofline.host_header({"host": host})
    del host["designs"]["preln"]["compiled_ms"]          # Pre-LN's compiled step missing: the eager account
    eager = roofline.host_time("attnres", rows, host, shape)
    assert not eager["compiled"] and eager["total"] == pytest.approx(got["eager_total"])
    assert "eager" in roofline.host_header({"host": host}).split("|")[0]


def test_the_step_as_one_cuda_graph_has_no_host_term_and_the_graphs_gap(capsys):
    """The captured table: every design's step is its device time with tau replaced by the graph's gap between
    kernels, its Triton kernels' launches at that gap too, whatever the host measured (the probe's host numbers inflated 100x change nothing); Pre-LN's is its
    backbone and its kernels at that gap; a larger gap adds the same per kernel to every design, so where a design
    launches more than Pre-LN its step grows more. The table prints each design's ratio against its target."""
    c = {**roofline.calibrate("attnres", gpu="H100"), "eta_gpu": roofline.ETA_GPU}
    designs = ["preln", *TIMED]
    slow_host = {**PROBE["host"], "designs": {d: {k: 100 * v if isinstance(v, float) else v for k, v in h.items()}
                                              for d, h in PROBE["host"]["designs"].items()}}
    got = roofline.captured_report(roofline.CARD, PROBE, c, designs, gap_s=1e-6)
    assert roofline.captured_report(roofline.CARD, {**PROBE, "host": slow_host}, c, designs, gap_s=1e-6) == got
    kernels = roofline.today_kernels("preln", roofline.CARD, c["fusion"])
    assert got["preln"]["step_ms"] == pytest.approx(1e3 * (roofline.backbone(roofline.CARD, c) + kernels * 1e-6))
    for design in TIMED:
        device = roofline.time_model(design, roofline.CARD, {**c, "tau": 1e-6}, {**PROBE, "host": None})
        launches = sum(r["launches"] for r in PROBE["rows"] if r["design"] == design)    # its Triton kernels
        assert got[design]["step_ms"] == pytest.approx(device["device_ms"] + 1e3 * launches * 1e-6)
        assert got[design]["x_preln"] == pytest.approx(got[design]["step_ms"] / got["preln"]["step_ms"])
        assert got[design]["meets"] == (got[design]["x_preln"] <= roofline.TIME_TARGETS[design])
    wider = roofline.captured_report(roofline.CARD, PROBE, c, designs, gap_s=3e-6)
    for design in TIMED:
        extra = wider[design]["step_ms"] - got[design]["step_ms"]
        assert extra > wider["preln"]["step_ms"] - got["preln"]["step_ms"], design   # each launches more than Pre-LN
    table = capsys.readouterr().out
    assert "the step as one CUDA graph" in table and f"| hc | {got['hc']['step_ms']:.1f} |" in table
