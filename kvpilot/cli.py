"""The ``kvpilot`` command: dispatches to each area's own CLI module.

Each subcommand's module is imported only when that subcommand runs, so ``kvpilot router`` never pays
for importing torch and ``kvpilot operator`` never loads the engine.
"""

from __future__ import annotations

import importlib
import sys

from kvpilot import __version__

# subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvpilot.engine.cli", "generate text offline with the engine (default model: smollm2-135m)"),
    "serve": ("kvpilot.engine.server.cli", "run the OpenAI-compatible engine server"),
    "router": ("kvpilot.router.cli", "run the cache-aware routing sidecar"),
    "operator": ("kvpilot.operator.cli", "run the Kopf operator, or render/generate its manifests"),
    "bench": ("kvpilot.bench.cli", "benchmarks: serving load generator and offline engine throughput"),
}


def _usage() -> str:
    lines = [f"kvpilot {__version__}", "", "usage: kvpilot <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'kvpilot <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"kvpilot: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
