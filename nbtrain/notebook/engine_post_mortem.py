"""The ranks' half of `%nbtrain debug`: each engine keeps the last cell that raised on it
and answers the notebook's questions about it (its frames, a frame's locals, an
expression evaluated in a frame). Sent by reference, like engine_boot: keep it free of
ipyparallel and of anything slow.

What is kept is the exception of the last `%%distributed` cell that raised on this rank,
as IPython keeps `sys.last_traceback` for `%debug`. Its traceback holds every frame of
the failure alive, and with them their locals (a batch, activations, GPU memory): the
failure is dropped when the next cell starts on this rank, and `clear()`
(`%nbtrain debug --clear`) frees those frames at once.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import re
import reprlib
import sys
import traceback

# Frames of the engine's machinery, not of the user's code.
_INTERNAL_FRAME = re.compile(
    r"[/\\](IPython|ipykernel|ipyparallel)[/\\]|[/\\]nbtrain[/\\]notebook[/\\]"
)
_HIDDEN_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
_MAX_LOCALS = 40  # a module frame's locals are the whole namespace
_LOCAL_REPR_CHARS = 80
_RESULT_REPR_CHARS = 2000
_SHOWN_TENSOR_NUMEL = 64  # a tensor this small is printed whole, a larger one summarised


class _Failure:
    """An exception of a failed cell, its user frames and the namespaces that
    expressions evaluated in each frame share (so `x = 1` then `x` works, as in pdb)."""

    def __init__(self, exc: BaseException):
        self.exc = exc
        self.summary = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        self.frames = [
            (frame, line)
            for frame, line in traceback.walk_tb(exc.__traceback__)
            if not _INTERNAL_FRAME.search(frame.f_code.co_filename)
        ]
        self.namespaces: dict[int, dict] = {}

    def namespace(self, index: int) -> dict:
        if index not in self.namespaces:
            frame = self.frames[index][0]
            scope = frame.f_locals
            # A module frame's locals are its globals: assignments land in the namespace.
            self.namespaces[index] = scope if scope is frame.f_globals else dict(scope)
        return self.namespaces[index]


_failure: _Failure | None = None


def watch(shell) -> None:
    """Keep each failing cell's exception on this engine (once per engine)."""
    for event, callback in (("pre_run_cell", _forget), ("post_run_cell", _keep)):
        if callback not in shell.events.callbacks[event]:
            shell.events.register(event, callback)


def _forget(info=None) -> None:
    global _failure
    _failure = None


def _keep(result) -> None:
    global _failure
    exc = getattr(result, "error_in_exec", None)
    if exc is not None and exc.__traceback__ is not None:
        _failure = _Failure(exc)


# Frames of the collective machinery: after the groups are rebuilt, what they hold is
# the aborted groups.
_MACHINERY_FRAME = re.compile(
    r"[/\\](torch[/\\]distributed|nbtrain[/\\](comm|zero|optim|pipeline|moe|context_parallel))[/\\]"
)


def release_aborted_groups() -> int:
    """After a rebuild: clear the locals of the kept failures' frames inside the
    collective machinery (nbtrain's and torch.distributed's; not the user's, which
    `%nbtrain debug` reads). Through them a traceback kept the aborted process group
    alive, and with it gloo's threads and sockets: two threads more per failure, and
    one of its loops spinning a core on the sockets the abort closed. The failures
    kept: this module's, and IPython's `sys.last_value`; IPython's traceback printer
    keeps the last one whole for `%debug` (`InteractiveTB.tb`), which is let go (this
    module's keeps the user's frames). Returns the frames cleared."""
    from IPython import get_ipython

    shell = get_ipython()
    printer = getattr(shell, "InteractiveTB", None)
    if printer is not None and getattr(printer, "tb", None) is not None:
        printer.tb = None
    roots = [getattr(sys, "last_value", None), getattr(sys, "last_exc", None)]
    if _failure is not None:
        roots.append(_failure.exc)
    cleared, seen = 0, set()
    while roots:
        exc = roots.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        roots += [exc.__cause__, exc.__context__, getattr(exc, "backend_error", None)]
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            if _MACHINERY_FRAME.search(frame.f_code.co_filename):
                with contextlib.suppress(RuntimeError):  # a frame still running
                    frame.clear()
                    cleared += 1
    # Frames and tracebacks refer to each other: only the cycle collector frees them
    # (and the groups they held) before the next automatic collection, maybe much later.
    import gc

    gc.collect()
    return cleared


def _require() -> _Failure:
    if _failure is None:
        raise LookupError("no failed cell on this rank")
    return _failure


