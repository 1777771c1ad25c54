"""No ``kvpilot`` parser accepts a prefix of a long option: ``--por 9999`` in an InferenceService's extraArgs
must not become ``--port 9999``. Every parser and subparser is found by walking the CLI, so a new subcommand
(a new entry of ``kvpilot.cli.SUBCOMMANDS``, or a new add_parser) is covered without editing this test.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

import pytest

from kvpilot.cli import SUBCOMMANDS


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _root(command: str) -> argparse.ArgumentParser:
    # every subcommand's module builds its parser with build_parser(), which this test relies on
    return importlib.import_module(SUBCOMMANDS[command][0]).build_parser()


def _relax(parser: argparse.ArgumentParser) -> None:
    """Nothing required anywhere, so the only error left to report is the abbreviation's."""
    for _, each in _walk(parser, ()):
        for action in each._actions:
            action.required = False
        for group in each._mutually_exclusive_groups:
            group.required = False


PATHS = [(command, *path) for command in SUBCOMMANDS for path, _ in _walk(_root(command), ())]


def test_every_subcommand_and_subparser_is_walked():
    assert {"serve", "generate", "router", "operator", "bench"} <= set(SUBCOMMANDS)
    for expected in [
        ("operator", "run"),
        ("operator", "fetch-model"),
        ("bench", "serve"),
        ("bench", "offline"),
    ]:
        assert expected in PATHS


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_an_abbreviated_long_option_is_refused_with_exit_2(path, capsys):
    command, *subcommands = path
    root = _root(command)
    _relax(root)
    parser = dict(_walk(root, ()))[tuple(subcommands)]
    accepted = []
    for option in parser._option_string_actions:
        abbreviation = option[:-1]
        if (
            not option.startswith("--")
            or len(abbreviation) < 3
            or abbreviation in parser._option_string_actions
        ):
            continue
        try:
            root.parse_args([*subcommands, abbreviation])
            code: object = None  # parsed: the abbreviation was taken for its option
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        if code != 2 or f"unrecognized arguments: {abbreviation}" not in err:
            accepted.append(abbreviation)
    assert accepted == []
