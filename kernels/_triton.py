"""Optional Triton import, shared by the op files.

Triton is an optional dependency (the `[gpu]` and `[test]` extras). Without it the
op files must still import, so that `impl="auto"` on CPU can fall back to the torch
references; `triton.jit` then leaves the kernel body as a plain function that is
never launched, because the dispatcher in `nbtrain.kernels` refuses `impl="triton"`.
"""

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Stub:
        """Just enough of `triton` / `triton.language` for the op files to import."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Stub()

# Triton decides at decoration time whether a kernel is interpreted, so what matters
# is the environment when this module was first imported, not when a kernel runs.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()
