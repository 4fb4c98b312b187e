"""scripts/kernel_probe.py and depthbench/reports/compiled_code.py: the compiler's account of the Triton kernels, read on a
CPU. The readers on hand-written SASS and TTIR (loops, trips from a launch's ints, occupancy by hand), the
extrapolation in depth, the exit 2 where the tools are missing; slow: a real compile of HC's kernels at a tiny shape.

    python -m pytest -q -m "not slow" tests/test_probe.py       # ~5 s: nothing compiled
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_probe  # noqa: E402  (scripts/ is not a package)
from depthbench.reports import compiled_code as cc  # noqa: E402

# a kernel of 3 instructions, a loop over n of 4 (a barrier, a 128-bit load, an FFMA), a nested loop of 2 (an FADD),
# then a 16-bit load, a store and EXIT; the trailing self-branch and NOP are padding
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R6, SR_TID.X ;
        /*0020*/                   MOV R2, RZ ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDG.E.128 R4, desc[UR8][R10.64] ;
        /*0050*/                   FADD R3, R3, R4 ;
        /*0060*/              @!P1 BRA 0x50 ;
        /*0070*/                   FFMA R2, R4, R5, R2 ;
        /*0080*/              @!P0 BRA 0x30 ;
        /*0090*/              @!P0 LDG.E.U16 R6, desc[UR8][R4.64] ;
        /*00a0*/                   STG.E desc[UR8][R4.64], R2 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
        /*00d0*/                   NOP;
"""
# its TTIR: the outer loop over n (an argument), the inner over cdiv(D, 128) with D an argument, a bf16 dot inside
TTIR = """
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %c127_i32 = arith.constant 127 : i32 loc(#loc1)
    %c128_i32 = arith.constant 128 : i32 loc(#loc1)
    %0 = arith.addi %D, %c127_i32 : i32 loc(#loc2)
    %1 = arith.divsi %0, %c128_i32 : i32 loc(#loc2)
    scf.for %j = %c0_i32 to %n step %c1_i32  : i32 {
      %d = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<16x32xbf16> * tensor<32x64xbf16> -> tensor<16x64xf32> loc(#loc3)
      scf.for %k = %c0_i32 to %1 step %c1_i32  : i32 {
        %x = arith.addf %y, %z : tensor<128xf32> loc(#loc4)
      } loc(#loc5)
    } loc(#loc6)
"""


def variant(warps=4, registers=40, shared=0):
    sass = cc.read_sass(SASS)
    loops, dots, definitions = cc.read_ttir(TTIR)
    return cc.Variant("m:k", registers, 0, 0, shared, warps, 3, sass, loops, dots, definitions,
                      cc.match_loops(sass, loops, definitions), 0)


def test_the_sass_reader_finds_the_loops_their_bodies_and_the_widths():
    """Two backward branches: the loop 0x30-0x80 (BAR, LDG.128, FFMA, its branch: 4 without the inner loop) holds
    0x50-0x60 (FADD, branch: 2); 5 instructions outside (3 before, the 16-bit load, the store, EXIT = 6, less
    none); the padding after EXIT is left out; one barrier in the outer body, none in the inner."""
    sass = cc.read_sass(SASS)
    assert [(x.start, x.end, x.instructions, x.barriers, x.parent) for x in sass.loops] == [
        (0x30, 0x80, 4, 1, -1), (0x50, 0x60, 2, 0, 0)]
    assert sass.outside == 6
    assert sass.loads == {128: 1, 16: 1}
    assert sass.memory == {0: 16, -1: 2 + 4}        # bytes a thread names: the 128-bit load in the loop; U16 + STG
    assert sass.flops == {0: {"FFMA": 1}, 1: {"FADD": 1}}


# a spill inside a loop (STL before its work, LDL after), a stack frame's store and load outside it
SPILLING = """
        /*0000*/                   STL [R1], R2 ;
        /*0010*/                   STL.64 [R1+0x8], R6 ;
        /*0020*/                   FADD R3, R3, R4 ;
        /*0030*/                   LDL R5, [R1+0x4] ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   LDL.64 R6, [R1+0x8] ;
        /*0060*/                   EXIT ;
"""


