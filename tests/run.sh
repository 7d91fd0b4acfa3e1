#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs them.
#
#   bash tests/run.sh            everything: lint, the tests, the tutorials (CI runs this)
#   bash tests/run.sh --quick    the edit loop: lint, tests/unit and the tests marked
#                                quick (one multi-rank test per mechanism), in minutes
#   bash tests/run.sh ARGS...    pytest ARGS (a folder, a file, -k ...) after the install
#
# CPU torch first: `pip install torch==2.13.0` takes a local CPU build; a bare
# `pip install torch` on a machine without torch may pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
if [ "$quick" = 1 ] && python3 -c "import nbtrain, pytest, nbval, ruff" 2>/dev/null \
    && [ "$(python3 -c 'import nbtrain, os; print(os.path.dirname(os.path.dirname(nbtrain.__file__)))')" = "$PWD" ]; then
    : # the edit loop: this checkout is installed already
else
    python3 -m pip install -q "torch==2.13.0" || python3 -m pip install -q "torch>=2.4"
    python3 -m pip install -q -e ".[test,notebook]"  # notebook: JupyterLab, for its test
fi
# Optional system tools for the MPI launcher tests, the browser screenshot test and the
# Slurm tests (installed here once, not by two test workers at a time); the tests that
# need them skip with a reason when these cannot be installed.
if [ "$quick" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if ! command -v mpiexec >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 \
        || ! command -v slurmd >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            openmpi-bin libopenmpi-dev chromium slurm-wlm munge >/dev/null) \
            || echo "note: apt-get could not install openmpi/chromium/slurm; their tests will skip"
    fi
    python3 -m pip install -q mpi4py || echo "note: mpi4py not installed; the MPI test will skip"
fi
# Byte-code for the checkout's modules, once: with PYTHONDONTWRITEBYTECODE set (as on
# many CI machines) every rank, engine and script compiled them from source again.
python3 -m compileall -q nbtrain kernels tests >/dev/null
# Lint and format check first (seconds): the rules live in pyproject.toml's [tool.ruff].
python3 -m ruff check nbtrain kernels tests
python3 -m ruff format --check nbtrain kernels tests
export OMP_NUM_THREADS=1
if [ "$quick" = 1 ]; then
    # tests/conftest.py marks every test of tests/unit quick. The same four workers
    # as the full run: one process took 166 s here, four 84 s.
    exec python3 -m pytest -q -ra --timing -m quick -n "${NBTRAIN_TEST_WORKERS:-4}" \
        --dist loadfile --no-loadscope-reorder --module-order longest "${@:-tests}"
fi
# Everything by default: the tests, and every tutorial and research notebook executed
# by nbval (errors fail; outputs are not compared). Arguments narrow the run.
if [ "$#" -eq 0 ]; then set -- tests tutorials notebooks; fi
# Four pytest-xdist workers, whole modules each (a notebook's cells, a module's shared
# cluster stay in one process), the slowest modules first (tests/module_order.py): most
# tests wait on ranks, kernels and clusters more than they compute, so on 2 cores four
# workers finish first (measured on fresh clones: three workers 20.6 min of pytest,
# four 13.2).
# NBTRAIN_TEST_WORKERS=0 runs in this one process.
python3 -m pytest -q -ra --timing --nbval-lax -n "${NBTRAIN_TEST_WORKERS:-4}" --dist loadfile \
    --no-loadscope-reorder --module-order "${NBTRAIN_TEST_ORDER:-longest}" "$@"
