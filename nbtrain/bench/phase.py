"""Peak memory of one phase of work, per process: what `nbtrain bench --memory` (and the
tests and tutorials measuring memory) read.

`Phase(device)` measures the rise of the resident high-water mark (Linux's VmHWM,
reset at the start) above what the process held when the phase began, and the GPU's
peak allocation beside it; `fix_mmap_threshold()` makes freed large blocks go back to
the system, so each phase's peak is its own.
"""

from __future__ import annotations

import gc
import time

MB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Phase:
    """Measures one phase: the resident high-water mark's rise (and the GPU's peak)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.gpu_base = torch.cuda.memory_allocated()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kib("VmRSS") * 1024
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        self.seconds = time.perf_counter() - self.start
        self.host = _status_kib("VmHWM") * 1024 - self.base
        self.gpu = (
            torch.cuda.max_memory_allocated() - self.gpu_base
            if self.device.type == "cuda"
            else None
        )
        return False


def fix_mmap_threshold() -> bool:
    """Makes glibc allocate large blocks (128 KiB up) with mmap, given back to the system
    when freed, and stop raising that threshold (M_MMAP_THRESHOLD = -3): a phase's
    peak is then its own, not what the allocator kept from an earlier phase. Returns
    whether glibc took it (False off glibc). Local."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024) == 1
    except (OSError, AttributeError):
        return False


def peak_of(per_rank: list, phase: str) -> int:
    """The worst rank's peak for `phase`: its device peak on a GPU, else its host peak."""
    return max(r[phase][1] if r[phase][1] is not None else r[phase][0] for r in per_rank)
