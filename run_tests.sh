#!/usr/bin/env bash
# Run the test suite: ./run_tests.sh [pytest args]  (creates .venv on first use)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
sb_ensure_venv
exec .venv/bin/python -m pytest "$@"
