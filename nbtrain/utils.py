"""`nbtrain.utils`: BMTrain's helpers (`bmt.utils`), printing, memory and averages.

    print_dict("config", {"lr": 1e-3, "steps": 100})
    see_memory("after forward")          # rank 0 prints; the peak starts again
    avg = AverageRecorder(alpha=0.9)
    avg.record(loss.item()); avg.value   # bias-corrected moving average

Also the synchronisation points of BMTrain's `bmt.synchronize` module that are not
`synchronize` itself: `wait_loader` and the deprecated `gather_result`.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any

import torch

from .comm.context import get_context, is_initialized, print_rank

__all__ = [
    "ALIGN",
    "ROW_WIDTH",
    "AverageRecorder",
    "check_torch_version",
    "gather_result",
    "load_nccl_pypi",
    "print_block",
    "print_dict",
    "print_rank",
    "round_up",
    "see_memory",
    "tp_split_tensor",
    "wait_loader",
]

ALIGN = 4  # BMTrain's alignment of flat buffers, in elements (nbtrain pads by partition.py)
ROW_WIDTH = 60  # characters of print_block's title line and print_dict's rows


def round_up(x: int, d: int) -> int:
    """The smallest multiple of `d` that is >= `x`."""
    return (x + d - 1) // d * d


def print_block(title: str, content: str | None = None, file=None) -> None:
    """Prints `title` centred in a line of '=' ROW_WIDTH wide, then `content` if given.

    Local: every rank that calls it prints (use `print_rank` for one rank).
    """
    file = sys.stdout if file is None else file
    fill = ROW_WIDTH - len(title) - 2
    left = fill // 2
    print("=" * left + " " + title + " " + "=" * (fill - left), file=file)
    if content is not None:
        print(content, file=file)


def print_dict(title: str, content: dict[str, Any], file=None) -> None:
    """Prints a dict under `print_block`'s title: one `key : value` row per entry,
    values aligned on a column (a multiple of 4) and wrapped at ROW_WIDTH characters.
    Local."""
    key_width = round_up(max((len(str(k)) for k in content), default=0) + 3, 4)
    value_width = max(ROW_WIDTH - key_width, 20)  # long keys: values still wrap
    rows = []
    for key, value in content.items():
        key = str(key)
        text = str(value) or " "
        rows.append(key + " :" + " " * (key_width - len(key) - 2) + text[:value_width] + "\n")
        for start in range(value_width, len(text), value_width):
            rows.append(" " * key_width + text[start : start + value_width] + "\n")
    print_block(title, "".join(rows), file)


def _rank() -> int:
    return get_context().rank if is_initialized() else 0


def _device() -> torch.device:
    if is_initialized():
        return get_context().device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gib(nbytes: float) -> float:
    return round(nbytes / 1024**3, 2)


# /proc/self/status lines `see_memory(detail=True)` prints on CPU.
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSize", "VmPeak", "VmSwap")


def _process_memory() -> dict[str, int]:
    """This process's memory in bytes, from /proc (Linux), else getrusage's peak."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS_KEYS and value.strip().endswith("kB"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        found["VmHWM"] = peak if sys.platform == "darwin" else peak * 1024  # bytes / KiB
    return found


def _reset_process_peak() -> None:
    # Linux: writing 5 to clear_refs starts the peak resident size (VmHWM) again.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def see_memory(message: str, detail: bool = False) -> None:
    """Prints `message` and this rank's memory on rank 0, then starts the peak again.

    On CUDA (the context's device, or the visible GPU before `init_distributed`) it
    prints what BMTrain prints: the memory allocated by torch now and its peak since
    the last call (`torch.cuda.memory_summary()` with `detail=True`), and resets
    the peak. On CPU there is no allocator to ask: it prints the process's resident
    memory (RSS) now and its peak (`detail=True`: also its anonymous, file and
    shared parts, the virtual size and its peak, and swap, from /proc/self/status),
    and on Linux starts the peak again.

    Every rank resets its own peak; only rank 0 prints. Local (no communication).
    """
    device = _device()
    lines = []
    if device.type == "cuda":
        if detail:
            lines.append(torch.cuda.memory_summary(device))
        else:
            lines.append(f"memory_allocated {_gib(torch.cuda.memory_allocated(device))} GB")
            lines.append(f"max_memory_allocated {_gib(torch.cuda.max_memory_allocated(device))} GB")
        torch.cuda.reset_peak_memory_stats(device)
    else:
        memory = _process_memory()
        if detail:
            lines.extend(f"{key} {_gib(value)} GB" for key, value in memory.items())
        else:
            if "VmRSS" in memory:
                lines.append(f"resident_memory {_gib(memory['VmRSS'])} GB")
            lines.append(f"max_resident_memory {_gib(memory.get('VmHWM', 0))} GB")
        _reset_process_peak()
    if _rank() == 0:
        rule = "=" * 80
        print(message, flush=True)
        print("\n".join([rule, *lines, rule]), flush=True)


