"""
The repository describes itself truthfully: the README stays a short read, its file map names every
source file, test, docs page and CI file (and nothing that does not exist), every docs page is reachable
from it, the docs sections and files that README, docs and code cite exist, and nothing a clone lacks
(../shared) is cited outside the tests.

    python -m pytest -q test_repo.py
"""
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
README_MAX_LINES = 250                                      # a newcomer's five-minute read (issue 19)
FORBIDDEN = ("../shared", "architectures.md", "spec §", "diagnostics.md §")
PAGES = ("designs", "diagnostics", "results", "speed", "training", "official")
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
    """Every file a reader should find in the map: the scripts, tests, docs pages, requirements and CI."""
    names = [p.name for p in HERE.glob("*.py")] + [f"docs/{p.name}" for p in (HERE / "docs").glob("*.md")]
    return sorted(names + ["README.md", "requirements.txt", ".ci/run"])


def exists(name):
    """A row names a file, a folder (trailing /) or a glob (docs/*.png) that matches something."""
    return any(HERE.glob(name)) if "*" in name else (HERE / name).exists()


def slug(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def docs_pages():
    return sorted((HERE / "docs").glob("*.md"))


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
        if (HERE / page).is_file():
            reachable |= {f"docs/{t}" for t in LINK.findall((HERE / page).read_text(encoding="utf-8")) if t.endswith(".md")}
    unreached = [f"docs/{p.name}" for p in docs_pages() if f"docs/{p.name}" not in reachable]
    assert not unreached, f"docs pages no reader of the README can reach: {unreached}"
    bare = re.findall(r"\]\((docs/[^)#\s]+\.md)\)", readme)
    twice = sorted({t for t in bare if bare.count(t) > 1})
    assert not twice, f"the README links these pages more than once: {twice}"


def test_nothing_outside_the_tests_points_into_shared():
    """README, docs and the non-test Python files, every line (code, messages, docstrings, comments)."""
    hits = []
    code = [p for p in sorted(HERE.glob("*.py")) if not p.name.startswith("test_")]
    for path in [README, *sorted((HERE / "docs").glob("*.md")), *code]:
        for k, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            hits += [f"{path.name}:{k}: {line.strip()}" for bad in FORBIDDEN if bad in line]
    assert not hits, "references a clone does not have (cite docs/designs.md, docs/diagnostics.md or a paper):\n" \
        + "\n".join(hits)


def test_every_cited_docs_section_exists():
    """`docs/designs.md#mhc` and the like, wherever cited (README, docs, all Python files), name a heading."""
    anchors = {page: {slug(line.lstrip("#")) for line in (HERE / "docs" / f"{page}.md").read_text(
        encoding="utf-8").split("\n") if line.startswith("#")} for page in PAGES}
    cited = []
    for path in [README, *sorted((HERE / "docs").glob("*.md")), *sorted(HERE.glob("*.py"))]:
        for k, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            cited += [(f"{path.name}:{k}", page, a) for page, a in CITE.findall(line)]
    for page in anchors:  # and the pages' own links, [text](#anchor)
        text = (HERE / "docs" / f"{page}.md").read_text(encoding="utf-8")
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
    missing = [t for t in targets if not (HERE / t).is_file()]
    for page in docs_pages():
        local = [t for t in LINK.findall(page.read_text(encoding="utf-8")) if "://" not in t]
        missing += [f"{page.name}: {t}" for t in local if not (page.parent / t).is_file()]
    assert not missing, f"links to files that do not exist: {missing}"
