"""``kvpilot bench``: the benchmark subcommands.

Each subcommand lives in its own module exposing ``NAME``, ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args, parser) -> int``; this module only assembles them. A new
subcommand (the engine-only ``offline`` benchmark is the next one) is a new module added to
``SUBCOMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES: tuple[str, ...] = ("kvpilot.bench.serve_cli", "kvpilot.bench.offline_cli")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends an option's default to its help unless there is none or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # Identity checks: a default of 0 is worth showing, a default of False (a store_true flag) is not.
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev is per parser: add_parser does not inherit it, so each subcommand is given it too.
    parser = argparse.ArgumentParser(
        prog="kvpilot bench", description="kvpilot benchmarks.", allow_abbrev=False
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.DESCRIPTION,
            formatter_class=_HelpWithDefaults,
            allow_abbrev=False,
        )
        module.add_arguments(sub)
        sub.set_defaults(run_subcommand=module.run, subcommand_parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpilot bench``; returns the exit code (2 for bad flags, as argparse does)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        return int(args.run_subcommand(args, args.subcommand_parser))
    except SystemExit as exit_request:  # argparse errors and --help: hand the code back instead of exiting
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
