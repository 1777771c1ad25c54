#!/usr/bin/env bash
# mypy over the packages that [tool.mypy] in pyproject.toml lists (scripts/test.sh and pre-commit run this;
# extra arguments go to mypy). mypy finds a module by its dotted name in folders and cannot read
# [tool.setuptools.package-dir] (kvpilot.engine lives in engine/, kvpilot.router in router/, ...), so the
# packages are linked into one kvpilot/ tree under .mypy_cache/src first (mypy_path), and its errors are
# reported under the repo's own paths.
set -euo pipefail
cd "$(dirname "$0")/.."
src=.mypy_cache/src
rm -rf "$src"
mkdir -p "$src/kvpilot"
for entry in kvpilot/*; do
  [ "$(basename "$entry")" = __pycache__ ] || ln -s "$PWD/$entry" "$src/kvpilot/"
done
for dir in engine router operator; do  # [tool.setuptools.package-dir]: kvpilot.<dir> = <dir>/
  ln -s "$PWD/$dir" "$src/kvpilot/$dir"
done
.venv/bin/mypy "$@" | sed -e "s#^$src/kvpilot/\(engine\|router\|operator\)/#\1/#" -e "s#^$src/kvpilot/#kvpilot/#"
