"""
The learner's path, measured (docs/contributing.md#the-learners-path): the files a reader opens and the lines read from
the README to the end of HC's and Full AttnRes' forward, in a checkout of this repository.

    python scripts/learner_path.py                   # this checkout
    python scripts/learner_path.py --root OLD_CHECKOUT --before

A path is a list of (file, what): the README up to the end of its design table, each module docstring on the way, and
the definitions (classes, functions, methods) that a forward pass of the design runs, as the reader follows the calls
(for a class, its docstring and the named methods only). --before reads the layout before the restructure of issue 39
(every ops function dispatched to kernels.py, the default); the names are those of that commit.
"""
import argparse
import ast
from pathlib import Path

# (file, [names]): a name is "Class", "Class.method", "function", or "<module>" (the module docstring)
AFTER = {
    "HC": [("residuals.py", ["<module>", "Site", "PreLN", "PreLN.__init__", "PreLN.site", "PreLN.init_stream",
                             "PreLN.read", "PreLN.write", "PreLN.collapse", "HC", "HC.__init__", "HC.make_connector",
                             "HC.site", "HC.maps", "HC.init_stream", "HC.read", "HC.write", "HC.collapse"]),
           ("model.py", ["Block.forward", "GPT.forward"]),
           ("ops.py", ["<module>", "namespace", "fp32_maths", "rms_norm", "RMSNorm", "normed_projection",
                       "width_connection", "depth_connection"])],
    "Full AttnRes": [("residuals.py", ["<module>", "Site", "PreLN", "PreLN.__init__", "FullAttnRes",
                                       "FullAttnRes.__init__", "FullAttnRes.site", "FullAttnRes.init_stream",
                                       "FullAttnRes.mix", "FullAttnRes.read", "FullAttnRes.write",
                                       "FullAttnRes.collapse"]),
                     ("model.py", ["Block.forward", "GPT.forward"]),
                     ("ops.py", ["<module>", "namespace", "fp32_maths", "rms_norm", "depth_mix", "DepthBank",
                                 "DepthBank.start", "DepthBank.push", "DepthBank.mix", "DepthBank.newest"])],
}
BEFORE = {
    "HC": [("residuals.py", ["<module>", "Site", "Site.__init__", "Site.constant", "Site.pick", "PreLN",
                             "PreLN.__init__", "PreLN.site", "PreLN.init_stream", "PreLN.read", "PreLN.write",
                             "PreLN.collapse", "PreLN.log", "HC", "HC.__init__", "HC.make_connector", "HC.site",
                             "HC._maps", "HC.init_stream", "HC.read", "HC.write", "HC.collapse"]),
           ("model.py", ["Block.forward", "GPT.forward", "GPT.observe"]),
           ("ops.py", ["<module>", "rms_norm", "RMSNorm", "fp32", "normed_projection", "width_connection",
                       "depth_connection"]),
           ("kernels.py", ["<module>", "skinny_matmul", "inv_rms", "InvRms", "normed_projection", "width_connection",
                           "depth_connection"])],
    "Full AttnRes": [("residuals.py", ["<module>", "Site", "Site.__init__", "Site.pick", "padded_window", "pushed",
                                       "PreLN", "PreLN.__init__", "PreLN.log", "BlockAttnRes", "BlockAttnRes.groups",
                                       "BlockAttnRes.__init__", "BlockAttnRes.site", "BlockAttnRes.make_sites",
                                       "BlockAttnRes.init_stream", "BlockAttnRes.newest", "BlockAttnRes._source",
                                       "BlockAttnRes._mix", "BlockAttnRes.read", "BlockAttnRes.write",
                                       "BlockAttnRes.collapse", "FullAttnRes", "FullAttnRes.__init__"]),
                     ("model.py", ["Block.forward", "GPT.forward", "GPT.observe"]),
                     ("ops.py", ["<module>", "rms_norm", "fp32", "depth_mix"]),
                     ("kernels.py", ["<module>", "depth_mix", "in_use", "mix_forward", "mix_backward", "DepthMix",
                                     "depth_mix_node"])],
}


def spans(path):
    """{name: (first line, last line)} of the module docstring, classes (their docstring only), functions and
    methods of a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = {}
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if doc is not None:
        out["<module>"] = (doc.lineno, doc.end_lineno)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = (node.lineno - len(node.decorator_list), node.end_lineno)
        elif isinstance(node, ast.ClassDef):
            body_doc = node.body[0] if isinstance(node.body[0], ast.Expr) else node.body[0]
            out[node.name] = (node.lineno, body_doc.end_lineno)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = (item.lineno - len(item.decorator_list), item.end_lineno)
    return out


def readme_lines(root):
    """The README from its top to the end of the first design table."""
    lines = (root / "README.md").read_text(encoding="utf-8").split("\n")
    start = next(k for k, line in enumerate(lines) if line.startswith("## The ten designs"))
    table = next(k for k in range(start, len(lines)) if lines[k].startswith("|"))
    end = next(k for k in range(table, len(lines)) if not lines[k].startswith("|"))
    return end


def measure(root, path):
    """-> (files opened, README lines read, code lines read)."""
    files, total = ["README.md"], 0
    for name, wanted in path:
        found = None
        for candidate in (root / name, root / "depthbench" / name):
            if candidate.is_file():
                found = candidate
        table = spans(found)
        missing = [w for w in wanted if w not in table]
        if missing:
            raise SystemExit(f"{found}: no {', '.join(missing)}")
        total += sum(table[w][1] - table[w][0] + 1 for w in wanted)
        files.append(str(found.relative_to(root)))
    return files, readme_lines(root), total


def main(argv=None):
    p = argparse.ArgumentParser(prog="learner_path.py", description=__doc__.split("\n\n")[1])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="a checkout (default: this one)")
    p.add_argument("--before", action="store_true", help="the paths of the layout before issue 39")
    args = p.parse_args(argv)
    for design, path in (BEFORE if args.before else AFTER).items():
        files, readme, code = measure(Path(args.root), path)
        print(f"{design}: {len(files)} files, {readme + code} lines: the README's first {readme}, then {code} of code "
              f"({', '.join(files[1:])})")


if __name__ == "__main__":
    main()
