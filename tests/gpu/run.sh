#!/usr/bin/env bash
# Every GPU check in one command; installs nothing.
#
# Usage:  bash tests/gpu/run.sh          (from any folder; no arguments)
#
# Runs three parts, each under `timeout`, carrying on after a failure:
#   tests    python3 -m pytest -q -ra -m gpu tests     every gpu-marked test (tests/gpu,
#                                                      tests/kernels)
#   kernels  python3 -m nbtrain.kernels.bench          fused kernels vs torch, defaults
#                                                      (1B-param AdamW, 4096 x 128k CE;
#                                                      ~40 GB free GPU memory, ~1 minute)
#   bench    nbtrain bench --ranks 1 --device cuda --model-size small --steps 10 --rounds 1
#            (world size 1: ZeRO-3, ZeRO-2, FSDP2 and DDP on one GPU, so the step-time
#            ratios measure each engine's own overhead; without a GPU it refuses and
#            the table says so)
# then prints one Markdown table (part, command, status with exit code, seconds, key
# numbers: pytest's counts, the benches' ratio lines), ready to paste into a note; it
# is also saved as summary.md next to the logs.
#
# Without a CUDA GPU it says so first and still runs: the gpu tests skip and the benches
# refuse, which checks the script itself. Exit status: 1 when a part failed, timed out,
# or refused for a reason other than too few GPUs; 0 otherwise.
# Whole run: under 8 minutes (timeouts 210 + 120 + 120 s, plus start-up).
#
# Environment (all optional):
#   GPU_RUN_LOGS=DIR                  logs and summary.md (default: out/gpu-run)
#   GPU_RUN_T_TESTS/_KERNELS/_BENCH   per-part timeouts in seconds (210/120/120)
#   KERNEL_BENCH_ARGS="..."           e.g. "--adam-numel 100000000 --iters 3" (quicker)
#   NBTRAIN_BENCH_ARGS="..."          replaces "--ranks 1 --device cuda --model-size
#                                     small --steps 10 --rounds 1"
set -u
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
LOGS=${GPU_RUN_LOGS:-$ROOT/out/gpu-run}
mkdir -p "$LOGS" && rm -f "$LOGS"/*.log "$LOGS/parts.tsv" "$LOGS/summary.md" "$LOGS/probe.err"

# -- the machine -----------------------------------------------------------------------
PROBE=$(python3 - 2>"$LOGS/probe.err" <<'EOF'
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(n)}))
print(n)
print((f"{n} x {names}" if n else "no CUDA GPU") + f"; torch {torch.__version__}; triton {tv}")
EOF
)
GPUS=$(printf '%s\n' "$PROBE" | head -1)
if ! [[ "$GPUS" =~ ^[0-9]+$ ]]; then
    echo "could not import torch to look for a GPU:"; tail -3 "$LOGS/probe.err"
    GPUS=0 MACHINE="torch import failed"
else
    MACHINE=$(printf '%s\n' "$PROBE" | sed -n 2p)
fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
# A copied tree can carry an older .git: say when the files differ from that commit.
git diff --quiet HEAD -- . 2>/dev/null || COMMIT="$COMMIT with local changes"
echo "machine: $MACHINE"
if [ "$GPUS" -eq 0 ]; then
    echo "NO CUDA GPU visible: the gpu tests will skip and the benches will refuse;"
    echo "this run only checks that the script works."
else
    if [ -n "${TRITON_INTERPRET:-}" ]; then
        echo "note: unsetting TRITON_INTERPRET so the kernels compile for the GPU"
        unset TRITON_INTERPRET
    fi
    [ "$GPUS" -lt 2 ] && echo "note: nbtrain bench needs 2 GPUs (one per rank); with $GPUS it will refuse"
fi

# -- the parts -------------------------------------------------------------------------
TIMEOUT=(timeout --kill-after=15)
command -v timeout >/dev/null 2>&1 || { echo "note: no \`timeout\` command; parts run unbounded"; TIMEOUT=(); }

run_part() {  # run_part NAME SECONDS COMMAND...
    local name=$1 limit=$2 start end rc
    shift 2
    echo
    echo "== $name: $* (timeout ${limit}s)"
    start=$(date +%s.%N)
    if [ "${#TIMEOUT[@]}" -gt 0 ]; then
        "${TIMEOUT[@]}" "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    else
        "$@" 2>&1 | tee "$LOGS/$name.log"
    fi
    rc=${PIPESTATUS[0]}
    end=$(date +%s.%N)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$limit" "$start" "$end" "$*" \
        >> "$LOGS/parts.tsv"
}

if command -v nbtrain >/dev/null 2>&1; then NBTRAIN=(nbtrain); else NBTRAIN=(python3 -m nbtrain.cli); fi
# Word splitting of the *_ARGS variables is intended.
# shellcheck disable=SC2086
{
run_part tests "${GPU_RUN_T_TESTS:-210}" python3 -m pytest -q -ra -m gpu --continue-on-collection-errors tests
run_part kernels "${GPU_RUN_T_KERNELS:-120}" python3 -m nbtrain.kernels.bench ${KERNEL_BENCH_ARGS:-}
run_part bench "${GPU_RUN_T_BENCH:-120}" "${NBTRAIN[@]}" bench \
    ${NBTRAIN_BENCH_ARGS:---ranks 1 --device cuda --model-size small --steps 10 --rounds 1}
}

# -- the table -------------------------------------------------------------------------
echo
python3 tests/gpu/summary.py "$LOGS" --gpus "$GPUS" \
    --header "GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $COMMIT, $MACHINE" \
    | tee "$LOGS/summary.md"
status=${PIPESTATUS[0]}
echo
echo "logs: $LOGS"
exit "$status"
