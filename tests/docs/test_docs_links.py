"""Every relative link of README.md, CHANGELOG.md and docs/*.md resolves: the file exists,
and a ``#fragment`` names a heading of it (GitHub's anchors). A renamed heading or a moved
doc fails here instead of leaving a reader on a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
#: Docs another change brings, linked ahead of it (issue #38's Ray executor writes docs/cluster.md).
#: A pending link may be missing; once its file exists it is checked like any other.
PENDING = {"docs/cluster.md"}

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``[x](y)`` in code is no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lower case, punctuation dropped,
    spaces made hyphens, a repeated one suffixed -1, -2..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        heading = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(path: Path) -> list[str]:
    """The targets of ``path``'s links that are not URLs."""
    targets = []
    for line in prose_lines(path.read_text()):
        for target in _LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                targets.append(target)
    return targets


def test_the_docs_are_found() -> None:
    names = {path.relative_to(REPO).as_posix() for path in DOCS}
    assert {"README.md", "CHANGELOG.md", "docs/architecture.md", "docs/performance.md"} <= names
    assert "docs/performance.md" in relative_links(REPO / "README.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, fragment = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        shown = linked.relative_to(REPO).as_posix() if linked.is_relative_to(REPO) else str(linked)
        if not linked.exists():
            if shown not in PENDING:
                broken.append(f"{target}: no file {shown}")
            continue
        if fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {shown}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_anchors_follow_githubs_rule(tmp_path: Path) -> None:
    """The slug rule on headings this repository uses (backticks, colons, dots, repeats)."""
    doc = tmp_path / "x.md"
    doc.write_text("# The tar view: `<shard>.tar` and `shards.json`\n## Modalities .pbin\n"
                   "```\n# not a heading\n```\n## Notes\n## Notes\n")
    assert anchors(doc) == {"the-tar-view-shardtar-and-shardsjson", "modalities-pbin", "notes", "notes-1"}


#: A repository path in a code span: `tests/...`, `bench/...`, `atlasfs/...`, `scripts/...`, `docs/...`.
_PATH = re.compile(r"`((?:tests|bench|atlasfs|scripts|docs)/[\w./-]*\.(?:py|md|c|h|sh))`")
#: Every README of the repository's folders besides the docs (fixtures name their tests).
READMES = sorted(p for p in REPO.glob("*/**/README.md")
                 if not any(part.startswith(".") for part in p.relative_to(REPO).parts))


@pytest.mark.parametrize("doc", DOCS + READMES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_named_paths_exist(doc: Path) -> None:
    """A file the docs name in code (`tests/mount/test_jobs_mount.py`) exists: a test or module
    moved to another folder left its old path in the docs, with no link to fail."""
    missing = sorted({name for name in _PATH.findall(doc.read_text()) if not (REPO / name).exists()})
    assert not missing, f"{doc.relative_to(REPO)} names files that do not exist: {missing}"
