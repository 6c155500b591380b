"""No doc or docstring may point outside the repository: a clone holds no ``../shared/`` tree,
so a citation of its design guide or seeds is a dead end (the facts live in docs/ instead)."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Split so this file does not match itself.
FORBIDDEN = ("shared/" + "DESIGN", "shared/" + "seeds")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", "*.py", "*.md"], cwd=REPO, capture_output=True,
                         timeout=60, check=True).stdout.decode()
    return [REPO / p for p in out.split("\0") if p and not p.startswith(".venv")]


def test_no_tracked_file_cites_the_out_of_repo_design() -> None:
    files = _tracked()
    assert any(f.name == "PROTOCOL.md" for f in files)  # the listing itself works
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()}"
            for f in files if f.is_file()
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if any(s in line for s in FORBIDDEN)]
    assert not hits, "cite the in-repo doc (docs/PROTOCOL.md, ARCHITECTURE.md, TRANSFER.md, " \
                     "OPERATIONS.md) instead:\n" + "\n".join(hits)
