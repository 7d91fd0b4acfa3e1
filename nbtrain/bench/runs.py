"""What every `nbtrain bench` mode shares: the backend its ranks use and its --json file."""

from __future__ import annotations

import json


def backend_of(args) -> str:
    """nccl when a GPU is there and --device does not ask for the CPU, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"


def write_json(path: str | None, result) -> None:
    """Writes `result` to `path` (--json), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
