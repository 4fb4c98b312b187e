"""
The repository describes itself truthfully: the root holds what a reader runs or reads first (at most
MAX_ROOT_FILES .py files), the README stays a short read, its file map names every root file, the library
package, the tests and scripts folders, every docs page and the CI file (and nothing that does not exist), every
docs page is reachable from it, the docs sections and files that README, docs and code cite exist, and nothing
a clone lacks (../shared) is cited outside the tests.

    python -m pytest -q tests/test_repo.py
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root
README = ROOT / "README.md"
README_MAX_LINES = 250                                      # a newcomer's five-minute read (issue 19)
MAX_ROOT_FILES = 13                                         # the card's files and what a reader runs first (issue 39)
FOLDERS = ("depthbench/", "tests/", "scripts/")             # the library, the other tests, the GPU/cluster scripts
FORBIDDEN = ("../shared", "architectures.md", "spec §", "diagnostics.md §")
PAGES = ("designs", "diagnostics", "results", "speed", "training", "official", "contributing")
CITE = re.compile(r"(?:docs/)?(" + "|".join(PAGES) + r")\.md#([A-Za-z0-9_-]+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")      # a Markdown link or image's target, without its anchor


def file_map(text):
    """The rows of the code block under '## Files': (name, what it holds); the name is the first word."""
    lines = text.split("\n")
    start = lines.index("## Files")
    first = next(k for k in range(start, len(lines)) if lines[k].startswith("```")) + 1
    end = next(k for k in range(first, len(lines)) if lines[k].startswith("```"))
    return [(line.split()[0], line[len(line.split()[0]):].strip()) for line in lines[first:end] if line.strip()]


def must_be_listed():
    """Every file a reader should find in the map: the root's scripts and test_all.py, the folders, the docs pages,
    requirements and CI."""
    names = [p.name for p in ROOT.glob("*.py")] + [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")]
    return sorted(names + list(FOLDERS) + ["README.md", "requirements.txt", ".ci/run"])


def code_files():
    """Every non-test Python file: the root's, the package's and the scripts'."""
    paths = sorted(ROOT.glob("*.py")) + sorted((ROOT / "depthbench").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    return [p for p in paths if not p.name.startswith("test_")]


def exists(name):
    """A row names a file, a folder (trailing /) or a glob (docs/*.png) that matches something."""
    return any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()


def slug(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def docs_pages():
    return sorted((ROOT / "docs").glob("*.md"))


# ----------------------------------------------------------------------------- tests

def test_readme_file_map_names_every_file_and_nothing_else():
    """One line per file, no line counts: every script, test, docs page and CI file has a row, and every row
    names something that exists."""
    rows = file_map(README.read_text(encoding="utf-8"))
    names = [name for name, _ in rows]
    missing = [n for n in must_be_listed() if n not in names]
    gone = [n for n in names if not exists(n)]
    bare = [n for n, what in rows if not what]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not (missing or gone or bare or twice), (f"README file map: missing rows {missing}, rows for absent files "
                                                    f"{gone}, rows that say nothing {bare}, rows twice {twice}")


def test_the_root_holds_what_a_reader_runs_first():
    """At most MAX_ROOT_FILES .py files at the root, test_all.py among them; every other test lives in tests/."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= MAX_ROOT_FILES and "test_all.py" in root, root
    assert not [n for n in root if n.startswith("test_") and n != "test_all.py"], root
    assert sorted((ROOT / "tests").glob("test_*.py")), "no tests under tests/"


def test_readme_is_a_short_read():
    """At most README_MAX_LINES lines (`wc -l`): measurement reports and reference sections live in docs/."""
    n = README.read_bytes().count(b"\n")
    assert n <= README_MAX_LINES, f"README.md has {n} lines, over {README_MAX_LINES}: move detail to a docs/ page"


def test_every_docs_page_is_reachable_from_the_readme():
    """Each docs page is linked from the README or from a page the README links, and the README links a page by
    its bare name at most once (its sections may be cited by anchor besides)."""
    readme = README.read_text(encoding="utf-8")
    direct = {t for t in LINK.findall(readme) if t.startswith("docs/") and t.endswith(".md")}
    reachable = set(direct)
    for page in direct:
        if (ROOT / page).is_file():
            reachable |= {f"docs/{t}" for t in LINK.findall((ROOT / page).read_text(encoding="utf-8")) if t.endswith(".md")}
    unreached = [f"docs/{p.name}" for p in docs_pages() if f"docs/{p.name}" not in reachable]
    assert not unreached, f"docs pages no reader of the README can reach: {unreached}"
    bare = re.findall(r"\]\((docs/[^)#\s]+\.md)\)", readme)
    twice = sorted({t for t in bare if bare.count(t) > 1})
    assert not twice, f"the README links these pages more than once: {twice}"


def test_nothing_outside_the_tests_points_into_shared():
    """README, docs and the non-test Python files, every line (code, messages, docstrings, comments)."""
    hits = []
    for path in [README, *sorted((ROOT / "docs").glob("*.md")), *code_files()]:
        for k, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            hits += [f"{path.name}:{k}: {line.strip()}" for bad in FORBIDDEN if bad in line]
    assert not hits, "references a clone does not have (cite docs/designs.md, docs/diagnostics.md or a paper):\n" \
        + "\n".join(hits)


def test_every_cited_docs_section_exists():
    """`docs/designs.md#mhc` and the like, wherever cited (README, docs, all Python files), name a heading."""
    anchors = {page: {slug(line.lstrip("#")) for line in (ROOT / "docs" / f"{page}.md").read_text(
        encoding="utf-8").split("\n") if line.startswith("#")} for page in PAGES}
    cited = []
    for path in [README, *sorted((ROOT / "docs").glob("*.md")), *code_files(), *sorted((ROOT / "tests").glob("*.py"))]:
        for k, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            cited += [(f"{path.name}:{k}", page, a) for page, a in CITE.findall(line)]
    for page in anchors:  # and the pages' own links, [text](#anchor)
        text = (ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8")
        cited += [(f"{page}.md", page, a) for a in re.findall(r"\]\(#([\w-]+)\)", text)]
    assert cited, "no docs section is cited anywhere"
    dangling = [f"{where}: {page}.md#{a}" for where, page, a in cited if a not in anchors[page]]
    assert not dangling, "cited sections that do not exist:\n" + "\n".join(dangling)


def test_readme_and_docs_links_point_at_files_that_exist():
    """Every image and relative link of the README and of each docs page names a file in the repo (figures are
    replaced, not lost); a docs page's links are relative to docs/."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(((?:docs|fixtures)/[^)#\s]+)", text)
    assert targets, "the README links no docs at all"
    missing = [t for t in targets if not (ROOT / t).is_file()]
    for page in docs_pages():
        local = [t for t in LINK.findall(page.read_text(encoding="utf-8")) if "://" not in t]
        missing += [f"{page.name}: {t}" for t in local if not (page.parent / t).is_file()]
    assert not missing, f"links to files that do not exist: {missing}"


# ----------------------------------------------------------------------------- shape rules (docs/contributing.md)

MAX_FUNCTION_LINES = 60
MAX_REQUIRED_PARAMS = 6
MAX_POSITIONAL_ARGS = 4
MAX_FILE_LINES = 700
FILE_LINES_ASIDE = ("residuals.py",)                        # grows with its registry
IFEXP_ASIDE = ("depthbench/kernels/cpu.py",)                  # fused kernels pick their branch inline
VARIADIC = ("permute", "view", "reshape", "expand", "repeat",  # tensor methods whose positional arguments are
            "apply", "save_for_backward")                      # the dimensions themselves, and autograd's calls
#                                                                  that take positional arguments only


def parsed():
    """(file path from the root, its ast) of every source file (code_files)."""
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(encoding="utf-8"), filename=p.name))
            for p in code_files()]


def functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def takes_positional_only(fn):
    """A function whose parameters are positional by contract, so they may be many: a Triton kernel or jit helper
    (@triton.jit or @jit: Triton has no struct argument, each pointer, size, stride and block size is a parameter of
    its own) or an autograd Function's forward (first parameter ctx: Function.apply takes positional arguments
    only)."""
    positional = fn.args.posonlyargs + fn.args.args
    if positional and positional[0].arg == "ctx":
        return True
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def is_parser_builder(fn):
    """An argparse builder, which may be long (one flag a line): a function whose name ends in 'parser'."""
    return fn.name.endswith("parser")


def statements(tree):
    """(statement, name of the function or class holding it, or '<module>') for every statement of the file."""
    out = []

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else owner
            if isinstance(child, ast.stmt):
                out.append((child, owner))
            visit(child, inner)
    visit(tree, "<module>")
    return out


def header_nodes(stmt):
    """The expressions of a statement that count for its conditional expressions: all of a simple statement; only
    the header (test, target, items, signature, decorators) of a compound one, whose body holds statements of its
    own."""
    nodes = []
    for _, value in ast.iter_fields(stmt):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, ast.AST) and not isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case)):
                nodes.append(v)
    return nodes


def if_expressions(stmt):
    count = 0
    for node in header_nodes(stmt):
        count += sum(isinstance(n, ast.IfExp) for n in ast.walk(node))
    return count


