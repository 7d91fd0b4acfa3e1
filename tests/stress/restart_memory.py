"""Does the notebook's kernel stay bounded over `%nbtrain restart`s with dashboards shown?

    python tests/stress/restart_memory.py [--rounds 10] [--ranks 2]
                                          [--max-mib-a-round 1] [--max-widgets-a-round 8]

Drives a real IPython kernel (jupyter_client, as Jupyter does): `%load_ext nbtrain`,
`%nbtrain start`, `%nbtrain dashboard`, then `--rounds` times a `%%distributed
--dashboard` cell that builds and trains a small ZeRO-3 GPT (a new dashboard each), and
`%nbtrain restart`. After each round it prints the kernel's widgets and RSS. From the
second round's end on (the first two pay for imports and the first retired dashboard),
the growth a round must stay within the limits; exit status 1 otherwise. An old dashboard keeps its table and last picture in
the notebook (7 widgets); everything else of it, and of the engines it showed, goes.

Before (main 2026-12-04, 6 rounds on 2 ranks): +118 widgets and +5.5 to +7.6 MiB a
round. The script runs the nbtrain of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

# Run by path, this folder is first on the search path: the soak's kernel driver.
from engine_memory import MODEL
from soak_session import Kernel, rss_mib

TRAIN = (
    "%%distributed --dashboard\n"
    + MODEL
    + """\
for n in nbt.progress(range(8), desc="train"):
    data = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(n))
    manager.zero_grad()
    manager.backward(model.loss(data, data.roll(1, dims=1)))
    manager.step()
"""
)
# The widgets outside the dashboard shown now: those of the old dashboards and of
# anything else left behind. (The current one's own count varies from round to round:
# its live panels make their marks as their data first arrives.)
WIDGETS = """import gc, ipywidgets as _iw, ipywidgets.widgets.widget as _w
from nbtrain.notebook import dashboard as _d
gc.collect()
_seen, _todo = set(), [_d.current().widget] if _d.current() else []
while _todo:
    _x = _todo.pop()
    if isinstance(_x, (list, tuple)):
        _todo.extend(_x)
    elif isinstance(_x, _iw.Widget) and _x.model_id not in _seen:
        _seen.add(_x.model_id)
        _todo.extend(getattr(_x, _n, None) for _n in _x.keys)
print("WIDGETS", len(set(_w._instances) - _seen), len(_w._instances))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-mib-a-round", type=float, default=1.0)
    parser.add_argument("--max-widgets-a-round", type=int, default=8)
    args = parser.parse_args(argv)
    if args.rounds < 4:
        parser.error("--rounds: at least 4 (the first two pay for imports)")
    with tempfile.TemporaryDirectory(prefix="nbtrain-restarts-") as work:
        kernel = Kernel(f"{work}/home", work)

        def local(code: str) -> str:
            ok, text = kernel.run(code)
            if not ok:
                raise RuntimeError(f"a notebook cell failed:\n{code}\n{text}")
            return text

        rows = []
        try:
            local("%load_ext nbtrain")
            local(f"%nbtrain start -n {args.ranks} --backend gloo")
            local("%nbtrain dashboard")
            for r in range(args.rounds):
                local(TRAIN)
                local("%nbtrain restart")
                widgets = int(local(WIDGETS).split("WIDGETS", 1)[1].split()[0])
                rows.append((widgets, rss_mib(kernel.pid)))
                print(
                    f"round {r}: widgets outside the shown dashboard {widgets}, kernel {rows[-1][1]:.1f} MiB",
                    flush=True,
                )
            local("%nbtrain stop")
        finally:
            kernel.shutdown()
    (w1, m1), (wn, mn) = rows[1], rows[-1]
    per_widgets, per_mib = (wn - w1) / (len(rows) - 2), (mn - m1) / (len(rows) - 2)
    print(
        f"\nrestart memory: {args.rounds} rounds on {args.ranks} ranks; after the second, "
        f"{per_widgets:+.1f} widgets and {per_mib:+.2f} MiB a round"
    )
    if per_widgets > args.max_widgets_a_round or per_mib > args.max_mib_a_round:
        print(
            f"over the limits: {args.max_widgets_a_round} widgets, "
            f"{args.max_mib_a_round} MiB a round"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
