"""``python -m prefill_node ...`` and ``pdcluster prefill ...``: see ``prefill_node.launch``."""
from __future__ import annotations

import sys

from prefill_node.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