def required_params(fn):
    """Parameters without a default, self and cls not counted."""
    positional = fn.args.posonlyargs + fn.args.args
    required = positional[:len(positional) - len(fn.args.defaults)]
    required += [a for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is None]
    return [a.arg for a in required if a.arg not in ("self", "cls")]


def shape_offenders(rule, files=None):
    """Every 'file:line name' that breaks `rule`, over `files` ([(name, ast)]; default: every source file)."""
    found = []
    for name, tree in files or parsed():
        if rule == "function length":
            for fn in functions(tree):
                lines = fn.end_lineno - fn.lineno + 1
                if lines > MAX_FUNCTION_LINES and not is_parser_builder(fn):
                    found.append(f"{name}:{fn.lineno} {fn.name} ({lines} lines)")
        elif rule == "nested conditional expression":
            for stmt, owner in statements(tree):
                for node in header_nodes(stmt):
                    for ifexp in [n for n in ast.walk(node) if isinstance(n, ast.IfExp)]:
                        if any(isinstance(n, ast.IfExp) for n in ast.walk(ifexp) if n is not ifexp):
                            found.append(f"{name}:{ifexp.lineno} {owner}")
        elif rule == "conditional expressions per statement" and name not in IFEXP_ASIDE:
            for stmt, owner in statements(tree):
                count = if_expressions(stmt)
                if count > 1:
                    found.append(f"{name}:{stmt.lineno} {owner} ({count})")
        elif rule == "required parameters":
            for fn in functions(tree):
                required = required_params(fn)
                if len(required) > MAX_REQUIRED_PARAMS and not takes_positional_only(fn):
                    found.append(f"{name}:{fn.lineno} {fn.name} ({len(required)}: {', '.join(required)})")
        elif rule == "positional arguments":
            for stmt, owner in statements(tree):
                for node in header_nodes(stmt):
                    for call in [n for n in ast.walk(node) if isinstance(n, ast.Call)]:
                        positional = [a for a in call.args if not isinstance(a, ast.Starred)]
                        variadic = isinstance(call.func, ast.Attribute) and call.func.attr in VARIADIC
                        if len(positional) > MAX_POSITIONAL_ARGS and not variadic:
                            found.append(f"{name}:{call.lineno} {owner} ({ast.unparse(call.func)}, "
                                         f"{len(positional)} positional)")
        elif rule == "SimpleNamespace":
            for node in ast.walk(tree):
                spelled = getattr(node, "id", None) or getattr(node, "attr", None)
                names = [a.name for a in getattr(node, "names", [])] if isinstance(node, ast.ImportFrom) else []
                if spelled == "SimpleNamespace" or "SimpleNamespace" in names:
                    found.append(f"{name}:{node.lineno} SimpleNamespace")
        elif rule == "file length" and name not in FILE_LINES_ASIDE:
            lines = tree.body[-1].end_lineno if tree.body else 0  # the last statement's last line
            if files is None:
                lines = (ROOT / name).read_bytes().count(b"\n")
            if lines > MAX_FILE_LINES:
                found.append(f"{name}:{lines} {name} ({lines} lines)")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0]), s))


