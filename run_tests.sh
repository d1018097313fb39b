#!/usr/bin/env bash
# Run the test suite: ./run_tests.sh [pytest args]  (creates .venv on first use)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh
sb_ensure_venv
# Two workers (SB_TEST_WORKERS, 0 for none): torchrun tests spend part of their time
# waiting (rendezvous, checkpoint I/O, restarts), which the other worker fills. Each
# module stays on one worker (loadfile), so its module-scoped runs launch once; the
# slowest modules go first (tests/conftest.py, kept in order by --no-loadscope-reorder).
# Every process the suite starts writes bytecode for what it imports, once, even where
# PYTHONDONTWRITEBYTECODE is set: set-up (scripts/venv.sh) skips pip's compile step, and
# hundreds of test processes would otherwise each compile from source.
export PYTHONDONTWRITEBYTECODE=
workers="${SB_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
