"""Recording overhead: median step time with telemetry on (JSONL included) vs off.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/telemetry/measure_overhead.py
Alternates blocks of steps on and off so that drift hits both modes alike.
"""

import statistics
import sys
import tempfile
import time

import torch

import nbtrain as nbt
from nbtrain import telemetry
from nbtrain.models import GPT, GPTConfig


def main(rounds: int = 6, steps_per_block: int = 5) -> None:
    torch.set_num_threads(1)
    nbt.init_distributed(seed=0)
    cfg = GPTConfig(hidden=128, heads=4, layers=4, seq_len=64, vocab_size=256)
    model = nbt.wrap(GPT(cfg), zero_level=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1))
    telemetry.start(tempfile.mkdtemp(prefix="nbtrain-overhead-"))
    telemetry.watch(model, opt)
    times = {True: [], False: []}

    def step(record: bool):
        start = time.perf_counter()
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        telemetry.metric(loss=loss.detach(), lr=1e-3, step_time_s=time.perf_counter() - start)
        telemetry.next_step()
        return time.perf_counter() - start

    for _ in range(3):
        step(True)  # warm-up
    for r in range(rounds):
        for record in (True, False) if r % 2 == 0 else (False, True):
            telemetry.set_enabled(record)
            times[record] += [step(record) for _ in range(steps_per_block)]
    telemetry.set_enabled(True)
    telemetry.stop()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    events = len(
        [e for e in telemetry.RECORDER.snapshot() if e["step"] == telemetry.RECORDER.step - 1]
    )
    nbt.print_rank(
        f"step time on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, "
        f"overhead {100 * (on / off - 1):+.2f}% ({events} events per step)"
    )
    nbt.comm.shutdown()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
