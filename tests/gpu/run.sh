#!/usr/bin/env bash
# Every GPU check in one command; installs nothing.
#
# Usage:  bash tests/gpu/run.sh          (from any folder; no arguments)
#
# Runs five parts, each under `timeout`, carrying on after a failure:
#   tests    python3 -m pytest -q -ra -m gpu tests     every gpu-marked test (tests/gpu,
#                                                      tests/kernels)
#   kernels  python3 -m nbtrain.kernels.bench          fused kernels vs torch, defaults
#                                                      (1B-param AdamW, 4096 x 128k CE;
#                                                      ~40 GB free GPU memory, ~1 minute)
#   local    python3 -m nbtrain.bench.local_parts       MoE's grouped experts against the
#                                                      loop, a MoE layer (experts local)
#                                                      against the dense MLP, ring
#                                                      attention's block kernel against
#                                                      SDPA, on one GPU (~30 s)
#   bench    nbtrain bench --ranks 1 --device cuda --model-size small --steps 10 --rounds 1
#            (world size 1: ZeRO-3, ZeRO-2, FSDP2 and DDP on one GPU, so the step-time
#            ratios measure each engine's own overhead; without a GPU it refuses and
#            the table says so)
#   mfu      nbtrain bench --mfu --device cuda
#            (a 1.06 B Llama, seq 2048, 4 sequences a step, bf16 with fp32 masters:
#            nbtrain, torch, torch.compile and nbtrain compiled, each 3 warm-up + 10
#            timed steps; tokens/s and MFU against the GPU's bf16 peak; ~20 GB of
#            training state and ~25 GB of activations, one engine at a time)
# then prints one Markdown table (part, command, status with exit code, seconds, key
# numbers: pytest's counts, the benches' ratio lines), ready to paste into a note; it
# is also saved as summary.md next to the logs.
#
# Without a CUDA GPU it says so first and still runs: the gpu tests skip and the benches
# refuse, which checks the script itself. Exit status: 1 when a part failed, timed out,
# could not start within the budget, or refused for a reason other than too few GPUs;
# 0 otherwise.
# Whole run: under 8 minutes. The parts share one budget of GPU_RUN_BUDGET seconds (450):
# each runs under its own timeout (210, 120, 45, 120, 150 s) or what is left of the budget,
# whichever is less; a part with under 20 s left is not started (the table says so).
#
# Environment (all optional):
#   GPU_RUN_LOGS=DIR                  logs and summary.md (default: out/gpu-run)
#   GPU_RUN_BUDGET                    seconds for all parts together (450)
#   GPU_RUN_T_TESTS/_KERNELS/_LOCAL/_BENCH/_MFU  per-part timeouts (210/120/45/120/150 s)
#   KERNEL_BENCH_ARGS="..."           e.g. "--adam-numel 100000000 --iters 3" (quicker)
#   NBTRAIN_BENCH_ARGS="..."          replaces "--ranks 1 --device cuda --model-size
#                                     small --steps 10 --rounds 1"
#   NBTRAIN_MFU_ARGS="..."            replaces "--device cuda" after "bench --mfu"
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
fi

# -- the parts -------------------------------------------------------------------------
TIMEOUT=(timeout --kill-after=15)
command -v timeout >/dev/null 2>&1 || { echo "note: no \`timeout\` command; parts run unbounded"; TIMEOUT=(); }

BUDGET=${GPU_RUN_BUDGET:-450}
BUDGET_START=$(date +%s)

run_part() {  # run_part NAME SECONDS COMMAND...
    local name=$1 limit=$2 start end rc left
    shift 2
    left=$((BUDGET - ($(date +%s) - BUDGET_START)))
    [ "$left" -lt "$limit" ] && limit=$left
    echo
    start=$(date +%s.%N)
    if [ "$limit" -lt 20 ]; then
        echo "== $name: not started: ${left}s left of the run's ${BUDGET}s budget" \
            | tee "$LOGS/$name.log"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" 125 "$limit" "$start" "$start" "$*" \
            >> "$LOGS/parts.tsv"
        return
    fi
    echo "== $name: $* (timeout ${limit}s)"
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
run_part local "${GPU_RUN_T_LOCAL:-45}" python3 -m nbtrain.bench.local_parts
run_part bench "${GPU_RUN_T_BENCH:-120}" "${NBTRAIN[@]}" bench \
    ${NBTRAIN_BENCH_ARGS:---ranks 1 --device cuda --model-size small --steps 10 --rounds 1}
run_part mfu "${GPU_RUN_T_MFU:-150}" "${NBTRAIN[@]}" bench --mfu ${NBTRAIN_MFU_ARGS:---device cuda}
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
