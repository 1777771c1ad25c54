#!/usr/bin/env bash
# The test command README documents and CI runs: lint, format check and types (scripts/typecheck.sh: mypy
# over every module, as [tool.mypy] configures it), then the default suite (real-model smoke tests included; tests
# marked slow are left for `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PWD/.venv/bin:$PATH"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
# the console script, not `python -m pytest`: see the note on `operator/` in scripts/setup.sh
exec .venv/bin/pytest -q "$@"
