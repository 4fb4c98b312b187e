"""
The learner's path, measured (docs/contributing.md#the-learners-path): the files a reader opens and the lines read to
answer a design's state, update, init, head and parameter count, in a checkout of this repository.

    python scripts/learner_path.py                       # this checkout
    python scripts/learner_path.py --root OLD_CHECKOUT --before

A path is a list of (file, names) that the reader follows from the design's class: residuals.py's module docstring
(the trunk loop's contract), the class docstring and the methods a forward and the init run, those it inherits, and
the shared maths it calls in ops.py. A class docstring is counted whole; a function or method from its `def` to its
end. The fast bodies a forward runs by default (depthbench/kernels/cpu.py) are counted too, unless the design's class
docstring names the test that proves them equal to ops.py's (`proof`) and that test exists. --before reads the layout
before issue 54 (commit 0d9c973), where MoDA's attention is model.py's, and the docstrings name no test.
No design may take more than TARGET's files and lines (tests/test_repo.py checks it).
"""
import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path

TARGET = (2, 250)             # (files, lines) at most, for the designs in TARGETED
TARGETED = ("HC", "mHC", "Full AttnRes", "MoDA")
CONTRACT = ["<module>", "PreLN.__init__", "PreLN.build"]       # residuals.py's trunk loop; the norms every design has
HC_FORWARD = ["HC.__init__", "HC.site", "HC.init_stream", "HC.read", "HC.connect", "HC.write", "HC.collapse",
              "HC.scale_sublayer_init"]
HC_OPS = ["fp32_maths", "rms_norm", "RMSNorm", "hc_read", "normed_projection", "width_connection", "depth_connection"]
HC_FAST = ["skinny_matmul", "inv_rms", "InvRms", "normed_projection", "width_connection", "depth_connection"]
ATTNRES = ["FullAttnRes", "FullAttnRes.__init__", "FullAttnRes.site", "FullAttnRes.init_stream", "FullAttnRes.mix",
           "FullAttnRes.read", "FullAttnRes.write", "FullAttnRes.collapse", "FullAttnRes.n_sites",
           "FullAttnRes.reset_parameters"]
ATTNRES_OPS = ["fp32_maths", "rms_norm", "RMSNorm", "depth_mix", "topk_count", "DepthBank", "DepthBank.start",
               "DepthBank.push", "DepthBank.mix", "DepthBank.newest"]
ATTNRES_FAST = ["Bank", "Bank.__init__", "Bank.write", "Bank.stored", "Bank.scratch", "linear", "Push", "Push.forward",
                "Push.backward", "tokens_major", "source_dots", "Mix", "Mix.forward", "Mix.backward", "DepthBank",
                "DepthBank.__init__", "DepthBank.start", "DepthBank.push", "DepthBank.mix", "DepthBank.newest"]
BLOCK = ["BlockAttnRes", "BlockAttnRes.__init__", "BlockAttnRes.site", "BlockAttnRes.init_stream", "BlockAttnRes.read",
         "BlockAttnRes.write", "BlockAttnRes.collapse", "BlockAttnRes.groups"]
MODA = ["MoDA", "MoDA.__init__", "MoDA.site", "MoDA.init_stream", "MoDA.read", "MoDA.write", "MoDA.collapse",
        "MoDA.reset_parameters"]
MODA_OPS = ["apply_rope", "rope_cos_sin", "joint_attention", "DepthKV", "DepthKV.start", "DepthKV.push"]
MODA_FAST = ["apply_rope", "head_pad", "padded", "joint_attention", "MergeDepth", "MergeDepth.forward",
             "MergeDepth.backward", "sink_attention", "Attend", "Attend.forward", "Attend.backward", "slot_dots",
             "slot_sum", "add_outer", "DepthKV", "DepthKV.__init__", "DepthKV.start", "DepthKV.push", "DepthKV.attend"]


@dataclass(frozen=True)
class Reading:
    """One design's reading: the class whose docstring may name the proof, what is read, and the fast bodies."""
    cls: str                  # the design's class in residuals.py
    read: tuple               # ((file, [names]), ...): a name is "Class", "Class.method", "function" or "<module>"
    fast: tuple               # names in depthbench/kernels/cpu.py that its forward runs by default
    proof: str                # the test that proves those equal to ops.py's