def test_local_memory_accesses_are_counted_inside_and_outside_loops():
    """STL and LDL (any width) are local memory: 2 in the loop 0x10-0x40 (a spill each iteration pays), 2 outside;
    the reader of a kernel without them (SASS above) finds none."""
    assert cc.read_sass(SPILLING).local == {0: 2, -1: 2}
    assert cc.read_sass(SASS).local == {}


def test_trips_come_from_the_launch_ints_through_the_ttir():
    """At n = 7 and D = 640 (cdiv 5): a thread executes 6 + 7 x 4 + 7 x 5 x 2 = 104 instructions, 7 x 2 + 7 x 5 =
    49 fp32 FLOPs, 7 x 16 + 6 bytes; the dot (16 x 64 x 32, bf16) runs 7 times a program. At D = 512: 4 inner trips."""
    v = variant()
    assert v.matched == {0: 0, 1: 1}
    assert cc.per_thread(v, {"n": 7, "D": 640}) == (104, 49, 7 * 16 + 6, True)
    assert cc.per_thread(v, {"n": 7, "D": 512})[0] == 6 + 28 + 7 * 4 * 2
    assert cc.dot_flops(v, {"n": 7, "D": 640}) == {"bf16": 2 * 16 * 64 * 32 * 7}
    instructions, _, _, known = cc.per_thread(v, {"D": 640})      # n unknown: each loop counted once, and said so
    assert (instructions, known) == (6 + 4 + 5 * 2, False)


def test_unmatched_loops_count_once():
    """A SASS with one loop against a TTIR with two dynamic ones: no pairing, trips 1, trips_known False."""
    sass = cc.read_sass(SASS.replace("@!P1 BRA 0x50", "@!P1 BRA 0x70"))     # the inner branch now goes forward
    loops, dots, definitions = cc.read_ttir(TTIR)
    assert cc.match_loops(sass, loops, definitions) == {}


def test_a_do_not_specialize_parameter_is_recorded_as_the_jit_sees_it():
    """An int argument equal to 1 is a constexpr to the JIT, unless the kernel names it in do_not_specialize
    (`_chunk_backward`'s n1): then it stays an i32 argument without a divisibility hint, and its value is kept."""
    pytest.importorskip("triton")

    def kernel(x, n, m, BLOCK: "tl.constexpr"):
        pass
    signature, constexprs, aligned, ints, options = kernel_probe.describe(kernel, (1, 1, 32), {"BLOCK": 4,
                                                                          "num_warps": 8}, unspecialised=("n",))
    assert constexprs == {"x": 1, "BLOCK": 4} and signature["n"] == "i32" and signature["x"] == "constexpr"
    assert aligned == ["m"] and ints == {"x": 1, "n": 1, "m": 32} and options == {"num_warps": 8}


def test_occupancy_and_waves_by_hand():
    """65,536 registers: 241 (-> 248) x 32 x 8 warps = 63,488 fits once; 128 x 8 twice; 64 x 4 eight times; 100 KB
    of shared memory (+ 1 KB reserved) twice in 228 KB; 16 warps of 64 four times; a tiny kernel at the 32 cap.
    Waves: 4,096 programs at 2 CTAs on 132 SMs: ceil(4096 / 264) = 16; 256 at 1: 2."""
    assert cc.ctas_per_sm(241, 8, 0) == 1 and cc.ctas_per_sm(128, 8, 0) == 2 and cc.ctas_per_sm(64, 4, 0) == 8
    assert cc.ctas_per_sm(32, 4, 100 * 1024) == 2
    assert cc.ctas_per_sm(16, 16, 0) == 4 and cc.ctas_per_sm(8, 1, 0) == 32
    assert cc.waves(4096, 2) == 16 == math.ceil(4096 / (132 * 2)) and cc.waves(256, 1) == 2


def test_evaluate_follows_scalar_arithmetic_and_stops_at_the_unknown():
    defs = {"%a": ("constant", "10"), "%b": ("ceildivsi", "%N, %a"), "%c": ("minsi", "%b, %a"),
            "%p": ("muli", "%pid, %a")}
    assert cc.evaluate("%b", defs, {"N": 95}) == 10 and cc.evaluate("%c", defs, {"N": 500}) == 10
    assert cc.evaluate("%p", defs, {"N": 1}) is None                      # not defined: not known
    loops, _, found = cc.read_ttir("    %pid = tt.get_program_id x : i32 loc(#loc1)\n"
                                   "    %c1_i32 = arith.constant 1 : i32 loc(#loc1)\n"
                                   "    scf.for %t = %pid to %N step %P  : i32 {\n    } loc(#loc2)\n")
    assert cc.trip_count(loops[0], found, {"N": 100, "P": 8}) == 13      # a grid-stride loop: program 0's trips


