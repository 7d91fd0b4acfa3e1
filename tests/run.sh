#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs them.
# CPU torch first: `pip install torch==2.13.0` takes a local CPU build; a bare
# `pip install torch` on a machine without torch may pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0" || python3 -m pip install -q "torch>=2.4"
python3 -m pip install -q -e ".[test]"
# Optional system tools for the MPI launcher test and the browser screenshot test;
# the tests that need them skip with a reason when these cannot be installed.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if ! command -v mpiexec >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev chromium >/dev/null) \
            || echo "note: apt-get could not install openmpi/chromium; their tests will skip"
    fi
    python3 -m pip install -q mpi4py || echo "note: mpi4py not installed; the MPI test will skip"
fi
# Lint and format check first (seconds): the rules live in pyproject.toml's [tool.ruff].
python3 -m ruff check nbtrain kernels tests
python3 -m ruff format --check nbtrain kernels tests
export OMP_NUM_THREADS=1
# Everything by default: the tests, and every tutorial and research notebook executed
# by nbval (errors fail; outputs are not compared). Arguments narrow the run.
if [ "$#" -eq 0 ]; then set -- tests tutorials notebooks; fi
python3 -m pytest -q -ra --timing --nbval-lax "$@"