def summary() -> dict | None:
    """The kept failure: {"summary": "ValueError: ...", "frames": [...]}, or None.

    Each frame is {"file", "line", "function", "source"}, outermost first.
    """
    if _failure is None:
        return None
    return {
        "summary": _failure.summary,
        "frames": [_describe_frame(f, line) for f, line in _failure.frames],
    }


def _describe_frame(frame, line: int) -> dict:
    filename = frame.f_code.co_filename
    return {
        "file": _code_name(filename),
        "line": line,
        "function": frame.f_code.co_name,
        "source": linecache.getline(filename, line).strip(),
        "library": _is_library(filename),
    }


def _code_name(filename: str) -> str:
    """`Cell In[3]` for a cell's code, as IPython's tracebacks say; a file under the
    working folder relative to it; else the path."""
    from IPython import get_ipython

    shell = get_ipython()
    named = shell.compile.format_code_name(filename) if shell is not None else None
    if named:
        return " ".join(named)
    here = os.getcwd()
    if os.path.isabs(filename) and os.path.commonpath([here, filename]) == here:
        return os.path.relpath(filename, here)
    return filename


def _library_folders() -> tuple[str, ...]:
    """torch's and nbtrain's package folders, and every installed-packages folder."""
    folders = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # nbtrain/
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        folders.append(os.path.dirname(os.path.abspath(torch.__file__)))
    folders += [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    return tuple(os.path.join(f, "") for f in folders)


def _is_library(filename: str) -> bool:
    """A frame of torch, nbtrain or an installed package: `%nbtrain debug` hides it
    unless asked (`--all-frames`), so the user's failing layer is near the top."""
    return os.path.abspath(filename).startswith(_library_folders())


def frame_locals(index: int) -> dict[str, str]:
    """The locals of frame `index` (of `summary()["frames"]`): name -> a short line
    (a tensor's shape, dtype and device; otherwise type and a bounded repr)."""
    names = _require().namespace(index)
    shown = {}
    for name, value in names.items():
        if name.startswith("_") or name in _HIDDEN_NAMES or type(value).__name__ == "module":
            continue
        if len(shown) == _MAX_LOCALS:
            shown["..."] = f"{len(names) - _MAX_LOCALS} more names"
            break
        shown[name] = describe(value)
    return shown


def describe(value, limit: int = _LOCAL_REPR_CHARS) -> str:
    """One line about `value`: `Tensor (4, 3) float32 cpu`, `Tensor () float32 cpu = 0.5`,
    `int 41`, `list [1, 2, ...]`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        scalar = f" = {value.item()}" if value.numel() == 1 else ""  # a loss, a step count
        return f"Tensor {tuple(value.shape)} {dtype} {value.device}{scalar}"
    return f"{type(value).__name__} {_bounded_repr(value, limit)}"


def _bounded_repr(value, limit: int) -> str:
    shorten = reprlib.Repr()
    shorten.maxstring = shorten.maxother = limit
    try:
        text = shorten.repr(value)
    except Exception as err:  # a broken __repr__ must not end the session
        return f"<repr failed: {type(err).__name__}: {err}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def evaluate(source: str, index: int, want_value: bool) -> dict:
    """Evaluate `source` in frame `index`: as an expression, else as statements.

    Returns:
        {"output": what it printed, "text": the result shown (None for statements),
         "value": the result itself when `want_value` (it must pickle), "error": the
         exception line if it raised, else None}.
    """
    failure = _require()
    frame = failure.frames[index][0]
    scope = failure.namespace(index)
    printed = io.StringIO()
    value, text = None, None
    try:
        with contextlib.redirect_stdout(printed):
            try:
                code = compile(source, "<nbtrain debug>", "eval")
            except SyntaxError:
                exec(compile(source, "<nbtrain debug>", "exec"), frame.f_globals, scope)
            else:
                value = eval(code, frame.f_globals, scope)
                text = _show(value)
    except Exception as err:  # the user's expression: report it, as pdb does
        return {"output": printed.getvalue(), "text": None, "value": None, "error": _line(err)}
    return {
        "output": printed.getvalue(),
        "text": text,
        "value": value if want_value else None,
        "error": None,
    }


def _show(value) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() <= _SHOWN_TENSOR_NUMEL:
            return repr(value)
        return describe(value)
    return _bounded_repr(value, _RESULT_REPR_CHARS)


def _line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def clear() -> bool:
    """Drop the kept failure and free its frames' locals. True if there was one."""
    global _failure
    failure, _failure = _failure, None
    if failure is None:
        return False
    if getattr(sys, "last_value", None) is failure.exc:  # IPython's %debug state, same failure
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
    failure.namespaces.clear()
    traceback.clear_frames(failure.exc.__traceback__)  # also where IPython still holds it
    return True