def row(design="hc", kernel="k", **fields):
    base = dict(design=design, kernel=kernel, variants=1, launches=2, registers=32, spills=0, shared=0, warps=4,
                ctas_per_sm=16, worst_ctas_per_sm=16, bulk_launches=2, programs=10, waves=1, async_copies=0, loads={}, loop_instructions=0, loop_barriers=0,
                warp_instructions=0.0, fp32_flops=0.0, dot_flops={}, access_bytes=0.0, trips_known=True, arguments=5)
    return kernel_probe.KernelRow(**{**base, **fields})


def test_extrapolation_in_depth_is_the_polynomial_through_the_depths():
    """Per-step totals a + b L + c L^2 recorded at L = 2, 3, 4 give the same polynomial at L = 70 (and launches
    linear in L stay exact); the compiled facts are the deepest recording's."""
    def quadratic(L):
        return 5 + 3 * L + 2 * L * L
    rows_at = {L: [row(launches=2 * L, warp_instructions=quadratic(L), registers=30 + L,
                       dot_flops={"bf16": 4.0 * L})] for L in (2, 3, 4)}
    out, = kernel_probe.extrapolate(rows_at, 70)
    assert out.launches == 140 and out.warp_instructions == pytest.approx(quadratic(70))
    assert out.dot_flops["bf16"] == pytest.approx(280) and out.registers == 34


def test_missing_tools_exit_2_in_one_line(tmp_path):
    """--tools pointing at a folder without ptxas: exit 2, one line naming what is missing, no traceback."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_probe.py"), "--designs", "hc", "--tools",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "ptxas" in done.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_probe.py"), "--designs", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


TINY = {"layers": 1, "width": 64, "heads": 4, "batch": 1, "seq": 16}
# run where triton compiles (not interpreted: conftest sets TRITON_INTERPRET=1 for this process): HC at TINY probed,
# and the facts of _depth_fwd's variant the test checks
COMPILE = f"""
import json, math, sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
import kernel_probe as kp
from dataclasses import asdict
from depthbench.reports import compiled_code as cc
launches = kp.record("hc", {TINY})
variants = {{}}
rows = kp.probe_design("hc", {TINY}, kp.find_tools(), variants, log=lambda line: None)
depth = next(x for x in launches if x.kernel.endswith(":_depth_fwd"))
v = variants[depth.key()]
per_tile = [cc.per_thread(v, {{**depth.ints, "D": tiles * depth.constexprs["BD"]}})[0] for tiles in (1, 2)]
print(json.dumps({{"rows": [asdict(r) for r in rows], "kernels": sorted({{x.kernel.split(":")[1] for x in launches}}),
                  "programs": math.prod(depth.grid), "registers": v.registers, "warps": v.warps, "shared": v.shared,
                  "loops": [x.instructions for x in v.sass.loops], "matched": v.matched, "per_tile": per_tile,
                  "arguments": sum(k != "constexpr" for k in depth.signature.values())}}))
"""


@pytest.mark.slow
def test_hcs_kernels_compiled_for_sm90_at_a_tiny_shape():
    """HC at L1 d64 (16 tokens) compiled for sm_90: each of its four kernels launches once a sublayer (2 a step, as
    triton_hc.traffic counts its Triton rows), uses registers and spills none; _depth_fwd's CTAs per SM and waves
    follow the formulas from its own registers, warps and shared memory; its one loop, over D by BD, runs cdiv(D, BD)
    times: one more D tile adds exactly the loop's body to each thread's instructions. ~1-2 min (4 compiles)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kernels"] == ["_depth_bwd", "_depth_fwd", "_hc_bwd", "_hc_fwd"]
    for r in got["rows"]:
        assert r["launches"] == 2 * TINY["layers"] and r["registers"] > 0 and r["spills"] == 0 and r["trips_known"]
        assert r["warp_instructions"] > 0
    row = next(r for r in got["rows"] if r["kernel"] == "_depth_fwd")
    assert row["ctas_per_sm"] == cc.ctas_per_sm(got["registers"], got["warps"], got["shared"])
    assert row["waves"] == cc.waves(got["programs"], row["ctas_per_sm"]) and row["arguments"] == got["arguments"]
    assert len(got["loops"]) == 1 and got["matched"] == {"0": 0}
    assert got["per_tile"][1] - got["per_tile"][0] == got["loops"][0] > 0