SHAPE_RULES = {  # rule -> what it says, for the failure message
    "function length": f"functions over {MAX_FUNCTION_LINES} lines (argparse builders, named *parser, aside)",
    "nested conditional expression": "conditional expressions inside a conditional expression",
    "conditional expressions per statement": "statements with more than one conditional expression (depthbench/kernels/cpu.py "
                                             "aside; a compound statement counts its header only)",
    "required parameters": f"functions with more than {MAX_REQUIRED_PARAMS} required parameters (self, cls and the "
                           f"@triton.jit functions and autograd's forward(ctx, ...) aside)",
    "positional arguments": f"calls with more than {MAX_POSITIONAL_ARGS} positional arguments (use keywords; "
                            f"{', '.join(VARIADIC)} aside)",
    "SimpleNamespace": "SimpleNamespace used as a record (use a dataclass with commented fields)",
    "file length": f"files over {MAX_FILE_LINES} lines (residuals.py aside)",
}


@pytest.mark.parametrize("rule", SHAPE_RULES)
def test_shape_rules(rule):
    """STYLE §4's shape rules, checked over every non-test Python file; each offender as 'file:line name'."""
    found = shape_offenders(rule)
    assert not found, f"{SHAPE_RULES[rule]}:\n" + "\n".join(found)


def test_the_shape_rules_find_what_they_say():
    """The checker on made-up files: each rule flags exactly its offenders, and what each rule sets aside (an
    argparse builder, a compound statement's body, self, dimension arguments, a Triton kernel and an autograd forward
    with many parameters, residuals.py's length) passes."""
    body = "\n".join(f"    x{k} = {k}" for k in range(59))
    source = f"""from types import SimpleNamespace
def long_one():
{body}
    return x0
def build_parser():
{body}
    return x0
def branches(self, a, b, c, d, e, f, g, h=1):
    y = a if b else c if d else e
    z = (a if b else c) + (d if e else f)
    if a if b else c:
        w = d if e else f
    f(a, b, c, d, e)
    a.permute(0, 1, 2, 3, 4)
    f(a, b, c, d=d, e=e)
    return y, z, w
def six(a, b, c, d, e, f, *, g=1):
    return SimpleNamespace(a=a)
@triton.jit
def kernel(a, b, c, d, e, f, g):
    pass
class Function:
    @staticmethod
    def forward(ctx, a, b, c, d, e, f, g):
        pass
"""
    files = [("made_up.py", ast.parse(source)), ("big.py", ast.parse("x = 1\n" * 701)),
             ("residuals.py", ast.parse("x = 1\n" * 701))]
    expected = {"function length": ["made_up.py:2 long_one (61 lines)"],
                "nested conditional expression": ["made_up.py:125 branches"],
                "conditional expressions per statement": ["made_up.py:125 branches (2)", "made_up.py:126 branches (2)"],
                "required parameters": ["made_up.py:124 branches (7: a, b, c, d, e, f, g)"],
                "positional arguments": ["made_up.py:129 branches (f, 5 positional)"],
                "SimpleNamespace": ["made_up.py:1 SimpleNamespace", "made_up.py:134 SimpleNamespace"],
                "file length": ["big.py:701 big.py (701 lines)"]}
    assert {rule: shape_offenders(rule, files) for rule in SHAPE_RULES} == expected


def test_each_design_is_learnt_within_the_learners_path_target():
    """scripts/learner_path.py (issue 67): from its README row, HC, mHC, Full AttnRes and MoDA are each learnt in at
    most TARGET's files and lines, the two the row names (the class in residuals.py, the reference forward in
    tests/test_equations.py); ops.py and the fast bodies are left out only where the class docstring names the test
    that checks the model against the reference forward."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("learner_path", ROOT / "scripts" / "learner_path.py")
    path = sys.modules["learner_path"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(path)
    files, lines = path.TARGET
    for name in path.TARGETED:
        door, read = path.measure(ROOT, name)
        assert set(read) == {"residuals.py", "tests/test_equations.py"}, (name, read)
        assert len(read) <= files and sum(read.values()) <= lines, (name, door, read)


# ----------------------------------------------------------------------------- the import graph

LEARNER_FILES = ("model", "residuals", "ops")                 # what a reader learns a design from
LIBRARY_FILES = LEARNER_FILES + ("data", "shapes")             # root files the packages may import (scripts and libraries)
PACKAGES = {  # depthbench's sub-package -> those it may import (docs/contributing.md#where-things-live)
    "reports": ("evaluation", "files"), "training": ("evaluation", "files", "kernels"), "evaluation": ("files",),
    "files": (), "kernels": ()}


def module_names(root=ROOT):
    """{dotted module name: path} of every project module: the root's, depthbench's (a package as its __init__),
    the scripts' and the tests'."""
    paths = list(root.glob("*.py")) + list((root / "depthbench").rglob("*.py")) + list((root / "scripts").glob("*.py"))
    paths += list((root / "tests").glob("*.py"))
    names = {}
    for path in paths:
        parts = list(path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(node, module, is_package, known):
    """The project modules an import statement names: `import a.b` -> a.b (or its longest known prefix); `from a.b
    import c` -> a.b.c where that is a module, else a.b; relative imports resolved against `module`."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = []
    for target in targets:
        parts = target.split(".")
        prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        found += [next((p for p in prefixes if p in known), None)]
    return [f for f in found if f is not None and f != module]


