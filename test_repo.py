"""
The repository describes itself truthfully: the README's file table lists every source file with its
exact line count, the docs sections that README, docs and code cite exist, and nothing a clone lacks
(../shared) is cited outside the tests.

    python -m pytest -q test_repo.py
    python test_repo.py --update          # rewrite the README's line counts from the files
"""
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
COUNTED = re.compile(r"^(\S+)\s+(\d+)  (\S.*)$")           # "model.py           218  what it holds"
FORBIDDEN = ("../shared", "architectures.md", "spec §", "diagnostics.md §")
CITE = re.compile(r"(?:docs/)?(designs|diagnostics)\.md#([A-Za-z0-9_-]+)")


def file_table(text):
    """(first line, end line, rows) of the code block under '## Files'; rows are (name, count or None, desc)."""
    lines = text.split("\n")
    start = lines.index("## Files")
    first = next(k for k in range(start, len(lines)) if lines[k].startswith("```")) + 1
    end = next(k for k in range(first, len(lines)) if lines[k].startswith("```"))
    rows = []
    for line in lines[first:end]:
        m = COUNTED.match(line)
        rows.append((m[1], int(m[2]), m[3]) if m else (line.split()[0], None, line))
    return first, end, rows


def line_count(path):
    """What `wc -l` says: the number of newline characters."""
    return path.read_bytes().count(b"\n")


def corrected(text):
    """The README text with every counted row of the file table set to its file's real line count."""
    lines = text.split("\n")
    first, end, rows = file_table(text)
    for k, (name, count, desc) in zip(range(first, end), rows):
        if count is not None and (HERE / name).is_file():
            lines[k] = f"{name:<18}{line_count(HERE / name):>4}  {desc}"
    return "\n".join(lines)


def must_be_listed():
    """Every file a reader should find in the table: the scripts, tests, docs pages, requirements and CI."""
    names = [p.name for p in HERE.glob("*.py")] + [f"docs/{p.name}" for p in (HERE / "docs").glob("*.md")]
    return sorted(names + ["README.md", "requirements.txt", ".ci/run"])


def slug(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ----------------------------------------------------------------------------- tests

def test_readme_file_table_names_every_file_with_its_line_count():
    text = README.read_text(encoding="utf-8")
    _, _, rows = file_table(text)
    listed = {name: count for name, count, _ in rows}
    missing = [n for n in must_be_listed() if n not in listed]
    gone = [n for n, c in listed.items() if not (HERE / n).exists()]
    wrong = [n for n, c in listed.items() if c is not None and (HERE / n).is_file() and line_count(HERE / n) != c]
    first, end, _ = file_table(corrected(text))
    table = "\n".join(corrected(text).split("\n")[first:end])
    assert not (missing or gone or wrong), (f"README file table: missing rows {missing}, rows for absent files "
                                            f"{gone}, wrong counts {wrong}; `python test_repo.py --update` fixes "
                                            f"the counts. The counts should read:\n{table}")


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
        encoding="utf-8").split("\n") if line.startswith("#")} for page in ("designs", "diagnostics")}
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


def test_table_rows_round_trip():
    """corrected() rewrites counts only: names, descriptions and folder rows stay, and a fixed table is a fixed point."""
    text = README.read_text(encoding="utf-8")
    fixed = corrected(text)
    assert [(n, d) for n, _, d in file_table(fixed)[2]] == [(n, d) for n, _, d in file_table(text)[2]]
    assert corrected(fixed) == fixed
    assert len(fixed.split("\n")) == len(text.split("\n"))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        print("usage: python test_repo.py --update   (rewrites the README's line counts)", file=sys.stderr)
        sys.exit(2)
    new = corrected(README.read_text(encoding="utf-8"))
    tmp = README.with_suffix(".md.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, README)
    print(f"updated the line counts in {README.name}")


def test_readme_links_point_at_files_that_exist():
    """Every image and relative link of the README names a file in the repo (figures are replaced, not lost)."""
    text = README.read_text()
    targets = re.findall(r"\]\(((?:docs|fixtures)/[^)#\s]+)", text)
    assert targets, "the README links no docs at all"
    missing = [t for t in targets if not (HERE / t).is_file()]
    assert not missing, f"README links files that do not exist: {missing}"
