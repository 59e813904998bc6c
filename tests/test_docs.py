"""The repository documents itself: nothing in the package, the kernels, the scripts, the README or docs/ points
outside the repository (a sibling checkout, an issue tracker), every ``docs/<file>.md §N`` citation anywhere in the
tree names a document and a section heading that exist, and the license is there. Reads text files only."""

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Where no pointer outside the repository may appear (tests/ may still fall back to a sibling ../shared at run time).
SELF_CONTAINED = ("k3jax", "pallas_kernels", "scripts", "docs", "README.md")
OUTSIDE = re.compile(r"\.\./shared|SPEC(?:\.md| ?§)|STYLE(?:\.md| ?§)|shared/CLI\.md|issue #\d+", re.IGNORECASE)

# Where citations of docs/ are checked: everything that is ours and text (the dated lab log keeps its history).
CITING = ("k3jax", "pallas_kernels", "scripts", "tests", "experiments", "notebooks", "docs", "README.md",
          "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".ini", ".yaml", ".yml", ".json", ".jsonl", ""}
SKIP = {ROOT / "experiments" / "LOG.md", Path(__file__).resolve()}
DATA = (ROOT / "experiments" / "runs", ROOT / "k3jax" / "assets", ROOT / "tests" / "golden")  # records, not prose

NUM = r"\d+(?:\.\d+)*[a-z]?"
# "docs/model.md §4.4, §4.5", "docs/checkpoint.md §11.5–11.7, §11.9", "docs/model.md §1.3 / §3.2"
CITATION = re.compile(rf"(?<![\w/])(?:docs/)?(\w+\.md) (§ ?{NUM}(?:(?:[–-]§?{NUM})|(?:(?:,| /|/| and) ?§ ?{NUM}))*)")
HEADING = re.compile(rf"^#{{1,6}} +({NUM})[. ]", re.MULTILINE)


@functools.cache
def _read(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _text_files(roots):
    for name in roots:
        path = ROOT / name
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in paths:
            if (p in SKIP or "__pycache__" in p.parts or p.suffix not in TEXT_SUFFIXES or p.stat().st_size > 1 << 20
                    or (p.suffix not in (".md", ".py") and any(d in p.parents for d in DATA))):
                continue
            if name == "notebooks" and p.suffix != ".py":
                continue  # the .ipynb twins repeat their .py
            text = _read(p)
            if text is not None:
                yield p, text


def _sections() -> dict[str, set[str]]:
    return {p.name: set(HEADING.findall(p.read_text(encoding="utf-8"))) for p in DOCS.glob("*.md")}


def test_nothing_points_outside_the_repository():
    bad = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
           for p, text in _text_files(SELF_CONTAINED) for m in OUTSIDE.finditer(text)]
    assert not bad, "cite docs/*.md (or describe the thing) instead of:\n" + "\n".join(bad)


def test_every_docs_citation_resolves():
    sections = _sections()
    assert {"model.md", "numerics.md", "checkpoint.md", "cli.md", "design.md"} <= set(sections)
    bad, seen = [], 0
    for p, text in _text_files(CITING):
        if "§" not in text:
            continue
        for m in CITATION.finditer(text):
            doc = m.group(1)
            in_docs = p.parent == DOCS
            if not m.group(0).startswith("docs/") and not in_docs:
                continue  # a bare "README.md §3" elsewhere is not a citation of docs/
            where = f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            if doc not in sections:
                if m.group(0).startswith("docs/") or doc in ("model.md", "numerics.md", "checkpoint.md"):
                    bad.append(f"{where}: no docs/{doc}")
                continue
            for num in re.findall(rf"(?:§ ?|[–-])({NUM})", m.group(2)):
                seen += 1
                if num not in sections[doc]:
                    bad.append(f"{where}: docs/{doc} has no section {num} ({m.group(0)!r})")
    assert seen > 100, f"only {seen} citations found: is the pattern still right?"
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md")))
def test_each_doc_opens_with_contents(doc):
    text = (DOCS / doc).read_text(encoding="utf-8")
    head = text[:3000]
    assert doc == "README.md" or "## Contents" in head, f"docs/{doc} starts with a table of contents"


def test_license_is_apache_2_and_the_weights_license_is_named():
    lic = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in lic and "Version 2.0, January 2004" in lic and "END OF TERMS AND CONDITIONS" in lic
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for name in ("README.md", "docs/checkpoint.md"):
        text = " ".join((ROOT / name).read_text(encoding="utf-8").split())
        assert "Apache License 2.0" in text and "Kimi K3 License" in text, name
        assert re.search(r"ships no (Kimi )?K3 weights", text), name
