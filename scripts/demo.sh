#!/usr/bin/env bash
# Set up a fresh virtual environment (CPU torch) and run `kvtrace demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVTRACE_VENV:-.venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".[record,report]"
"$VENV/bin/kvtrace" demo "$@"
