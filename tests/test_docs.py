"""Every document reference resolves inside the repository, and the library cites design sections, not the log.

Scanned: the package, the kernel sources, the tests, bench/, tools/ and the Markdown documents except
docs/history.md (a dated log: it names files as they were at the time). A reference is a repository path
(``docs/design.md``, ``bench/device/run.sh``, ``kernels_cu/gemv_tc.cu``, ``bench/results/h200_decode_v42*.json``)
or a section of a project document (``docs/design.md §Host path``): the path must exist (a ``*`` matches as a
glob) and the text after ``§`` must start with one of that document's headings.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("docs", "bench", "tests", "kernels_cu", "awq_cupy", "tools", ".ci")
_PATH = re.compile(r"(?<![\w./:-])((?:docs|bench|tests|kernels_cu|awq_cupy|tools)/[\w.*/-]*\w)")
# Not in the tree on purpose: the wheel's folder for kernels_cu/, and the copy of an older GEMV source that
# bench/sweeps/gemv_ab.py compares against (made by hand, git-ignored). ``rev:path`` (git show) is history.
_NOT_IN_TREE = ("awq_cupy/kernels_cu", "kernels_cu/gemv_tc_ab.cu")
_SECTION = re.compile(r"(docs/[\w-]+\.md) §([^\n]+)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def _scanned():
    files = [REPO / "README.md"]
    for root in ROOTS:
        for p in sorted((REPO / root).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md", ".cu", ".cuh", ".sh", "") and "__pycache__" not in p.parts \
                    and p != REPO / "docs" / "history.md" and "results" not in p.relative_to(REPO).parts:
                files.append(p)
    return files


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def _exists(ref: str) -> bool:
    ref = ref.rstrip(".")
    if "*" in ref:
        return any(REPO.glob(ref))
    if (REPO / ref).exists():
        return True
    # a module path written with dots after the folder (awq_cupy/plans.py.gemv_wide_takes) or a trailing word
    return any((REPO / ref[:i]).is_file() for i in range(len(ref), 0, -1) if ref[i - 1] not in "/")


def test_every_repository_path_a_file_names_exists():
    missing = []
    for p in _scanned():
        for m in _PATH.finditer(_text(p)):
            ref = m.group(1)
            if ref in _NOT_IN_TREE:
                continue
            if not _exists(ref):
                missing.append(f"{p.relative_to(REPO)}: {ref}")
    assert not missing, "references to files that are not in the repository:\n" + "\n".join(missing)


def _headings(doc: str) -> list[str]:
    return [h.strip("` ") for h in _HEADING.findall((REPO / doc).read_text(encoding="utf-8"))]


def test_every_section_reference_names_a_heading():
    bad, seen = [], 0
    for p in _scanned():
        text = re.sub(r"\n\s*(?://|#)\s*", " ", _text(p))   # a citation may wrap onto the next comment line
        for m in _SECTION.finditer(text):
            doc, after = m.group(1), m.group(2)
            if not (REPO / doc).is_file():
                bad.append(f"{p.relative_to(REPO)}: {doc} does not exist")
                continue
            seen += 1
            if not any(after.startswith(h) for h in _headings(doc)):
                bad.append(f"{p.relative_to(REPO)}: {doc} §{after[:60]}")
    assert seen >= 10, "the scan found almost no section references: the pattern is broken"
    assert not bad, "section references without a matching heading:\n" + "\n".join(bad)


@pytest.mark.parametrize("root", ["awq_cupy", "kernels_cu"])
def test_library_comments_cite_no_log_version(root):
    """The log's versions stay in the log: library comments cite docs/design.md sections instead."""
    cites = re.compile(r"NOTES(\.md)?|history\.md v\d|\(v\d{1,2}\)|\bv\d{1,2}(,| to) v\d{1,2}\b")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in sorted((REPO / root).rglob("*")) if p.suffix in (".py", ".cu", ".cuh")
             for i, line in enumerate(_text(p).splitlines(), 1) if cites.search(line)]
    assert not found, "\n".join(found)


def test_the_documents_the_code_relies_on_exist():
    for doc in ("design.md", "formats.md", "benchmarking.md", "gpu-notes.md", "history.md"):
        assert (REPO / "docs" / doc).is_file(), doc
    design = _headings("docs/design.md")
    for section in ("Data path", "Weight layout", "Kernel families", "Dispatch", "Host path",
                    "Adding a variant or an architecture", "Tests"):
        assert section in design, section
    adding = (REPO / "docs" / "design.md").read_text().split("## Adding a variant or an architecture", 1)[1]
    adding = adding.split("\n## ", 1)[0]
    for where in ("awq_cupy/kernels.py", "awq_cupy/jit.py", "ARCHS"):
        assert where in adding, f"docs/design.md §Adding a variant or an architecture does not name {where}"
