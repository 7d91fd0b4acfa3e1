"""What an engine's shell keeps per cell, bounded: engines live for thousands of cells.

Measured with `tests/stress/engine_memory.py` (3 ranks, 4-step training cells, failing
and stopped cells among them), an engine's shell kept, per cell and forever:

- the cell's source in the input history (`In`, `_iN`, the history's lists): ~370 B;
- the cell's source in `linecache`, for tracebacks: ~510 B;
- the message digests of its requests (replay protection): ~140 B, up to 65,536 of them.

After each cell, `trim` keeps the input history of the last `KEEP_CELLS` cells (older
entries become empty strings, so `In[n]` still indexes cell n) and drops older cells
from `linecache`, unless they define a function, class or lambda: tracebacks through
code a cell defined long ago keep their source lines. Output caches (`Out`, `_N`) are
trimmed the same way. The session keeps the digests of the last `DIGESTS` messages.
"""

from __future__ import annotations

import linecache
import re
import weakref

KEEP_CELLS = 100
DIGESTS = 4096  # the last messages' digests a session remembers (jupyter_client: 65,536)
_DEFINES = re.compile(r"\b(def|class|lambda)\b")
# shell -> the cell number before which its input history is trimmed already
_TRIMMED_TO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(shell) -> None:
    """Bound the shell's per-cell state from now on (every cell's end trims it)."""
    session = getattr(getattr(shell, "kernel", None), "session", None)
    if session is not None:
        session.digest_history_size = DIGESTS
    shell.events.register("post_run_cell", lambda result: trim(shell))


def trim(shell, keep: int = KEEP_CELLS) -> None:
    """Forget what cells older than the last `keep` left in the shell."""
    cutoff = shell.execution_count - keep
    if cutoff <= 0:
        return
    history = shell.history_manager
    ns = shell.user_ns
    done = _TRIMMED_TO.get(shell, 0)  # cells before it are trimmed
    for hist in (history.input_hist_parsed, history.input_hist_raw):
        for n in range(done, min(cutoff, len(hist))):
            hist[n] = ""
    for n in range(done, cutoff):
        ns.pop(f"_i{n}", None)
    _TRIMMED_TO[shell] = max(done, cutoff)
    outputs = ns.get("Out")
    for n in [n for n in history.output_hist if n < cutoff]:
        history.output_hist.pop(n, None)
        if isinstance(outputs, dict):
            outputs.pop(n, None)
        ns.pop(f"_{n}", None)
    names = getattr(shell.compile, "_filename_map", {})
    for name, number in list(names.items()):
        if number >= cutoff:
            continue
        entry = linecache.cache.get(name)
        if entry is not None and _DEFINES.search("".join(entry[2])):
            continue  # its functions may still run: their tracebacks need the lines
        linecache.cache.pop(name, None)
        del names[name]