def paths(before=False):
    """{design: Reading} of this layout, or (before) of the one before issue 54."""
    moda_read = [("residuals.py", CONTRACT + MODA + ["MoDA.attend"]), ("ops.py", MODA_OPS)]
    if before:
        moda_read = [("residuals.py", CONTRACT + MODA + ["AttentionInputs"]),
                     ("model.py", ["Attention", "Attention.forward", "Block.forward"]), ("ops.py", MODA_OPS)]
    proof = "test_fast_kernels_equal_the_reference"
    return {
        "HC": Reading("HC", (("residuals.py", CONTRACT + ["HC", "HC.make_connector", "HC.maps", "HC.reset_parameters",
                                                        "HC.no_decay_params"] + HC_FORWARD), ("ops.py", HC_OPS)),
                    tuple(HC_FAST), proof),
        "mHC": Reading("MHC", (("residuals.py", CONTRACT + ["MHC", "MHC.__init__", "MHC.make_connector", "MHC.maps",
                                                          "MHC.reset_parameters", "MHC.no_decay_params"] + HC_FORWARD),
                             ("ops.py", HC_OPS + ["sinkhorn"])),
                     tuple(HC_FAST + ["sinkhorn", "Sinkhorn", "Sinkhorn.forward", "Sinkhorn.backward"]), proof),
        "Full AttnRes": Reading("FullAttnRes", (("residuals.py", CONTRACT + ATTNRES), ("ops.py", ATTNRES_OPS)),
                              tuple(ATTNRES_FAST), proof),
        "Block AttnRes": Reading("BlockAttnRes", (("residuals.py", CONTRACT + ATTNRES + BLOCK),
                                                  ("ops.py", ATTNRES_OPS)), tuple(ATTNRES_FAST), proof),
        "MoDA": Reading("MoDA", tuple(moda_read), tuple(MODA_FAST), proof),
    }


def spans(path):
    """{name: (first line, last line)} of the module docstring, classes (their docstring only), functions, methods
    and properties of a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = {}
    if tree.body and isinstance(tree.body[0], ast.Expr):
        out["<module>"] = (tree.body[0].lineno, tree.body[0].end_lineno)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = (node.lineno - len(node.decorator_list), node.end_lineno)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = (node.lineno, node.body[0].end_lineno)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = (item.lineno - len(item.decorator_list), item.end_lineno)
    return out


def class_doc(root, cls):
    tree = ast.parse((root / "residuals.py").read_text(encoding="utf-8"))
    return next(ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)


def test_exists(root, name):
    """Whether a test of that name is defined in the checkout's test files."""
    files = [root / "test_all.py", *sorted((root / "tests").glob("test_*.py"))]
    return any(re.search(rf"^def {name}\(", f.read_text(encoding="utf-8"), re.M) for f in files if f.is_file())


def measure(root, design):
    """-> ({file: lines read}, whether the fast bodies were counted)."""
    read = list(design.read)
    proven = design.proof in class_doc(root, design.cls) and test_exists(root, design.proof)
    if not proven:  # the fast bodies' file: depthbench/kernels/cpu.py, depthbench/kernels.py before issue 56
        fast = next(f for f in ("depthbench/kernels/cpu.py", "depthbench/kernels.py") if (root / f).is_file())
        read.append((fast, list(design.fast)))
    lines = {}
    for name, wanted in read:
        table = spans(root / name)
        missing = [w for w in wanted if w not in table]
        if missing:
            raise SystemExit(f"learner_path.py: {root / name}: no {', '.join(missing)}")
        lines[name] = sum(table[w][1] - table[w][0] + 1 for w in wanted)
    return lines, not proven


def main(argv=None):
    p = argparse.ArgumentParser(prog="learner_path.py", description=__doc__.split("\n\n")[1])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="a checkout (default: this one)")
    p.add_argument("--before", action="store_true", help="the paths of the layout before issue 54")
    args = p.parse_args(argv)
    for name, design in paths(args.before).items():
        lines, fast = measure(Path(args.root), design)
        parts = ", ".join(f"{f} {n}" for f, n in lines.items())
        note = "fast bodies counted" if fast else f"fast bodies proven equal by {design.proof}"
        print(f"{name}: {len(lines)} files, {sum(lines.values())} lines ({parts}; {note})")


if __name__ == "__main__":
    main()
