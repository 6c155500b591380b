"""The repository explains itself: no tracked code or doc points at a file outside it (the design
notes the project was planned from are not part of a clone). The facts they held live in
docs/PROTOCOL.md, docs/ARCHITECTURE.md, docs/TRANSFER.md and docs/OPERATIONS.md."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Written so that this file matches none of it itself, and is checked like every other file.
OUTSIDE = re.compile(r"\.\./shared|shared/(?:DESIGN|seeds)|DESIGN\.md|DESIGN[ ]§")


def tracked(*suffixes: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / f for f in out.splitlines() if f.endswith(suffixes)]


def test_no_code_or_doc_points_outside_the_repository() -> None:
    files = tracked(".py", ".md", ".yaml", ".toml", ".sh", "Makefile")
    assert len(files) > 100  # git ls-files worked
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def test_every_doc_the_readme_lists_exists() -> None:
    readme = (REPO / "README.md").read_text()
    for doc in re.findall(r"`(docs/[A-Z]+\.md)`", readme):
        assert (REPO / doc).is_file(), doc
    assert "docs/PROTOCOL.md" in readme
