"""``pdcluster bench``: serving benchmark (not built yet; see docs/BENCHMARKS.md for what exists)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("pdcluster bench: not yet implemented (tracked as a follow-up issue). "
          "Transfer-layer numbers: python -m transfer.bench", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
