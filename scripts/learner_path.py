"""
The learner's path, measured (docs/contributing.md#the-learners-path): the files a reader opens and the lines read to
answer a design's state, update, init, head and parameter count, following the path the README gives.

    python scripts/learner_path.py                       # this checkout
    python scripts/learner_path.py --root OTHER_CHECKOUT # another one (its README must name the two, as this one's)

The README's design tables say, on each design's row, "read these two": the design's class in residuals.py and its
reference forward in tests/test_equations.py, by name. The path is what those two ask of a reader:
- residuals.py: the module docstring (the trunk loop's contract) with PreLN's __init__ and build (the norms every
  design has, the sites), the class docstring, and the methods a forward and the init run, those it inherits too
  (CLASS_READ);
- tests/test_equations.py: the reference forward and every function of that file it calls, transitively (found in
  its syntax tree: the backbone's attention, MLP and norm are counted for every design).
A class docstring is counted whole; a function or method from its `def` (decorators included) to its end. ops.py and
the fast bodies (depthbench/kernels/cpu.py) are left out only where the class docstring names the test that checks
the model, under both bodies, against the reference forward (PROOF) and that test exists: then the docstring and the
reference forward together give all of the maths. Otherwise ops.py's names and the fast bodies are counted too
(OPS_READ, FAST_READ). No design in TARGETED may take more than TARGET's files and lines (tests/test_repo.py).
"""
import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path

TARGET = (2, 250)             # (files, lines) at most, for the designs in TARGETED
TARGETED = ("HC", "mHC", "Full AttnRes", "MoDA")
DESIGNS = {"HC": "hc", "mHC": "mhc", "Full AttnRes": "attnres", "Block AttnRes": "block_attnres", "MoDA": "moda"}
PROOF = "test_logits_equal_the_equations"   # the model, both bodies, equal to the reference forward
EQUATIONS = "tests/test_equations.py"
# a README row of a design: | `key` | `Class`, `reference` | ...  (the "read these two" column)
ROW = re.compile(r"^\| `(\w+)` \| `(\w+)`, `(\w+)` \|", re.M)

CONTRACT = ["<module>", "PreLN.__init__", "PreLN.build"]       # residuals.py's trunk loop; the norms every design has
HC_FORWARD = ["HC.__init__", "HC.site", "HC.init_stream", "HC.read", "HC.connect", "HC.write", "HC.collapse",
              "HC.scale_sublayer_init"]
ATTNRES = ["FullAttnRes", "FullAttnRes.__init__", "FullAttnRes.site", "FullAttnRes.init_stream", "FullAttnRes.mix",
           "FullAttnRes.read", "FullAttnRes.write", "FullAttnRes.collapse", "FullAttnRes.n_sites",
           "FullAttnRes.reset_parameters"]
BLOCK = ["BlockAttnRes", "BlockAttnRes.__init__", "BlockAttnRes.site", "BlockAttnRes.init_stream", "BlockAttnRes.read",
         "BlockAttnRes.write", "BlockAttnRes.collapse", "BlockAttnRes.groups"]
CLASS_READ = {  # residuals.py's names a class's forward and init run (its own, and those it inherits)
    "HC": ["HC", "HC.make_connector", "HC.maps", "HC.reset_parameters", "HC.no_decay_params"] + HC_FORWARD,
    "MHC": ["MHC", "MHC.__init__", "MHC.make_connector", "MHC.maps", "MHC.reset_parameters",
            "MHC.no_decay_params"] + HC_FORWARD,
    "FullAttnRes": ATTNRES,
    "BlockAttnRes": ATTNRES + BLOCK,
    "MoDA": ["MoDA", "MoDA.__init__", "MoDA.site", "MoDA.init_stream", "MoDA.read", "MoDA.attend", "MoDA.write",
             "MoDA.collapse", "MoDA.reset_parameters"],
}
HC_OPS = ["fp32_maths", "rms_norm", "RMSNorm", "hc_read", "normed_projection", "width_connection", "depth_connection"]
ATTNRES_OPS = ["fp32_maths", "rms_norm", "RMSNorm", "depth_mix", "topk_count", "DepthBank", "DepthBank.start",
               "DepthBank.push", "DepthBank.mix", "DepthBank.newest"]
OPS_READ = {"HC": HC_OPS, "MHC": HC_OPS + ["sinkhorn"], "FullAttnRes": ATTNRES_OPS, "BlockAttnRes": ATTNRES_OPS,
            "MoDA": ["apply_rope", "rope_cos_sin", "joint_attention", "DepthKV", "DepthKV.start", "DepthKV.push"]}
