#!/usr/bin/env bash
# The README's test command: install into a virtual environment (scripts/install.sh), then run
# ruff and the whole pytest suite. Database tests run on SQLite and on the PostgreSQL server at
# ROBOT_LLM_TEST_PG (default postgresql://postgres@127.0.0.1:5432/test); with CI=true an
# unreachable PostgreSQL fails the run instead of skipping those tests.
set -euo pipefail

VENV="${VENV:-.venv}"
export VENV
cd "$(dirname "$0")/.."

# --dev: the test tools. --deepspeed-ops: compile DeepSpeed's ops now, so the DeepSpeed tests do not
# compile them inside pytest.
bash scripts/install.sh --dev --deepspeed-ops
# freqtrade, for the test that runs the example adapter inside freqtrade's own backtesting.
"$VENV/bin/pip" install --quiet -e ".[freqtrade]"
lint=0
"$VENV/bin/ruff" check . || lint=$?
status=0
# A test that hangs fails after 15 minutes instead of holding the run until CI gives up. One worker
# per core, at most 4 (pytest-xdist): most tests compute on one thread (the model tests set torch's
# threads to 1, the subprocesses OMP_NUM_THREADS=1), so two cores run the suite in about half the time.
"$VENV/bin/pytest" --timeout=900 --durations=15 -n auto --maxprocesses=4 "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
if [ "$lint" -ne 0 ]; then
    echo "ruff found problems (above)" >&2
    exit 1
fi
exit "$status"
