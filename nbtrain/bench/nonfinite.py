"""What `nbtrain.debug.detect_nonfinite` costs: median step time of a small GPT on one
process with the detector off (no hook installed) and on.

    python -m nbtrain.bench.nonfinite --steps 20

Prints one JSON line: the median step milliseconds off and on, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _median_step_ms(model, optimizer, batches, enabled: bool) -> float:
    from ..debug import detect_nonfinite

    times = []
    with detect_nonfinite(model, enabled=enabled) as watch:
        for ids in batches:
            start = time.perf_counter()
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            watch.step()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])  # two warm-up steps


def measure(steps: int = 20, rows: int = 8) -> dict:
    """{"off_ms", "on_ms", "ratio"}: off and on alternate in 3 rounds; the medians of each."""
    import nbtrain
    from nbtrain.models.gpt import GPT, GPTConfig

    nbtrain.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, hidden=128, heads=4, layers=4)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (rows, 64), generator=gen) for _ in range(steps)]
    off, on = [], []
    for _ in range(3):
        off.append(_median_step_ms(model, optimizer, batches, False))
        on.append(_median_step_ms(model, optimizer, batches, True))
    off_ms, on_ms = statistics.median(off), statistics.median(on)
    return {"off_ms": round(off_ms, 2), "on_ms": round(on_ms, 2), "ratio": round(on_ms / off_ms, 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.steps)))


if __name__ == "__main__":
    main()