HC_FAST = ["skinny_matmul", "inv_rms", "InvRms", "normed_projection", "width_connection", "depth_connection"]
ATTNRES_FAST = ["Bank", "Bank.__init__", "Bank.write", "Bank.stored", "Bank.scratch", "linear", "Push", "Push.forward",
                "Push.backward", "tokens_major", "source_dots", "Mix", "Mix.forward", "Mix.backward", "DepthBank",
                "DepthBank.__init__", "DepthBank.start", "DepthBank.push", "DepthBank.mix", "DepthBank.newest"]
FAST_READ = {"HC": HC_FAST, "MHC": HC_FAST + ["sinkhorn", "Sinkhorn", "Sinkhorn.forward", "Sinkhorn.backward"],
             "FullAttnRes": ATTNRES_FAST, "BlockAttnRes": ATTNRES_FAST,
             "MoDA": ["apply_rope", "head_pad", "padded", "joint_attention", "MergeDepth", "MergeDepth.forward",
                      "MergeDepth.backward", "sink_attention", "Attend", "Attend.forward", "Attend.backward",
                      "slot_dots", "slot_sum", "add_outer", "DepthKV", "DepthKV.__init__", "DepthKV.start",
                      "DepthKV.push", "DepthKV.attend"]}


@dataclass(frozen=True)
class Door:
    """What a design's README row sends a reader to."""
    key: str                  # the registry key, the row's first cell
    cls: str                  # its class in residuals.py
    reference: str            # its reference forward in tests/test_equations.py


def doors(root):
    """{registry key: Door} of every design row of the checkout's README."""
    text = (root / "README.md").read_text(encoding="utf-8")
    return {key: Door(key, cls, ref) for key, cls, ref in ROW.findall(text)}


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


def called(path, start):
    """[start and every module-level function of the file it calls, transitively], in the order first met."""
    functions = {n.name: n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}
    if start not in functions:
        raise ValueError(f"{path}: no function {start}")
    order, todo = [], [start]
    while todo:
        name = todo.pop(0)
        if name in order:
            continue
        order.append(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                todo.append(node.func.id)
    return order


def class_doc(root, cls):
    tree = ast.parse((root / "residuals.py").read_text(encoding="utf-8"))
    return next(ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)


def test_exists(root, name):
    """Whether a test of that name is defined in the checkout's test files."""
    files = [root / "test_all.py", *sorted((root / "tests").glob("test_*.py"))]
    return any(re.search(rf"^def {name}\(", f.read_text(encoding="utf-8"), re.M) for f in files if f.is_file())


def reading(root, door):
    """[(file, [names])] that the door's two ask of a reader (the module docstring above)."""
    read = [("residuals.py", CONTRACT + CLASS_READ[door.cls]), (EQUATIONS, called(root / EQUATIONS, door.reference))]
    if not (PROOF in class_doc(root, door.cls) and test_exists(root, PROOF)):
        fast = next(f for f in ("depthbench/kernels/cpu.py", "depthbench/kernels.py") if (root / f).is_file())
        read += [("ops.py", OPS_READ[door.cls]), (fast, FAST_READ[door.cls])]
    return read


def measure(root, design):
    """The design's path ("HC", "mHC", ...) from its README row -> (Door, {file: lines read})."""
    found = doors(root)
    if DESIGNS[design] not in found:
        row = f"| `{DESIGNS[design]}` | `Class`, `reference` |"
        raise ValueError(f"{root / 'README.md'}: no row {row}")
    door = found[DESIGNS[design]]
    lines = {}
    for name, wanted in reading(root, door):
        table = spans(root / name)
        missing = [w for w in wanted if w not in table]
        if missing:
            raise ValueError(f"{root / name}: no {', '.join(missing)}")
        lines[name] = sum(table[w][1] - table[w][0] + 1 for w in wanted)
    return door, lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="learner_path.py", description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="a checkout (default: this one)")
    args = p.parse_args(argv)
    root = Path(args.root)
    if not (root / "README.md").is_file():
        p.error(f"--root {root}: no README.md there")
    for design in DESIGNS:
        try:
            door, lines = measure(root, design)
        except ValueError as err:           # a checkout whose README or files lack what the path names
            p.error(str(err))
        parts = ", ".join(f"{f} {n}" for f, n in lines.items())
        print(f"{design}: {len(lines)} files, {sum(lines.values())} lines "
              f"(README row `{door.key}`: {door.cls} + {door.reference}; {parts})")


if __name__ == "__main__":
    main()