def import_graph(names=None):
    """{module: sorted project modules it imports}, from every import statement anywhere in its file (at module
    level and inside functions: a lazy import is an import too). An import of a.b.c counts for a.b.c only, not for
    the packages a and a.b around it."""
    names = names or module_names()
    graph = {}
    for module, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(imported(node, module, path.name == "__init__.py", names))
        graph[module] = sorted(edges)
    return graph


def cycles(graph):
    """Every cycle a depth-first search over `graph` closes (at least one per set of modules that import each other),
    each as 'a -> b -> a'."""
    found, done = [], set()
    for start in sorted(graph):
        stack, on_path = [(start, iter(graph[start]))], [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                loop = on_path[on_path.index(child):] + [child]
                if " -> ".join(loop) not in found:
                    found.append(" -> ".join(loop))
            elif child not in done and child in graph:
                stack.append((child, iter(graph[child])))
                on_path.append(child)
    return found


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for child in graph.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def package_of(module):
    """depthbench's sub-package a module is in ('kernels'), or None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "depthbench" and len(parts) > 1 else None


def test_no_import_cycles():
    """No project module imports, directly or through others, a module that imports it back: at module level or
    inside a function. Each cycle found is named 'a -> b -> a'."""
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_learner_files_import_no_package():
    """model.py, residuals.py and ops.py reach (import, directly or through others) nothing of depthbench's
    training, evaluation or reports packages: a design is read and built without them (kernels/ they may)."""
    graph = import_graph()
    bad = [f"{f} reaches {m}" for f in LEARNER_FILES for m in sorted(reachable(graph, f))
           if package_of(m) in ("training", "evaluation", "reports")]
    assert not bad, "the learner's files import training/, evaluation/ or reports/:\n" + "\n".join(bad)


def test_packages_import_downwards():
    """Each of depthbench's sub-packages imports only itself, the sub-packages below it (PACKAGES) and the root's
    library files (LIBRARY_FILES), never a root script: the direction docs/contributing.md#where-things-live
    states."""
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        mine = package_of(module)
        if mine is None:
            continue
        allowed = {mine, *PACKAGES[mine]}
        for target in targets:
            theirs = package_of(target)
            ok = theirs in allowed if theirs else target in LIBRARY_FILES or target == "depthbench"
            if not ok:
                wrong.append(f"{module} -> {target}")
    assert sorted(PACKAGES) == sorted(p.name for p in (ROOT / "depthbench").iterdir() if p.is_dir()
                                      and (p / "__init__.py").exists())
    assert not wrong, "imports against the direction:\n" + "\n".join(wrong)


def test_the_import_graph_sees_every_kind_of_import(tmp_path):
    """On made-up modules: `import a`, `from a import b`, `from a.b import c` (module or name), a relative import
    and an import inside a function are each an edge, and a cycle through them is named."""
    files = {"one.py": "def f():\n    import pkg.two\n", "pkg/__init__.py": "",
             "pkg/two.py": "from . import three\n", "pkg/three.py": "from pkg.four import thing\n",
             "pkg/four.py": "from one import f\nthing = 1\n", "solo.py": "import one\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    names = {".".join(Path(n).with_suffix("").parts).replace(".__init__", ""): tmp_path / n for n in files}
    graph = import_graph(names)
    assert graph["one"] == ["pkg.two"] and graph["pkg.two"] == ["pkg.three"] and graph["solo"] == ["one"]
    assert cycles(graph) == ["one -> pkg.two -> pkg.three -> pkg.four -> one"]
    assert reachable(graph, "solo") == {"one", "pkg.two", "pkg.three", "pkg.four"}
