"""Markdown summary of a tests/gpu/run.sh run (no torch import; standard library only).

    python3 tests/gpu/summary.py LOG_DIR [--gpus N] [--header TEXT]

LOG_DIR holds parts.tsv (one line per part, tab-separated: name, exit code, timeout
in seconds, start and end epoch seconds, command) and <name>.log (the part's captured output). Prints one table, part
by part: status with the exit code, seconds, and the key numbers grepped from the log
(pytest's counts, the kernel bench's speed-up and memory ratios and goals, nbtrain
bench's ratio lines and loss parity, nbtrain bench --mfu's peak, MFU and ratio lines).
Exits 1 when a part failed, timed out or was not started (exit code 125: the run's
budget was spent), or refused for a reason other than missing GPUs; 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TIMEOUT_CODES = {124, 137}
# The benches' own refusals for want of hardware (kernels/bench.py, nbtrain/bench):
NO_GPU = [
    re.compile(r"needs a CUDA GPU and none is visible"),
    re.compile(r"--ranks \d+ needs \d+ GPUs; \d+ visible"),
]
REFUSALS = NO_GPU + [
    re.compile(r"needs triton"),
    re.compile(r"TRITON_INTERPRET is set"),
    re.compile(r"--ranks must be at least"),
]
PYTEST_COUNTS = re.compile(
    r"\b(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?|rerun)\b"
)


def last_lines(text: str, n: int = 1) -> list[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-n:]


def pytest_numbers(text: str) -> list[str]:
    out = []
    for line in reversed(text.splitlines()):
        if PYTEST_COUNTS.search(line) and re.search(r" in [\d.]+s", line) or "no tests ran" in line:
            counts = ", ".join(f"{n} {what}" for n, what in PYTEST_COUNTS.findall(line))
            out.append(counts or "no tests ran")
            break
    failed = [
        line.split(" - ")[0] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    out += failed[:8] + ([f"... {len(failed) - 8} more"] if len(failed) > 8 else [])
    usage = [line for line in text.splitlines() if line.startswith("ERROR: ")]
    out += usage[:3]
    return out


SPEED = re.compile(
    r"^(\S.*?)\s+ours\s+[\d.]+ ms\s+torch\s+[\d.]+ ms\s+speed-up\s+([\d.]+)x"
    r"(?:.*\(\s*([\d.]+)x less\))?"
)
GOAL = re.compile(r"^\s+(.*?)\s+([\d.]+)x\s+goal >= ([\d.]+)x\s+(met|NOT met)")


def kernel_numbers(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        m = SPEED.match(line)
        if m:
            name, speed, memory = m.groups()
            out.append(
                f"{name}: {speed}x speed" + (f", {memory}x less peak memory" if memory else "")
            )
    goals = [GOAL.match(line) for line in text.splitlines()]
    goals = [g for g in goals if g]
    if goals:
        missed = [f"{g[1]} {g[2]}x < {g[3]}x" for g in goals if g[4] != "met"]
        out.append(
            f"goals met: {len(goals) - len(missed)}/{len(goals)}"
            + ("; NOT met: " + "; ".join(missed) if missed else "")
        )
    return out


RATIO = re.compile(r"^([a-z0-9_]+): ([-\d.]+(?:e[-+]?\d+)?)$")


def bench_numbers(text: str) -> list[str]:
    out = [line.strip() for line in text.splitlines() if line.startswith("nbtrain bench: ")]
    out += [line.strip() for line in text.splitlines() if RATIO.match(line.strip())]
    rows = [line for line in text.splitlines() if line.startswith("| ") and "loss" not in line]
    if rows:
        differ = [row.split("|")[1].strip() for row in rows if "DIFFER" in row]
        out.append("loss parity vs ddp: " + ("DIFFER: " + ", ".join(differ) if differ else "ok"))
    return out


def mfu_numbers(text: str) -> list[str]:
    """`nbtrain bench --mfu`: the peak used (or that none is known), each engine's MFU,
    the tokens/s ratios and compile times, and any engine that failed."""
    lines = [line.strip() for line in text.splitlines()]
    out = [line for line in lines if line.startswith(("peak: ", "no peak known"))]
    out += [line for line in lines if RATIO.match(line)]
    out += [
        " ".join(c.strip() for c in line.split("|")[1:3])
        for line in lines
        if line.startswith("| ") and "FAILED" in line
    ]
    return out


NUMBERS = {
    "tests": pytest_numbers,
    "kernels": kernel_numbers,
    "local": bench_numbers,
    "bench": bench_numbers,
    "mfu": mfu_numbers,
}
NOT_STARTED = 125  # run.sh: the run's time budget was spent before the part began


def judge(
    name: str, rc: int, text: str, gpus: int, limit: str = "?"
) -> tuple[str, bool, list[str]]:
    """(status, counts as a failure, key numbers) for one part."""
    numbers = NUMBERS.get(name, lambda _: [])(text)
    if rc == 0:
        return "pass", False, numbers
    if rc == NOT_STARTED and "not started" in text:
        return "NOT STARTED", True, last_lines(text, 1)
    if rc in TIMEOUT_CODES:
        return (
            "TIMEOUT",
            True,
            [f"killed after the {limit} s timeout"] + (numbers or last_lines(text, 2)),
        )
    tail = last_lines(text, 3)
    refusal = next((line for line in reversed(tail) if any(p.search(line) for p in REFUSALS)), None)
    if refusal is not None:
        hardware = any(p.search(refusal) for p in NO_GPU)
        if hardware:
            return ("refused: no GPU" if gpus == 0 else "refused: too few GPUs"), False, [refusal]
        return "FAIL (refused)", True, [refusal]
    return "FAIL", True, numbers or tail


def cell(lines: list[str]) -> str:
    text = "<br>".join(line.replace("|", "\\|") for line in lines)
    return text or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log_dir", type=Path)
    p.add_argument("--gpus", type=int, default=0, help="CUDA GPUs visible to the run")
    p.add_argument("--header", default="", help="a line printed above the table")
    args = p.parse_args(argv)

    rows, failed, refused = [], [], []
    for line in (args.log_dir / "parts.tsv").read_text().splitlines():
        name, rc, limit, start, end, command = line.split("\t", 5)
        log = args.log_dir / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        status, bad, numbers = judge(name, int(rc), text, args.gpus, limit)
        if bad:
            failed.append(name)
        elif status.startswith("refused"):
            refused.append(name)
        rows.append(
            (
                name,
                f"`{command}`",
                f"{status} ({rc})",
                f"{float(end) - float(start):.0f}",
                cell(numbers),
            )
        )

    if args.header:
        print(args.header)
        print()
    print("| part | command | status (exit code) | seconds | key numbers |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    verdict = [f"FAILED: {', '.join(failed)}"] if failed else ["no part failed"]
    if refused:
        verdict.append(f"not run for want of GPUs: {', '.join(refused)}")
    print("**" + "; ".join(verdict) + "**")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