FIT = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
import kernel_probe as kp
tools, variants = kp.find_tools(), {{}}
rows_at = {{L: kp.probe_design("moda", {{**{TINY}, "layers": L}}, tools, variants, log=lambda line: None)
           for L in (2, 3, 4)}}
fit = kp.extrapolate(rows_at, 6)
direct = kp.probe_design("moda", {{**{TINY}, "layers": 6}}, tools, variants, log=lambda line: None)
print(json.dumps({{r.kernel: [r.launches, r.warp_instructions] for r in fit}}))
print(json.dumps({{r.kernel: [r.launches, r.warp_instructions] for r in direct}}))
"""


@pytest.mark.slow
def test_modas_step_extrapolated_in_depth_equals_its_recording():
    """MoDA's consumer b reads 2b slots, so its kernels' step totals are quadratics in L: the quadratic through L2, 3
    and 4 gives L6's launches exactly and its warp-instructions within 0.5% of a recording at L6 (what the card's
    table relies on, at L70). Exactly for the depth passes; the slot pass since its re-tiling (32 rows a program,
    pipelined) carries a small term the quadratic does not: 48 of 48,608 warp-instructions at L6 here. ~1-2 min."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", FIT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    fit, direct = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert sorted(fit) == sorted(direct) == ["_depth_backward", "_depth_forward", "_slot_backward"]
    for kernel, (launches, instructions) in direct.items():
        assert fit[kernel][0] == launches == 5 and fit[kernel][1] == pytest.approx(instructions, rel=5e-3)
    assert fit["_depth_forward"][1] == pytest.approx(direct["_depth_forward"][1], rel=1e-9)


@pytest.mark.slow
def test_the_host_runs_time_the_step_eager_and_compiled_per_block(tmp_path):
    """--host-only at L3 for Pre-LN, HC and Full AttnRes: every step time is positive; compiled per block (train.py's
    scope, inductor on this CPU, launches no-ops) HC's read and write are ops in its block's graph, so dynamo meets no
    graph break compiling it, as for Pre-LN, while Full AttnRes' bank (torch.compiler.disable) breaks it; HC's
    compiled step, which runs its host functions beside Pre-LN's work, takes longer than Pre-LN's; roofline's host
    term from the document is the compiled one. ~30-60 s."""
    pytest.importorskip("triton")
    path = tmp_path / "host.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_probe.py"), "--host-only", "--designs",
                           "hc,attnres", "--layers", "3", "--json", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled per block" in done.stdout
    host = json.loads(path.read_text())["host"]
    designs = host["designs"]
    assert sorted(designs) == ["attnres", "hc", "preln"]
    for h in designs.values():
        assert h["eager_ms"] > 0 and h["compiled_ms"] > 0 and h["compiled_graphs"] >= 1
    assert designs["preln"]["compiled_breaks"] == designs["hc"]["compiled_breaks"] == 0
    assert designs["attnres"]["compiled_breaks"] > 0
    assert designs["hc"]["compiled_ms"] > designs["preln"]["compiled_ms"]
    import roofline
    term = roofline.host_time("hc", [], host, {"layers": 3})
    assert term["compiled"] and term["total"] == pytest.approx(
        (designs["hc"]["compiled_ms"] - designs["preln"]["compiled_ms"]) / 1e3)


def test_the_table_shows_the_bulk_variant_and_the_worst_beside_it():
    """A kernel whose launches compile to two specialisations (HC's read backward: bf16 streams, and sublayer 0's
    fp32 ones) is shown at the variant that issues most of the step, the other's fewer CTAs beside it with its
    launches; one variant: a plain number."""
    two = row(launches=140, ctas_per_sm=2, worst_ctas_per_sm=1, bulk_launches=139)
    assert kernel_probe.ctas_column(two) == "2 (1 x 1)"
    assert kernel_probe.ctas_column(row()) == "16"
