"""``python -m router``: the least-loaded PD router (not built yet; sglang-router fronts our nodes meanwhile)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "pdcluster router: not yet implemented in this release.\n"
        "Front the nodes with sglang-router meanwhile:\n"
        "  python -m sglang_router.launch_router --pd-disaggregation "
        "--prefill http://P:PORT BOOTSTRAP_PORT --decode http://D:PORT",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
