"""The ``pdcluster`` console script: one subcommand per role, each also ``python -m <package>``.

Subcommands import their package lazily so ``pdcluster bootstrap`` does not pay for torch.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prefill": ("prefill_node.__main__", "run a prefill node (API + scheduler + embedded bootstrap server)"),
    "decode": ("decode_node.__main__", "run a decode node (API + scheduler)"),
    "router": ("router.__main__", "run the router in front of prefill/decode nodes"),
    "bootstrap": ("bootstrap_server.__main__", "run a standalone bootstrap registry"),
    "up": ("common.tools.up", "run a whole cluster on this machine (first run, demos)"),
    "make-tiny-model": ("common.tools.make_tiny_model", "write a random-weight HF checkpoint for tests"),
    "bench": ("common.tools.bench", "benchmark a running cluster or the local engine"),
}


def usage() -> str:
    lines = ["usage: pdcluster <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n'pdcluster <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pdcluster: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
