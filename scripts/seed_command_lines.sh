#!/usr/bin/env bash
# Runs every seed command line with estimax's programs, full models, tiny overrides, fake data
# (see scripts/seed_command_lines.py). Minutes per line on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-.venv/bin/python}" scripts/seed_command_lines.py "$@"
