"""`nbtrain report RUN_DIR -o report.png|report.html`: a torchrun run's telemetry, drawn.

Replays each rank's JSONL file (written by `telemetry.start(run_dir)`) through the
same `StepLog` the notebook uses and draws the same panels as the live dashboard
(`telemetry.panels`): step time and tokens/s per rank with the skew between ranks,
loss with user metrics, grad norm, learning rate, hidden-comm share per step,
memory over time, the model-state split, comm bytes and bandwidth by kind, and the
last step's timeline (a pipeline's stages and micro-batches, if the ranks ran one);
and prints one row of numbers per rank, and a pipeline's measured bubble beside the
theory's.
"""

from __future__ import annotations

import argparse
import base64
import glob
import html
import json
import os
import re
import statistics
import sys

from . import pipeline_view
from .steplog import StepLog


def load_run(run_dir: str) -> dict[int, dict]:
    """{rank: summary} from `run_dir/rank<r>.jsonl`; a torn last line is skipped."""
    summaries = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "rank*.jsonl"))):
        match = re.search(r"rank(\d+)\.jsonl$", path)
        log = StepLog(history=1_000_000)
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    log.feed(json.loads(line))
                except (json.JSONDecodeError, KeyError):
                    continue  # a rank killed mid-write leaves a partial line
        summaries[int(match.group(1))] = log.summary()
    return summaries


def rank_table(summaries: dict) -> list[dict]:
    """One row per rank: steps, last loss, median step time, tokens/s and hidden share,
    peak memory."""
    from .panels import step_times

    rows = []
    for r, s in sorted(summaries.items()):
        shares = [o for _, o in s["overlap"] if o is not None]
        losses = [m["loss"] for m in s["metrics"] if m.get("loss") is not None]
        times = step_times(s)
        rates = [
            m["tokens"] / times[m["step"]]
            for m in s["metrics"]
            if m.get("tokens") and times.get(m["step"])
        ]
        peak = s["peak_memory"]
        rows.append(
            {
                "rank": r,
                "steps": len(s["overlap"]),
                "last_loss": losses[-1] if losses else None,
                "step_ms_median": 1e3 * statistics.median(times.values()) if times else None,
                "tokens_per_s_median": statistics.median(rates) if rates else None,
                "hidden_comm_median": statistics.median(shares) if shares else None,
                # device memory on a GPU rank (the process RSS there is mostly
                # the CUDA libraries), the process's RSS on a CPU rank
                "peak_kind": "cuda" if peak.get("cuda_peak_bytes") else "rss",
                "peak_mib": (peak.get("cuda_peak_bytes") or peak.get("rss_bytes", 0)) / 2**20,
                "model_state_mib": (s["memory"].get("model_state_bytes") or 0) / 2**20,
            }
        )
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def text_table(rows: list[dict]) -> str:
    lines = ["rank  steps  last loss  ms/step  tokens/s  hidden comm  peak MiB  model state MiB"]
    for row in rows:
        share = None if row["hidden_comm_median"] is None else 100 * row["hidden_comm_median"]
        lines.append(
            f"{row['rank']:>4}  {row['steps']:>5}  {_fmt(row['last_loss'], '9.4f')}  "
            f"{_fmt(row.get('step_ms_median'), '7.1f')}  "
            f"{_fmt(row.get('tokens_per_s_median'), '8.0f')}  "
            f"{_fmt(share, '10.1f')}%  {row['peak_mib']:8.1f}  "
            f"{row['model_state_mib']:15.2f}"
        )
    kinds = {row.get("peak_kind", "rss") for row in rows}
    lines.append(
        "ms/step and tokens/s: medians over steps; peak: "
        + " and ".join(
            {
                "cuda": "CUDA memory allocated (torch.cuda.max_memory_allocated)",
                "rss": "process resident memory (CPU rank)",
            }[k]
            for k in sorted(kinds)
        )
    )
    return "\n".join(lines)


def write_html(path: str, png: bytes, rows: list[dict], run_dir: str) -> None:
    image = base64.b64encode(png).decode("ascii")
    table = html.escape(text_table(rows))
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"<!doctype html><html><head><meta charset='utf-8'><title>nbtrain report"
            f"</title></head><body><h1>nbtrain report: {html.escape(run_dir)}</h1>"
            f"<img alt='telemetry panels' src='data:image/png;base64,{image}'>"
            f"<pre>{table}</pre></body></html>\n"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="folder with rank<r>.jsonl files")
    parser.add_argument(
        "-o",
        "--output",
        default="report.png",
        help="output file: .png, or .html (the figure embedded, plus a table)",
    )
    parser.add_argument("--dpi", type=int, default=100)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    summaries = load_run(args.run_dir)
    if not summaries:
        print(f"nbtrain report: no rank*.jsonl files in {args.run_dir}", file=sys.stderr)
        return 1
    from .panels import png_bytes

    png = png_bytes(summaries, dpi=args.dpi)
    rows = rank_table(summaries)
    if args.output.endswith(".html"):
        write_html(args.output, png, rows, args.run_dir)
    else:
        with open(args.output, "wb") as f:
            f.write(png)
    print(text_table(rows))
    pipeline = pipeline_view.analyse(summaries)
    if pipeline is not None:
        print(pipeline_view.describe(pipeline))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