def check_torch_version(version_str: str) -> int:
    """torch's version minus `version_str`, each read as major*10000 + minor*100 +
    patch: >= 0 when the installed torch is at least that version."""

    def as_int(text: str) -> int:
        parts = [int(re.match(r"\d*", p).group() or 0) for p in text.split("+")[0].split(".")]
        parts = (parts + [0, 0, 0])[:3]
        return parts[0] * 10000 + parts[1] * 100 + parts[2]

    return as_int(torch.__version__) - as_int(version_str)


def load_nccl_pypi() -> None:
    """Nothing to do in nbtrain: NCCL comes with torch (BMTrain loads the nvidia-nccl
    wheel's library for its own bindings)."""


def tp_split_tensor(tensor: torch.Tensor, split_dim: int) -> torch.Tensor:
    """This tensor-parallel rank's chunk of `tensor` along `split_dim` (a contiguous
    copy), as the tp layers split their weights. Local."""
    topo = get_context().topology
    return tensor.chunk(topo.tp_size, dim=split_dim)[topo.tp_rank].contiguous().clone()


class AverageRecorder:
    """An exponential moving average with bias correction.

    Args:
        alpha: the weight of the old average at each `record`.
        start_value: the average before any record.

    `record(v)` sets avg = alpha * avg + (1 - alpha) * v; `value` is
    avg / (1 - alpha ** records), so the start value does not pull early averages
    towards it (with start_value 0, the first `value` is the first record).
    """

    def __init__(self, alpha: float = 0.9, start_value: float = 0):
        self.alpha = alpha
        self._value = start_value
        self._steps = 0

    def record(self, v: float) -> None:
        self._value = self.alpha * self._value + (1 - self.alpha) * v
        self._steps += 1

    @property
    def value(self) -> float:
        if self._steps <= 0:
            return self._value
        return self._value / (1 - self.alpha**self._steps)


def wait_loader() -> None:
    """BMTrain's sync point between its loader stream and its compute stream.

    nbtrain loads no parameters on a stream of its own (on CPU there are no streams),
    so this only waits: on CUDA for the work queued on the current stream of the
    context's device, on CPU for nothing. Raises before `init_distributed`, as
    BMTrain's does. Local.
    """
    device = get_context().device
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gather_result(result: torch.Tensor) -> torch.Tensor:
    """Every rank's `result` concatenated along dim 0 (rank order), on `result`'s
    device; a 0-d tensor counts as one row. Not differentiable.

    Deprecated, as in BMTrain: use `nbtrain.distributed.all_gather(result)`, which
    stacks instead (shape (world, *result.shape)) and carries gradients.
    Collective: every rank calls it with the same shape.
    """
    warnings.warn(
        "nbtrain.gather_result is deprecated (as bmtrain.gather_result is); use "
        "nbtrain.distributed.all_gather instead",
        DeprecationWarning,
        stacklevel=2,
    )
    from .distributed import all_gather

    rows = result.detach().reshape(1) if result.dim() == 0 else result.detach()
    with torch.no_grad():
        return all_gather(rows).flatten(0, 1)


def sum_loss(loss: torch.Tensor, comm=None) -> torch.Tensor:
    """Mean of `loss` over the ranks of `comm` (None: every rank), BMTrain's name.

    As BMTrain's, it is `nbtrain.distributed.all_reduce(loss, "avg", comm)`:
    differentiable, and a new tensor (`loss` itself is left alone). BMTrain warns that
    the name is deprecated; nbtrain keeps it without a warning.

    Collective: every rank of `comm` calls this.
    """
    from .distributed import all_reduce

    return all_reduce(loss, "avg", comm)
