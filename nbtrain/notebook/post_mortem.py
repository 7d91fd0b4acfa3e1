"""Post-mortem on one rank: the frames of the last `%%distributed` cell that raised there,
a frame's locals, and expressions evaluated in that frame, as `%debug` does on one
process (`%nbtrain debug`; the ranks' half is engine_post_mortem).

Nothing is restarted: every question runs on the chosen rank only, through
ipyparallel, so the other ranks and their namespaces are untouched. A rank keeps its
failure until the next cell starts on it; `clear_failures` frees it (and the frames'
locals it keeps alive) at once.

    pm = post_mortem(cluster)       # the lowest failing rank, its innermost frame
    pm.frames(); pm.locals(); pm.eval("x.shape"); pm.up().eval("batch")
"""

from __future__ import annotations

import re

from . import engine_post_mortem as _engine
from .errors import DistributedError

_ANSWER_TIMEOUT_S = 30.0
_QUIT = {"", "q", "quit", "exit"}


def _ask(cluster, ranks: list[int], fn, *args) -> list:
    """`fn(*args)` on each rank of `ranks`; their answers in order."""
    view = cluster.client.direct_view([cluster.engine_id(r) for r in ranks])
    try:
        return view.apply_async(fn, *args).get(timeout=_ANSWER_TIMEOUT_S)
    except Exception as err:  # a RemoteError or a timeout, named below
        names = ", ".join(map(str, ranks))
        raise DistributedError(
            f"rank(s) {names} did not answer the post-mortem ({type(err).__name__}: {err}); "
            "a rank still running a cell answers when it is done (`%nbtrain status`)"
        ) from None


def _live_ranks(cluster, rank: int | None) -> list[int]:
    if rank is not None and not 0 <= rank < cluster.world_size:
        raise ValueError(
            f"--rank {rank}: the cluster has ranks 0 to {cluster.world_size - 1}; "
            "give one of them, e.g. --rank 0"
        )
    pending = cluster.pending
    if pending is not None and pending.busy():
        raise ValueError(
            "a --noblock cell is still running on rank(s) "
            f"{', '.join(map(str, pending.busy()))}: `%nbtrain wait` for it first"
        )
    ranks = range(cluster.world_size) if rank is None else [rank]
    dead = set(cluster.dead_ranks(ranks))
    return [r for r in ranks if r not in dead]


def failures(cluster, rank: int | None = None) -> dict[int, dict]:
    """The failures the ranks keep (or `rank`'s): rank -> {"summary", "frames"}."""
    ranks = _live_ranks(cluster, rank)
    answers = _ask(cluster, ranks, _engine.summary) if ranks else []
    return {r: a for r, a in zip(ranks, answers) if a is not None}


def clear_failures(cluster, rank: int | None = None) -> list[int]:
    """Drop the failure kept on every rank (or on `rank`) and free its frames' locals.

    Returns:
        The ranks that had one.
    """
    ranks = _live_ranks(cluster, rank)
    answers = _ask(cluster, ranks, _engine.clear) if ranks else []
    return [r for r, had in zip(ranks, answers) if had]


def post_mortem(
    cluster, rank: int | None = None, frame: int = -1, all_frames: bool = False
) -> "PostMortem":
    """Open the failure of the last cell that raised on `rank` (default: the lowest
    failing rank), at user frame `frame` (0 the outermost, -1 the innermost). Frames
    of torch, nbtrain and installed packages are hidden unless `all_frames`.

    Raises:
        ValueError: no rank keeps a failure, `rank` does not, or `frame` is out of range.
    """
    found = failures(cluster, rank)
    if not found:
        where = "any rank" if rank is None else f"rank {rank}"
        others = "" if rank is None else _other_failures(cluster)
        raise ValueError(
            f"no failed cell to debug on {where}{others}: run `%nbtrain debug` after a "
            "`%%distributed` cell raises, before the next cell runs on that rank"
        )
    chosen = min(found) if rank is None else rank
    return PostMortem(
        cluster, chosen, found[chosen], frame, failing=sorted(found), all_frames=all_frames
    )


def _other_failures(cluster) -> str:
    ranks = sorted(failures(cluster))
    return f" (failing: rank(s) {', '.join(map(str, ranks))})" if ranks else ""


class PostMortem:
    """The frames of one rank's failed cell; one of them is current (`frame`)."""

    def __init__(
        self,
        cluster,
        rank: int,
        failure: dict,
        frame: int = -1,
        failing=(),
        all_frames: bool = False,
    ):
        self.cluster, self.rank = cluster, rank
        self.summary: str = failure["summary"]
        every = failure["frames"]
        # The engine numbers every frame; these are the ones shown (library frames out).
        self._engine_index = [
            i for i, f in enumerate(every) if all_frames or not f.get("library")
        ] or list(range(len(every)))
        self._frames: list[dict] = [every[i] for i in self._engine_index]
        self.hidden = len(every) - len(self._frames)
        self.failing: list[int] = list(failing) or [rank]
        if not self._frames:
            raise ValueError(f"rank {rank}'s failure ({self.summary}) has no frame of user code")
        self.frame = self._index(frame)

    def _index(self, frame: int) -> int:
        count = len(self._frames)
        if not -count <= frame < count:
            raise ValueError(
                f"--frame {frame}: rank {self.rank}'s failure has frames 0 (outermost) to "
                f"{count - 1} (innermost, also -1); e.g. --frame -1"
            )
        return frame % count

    def frames(self) -> list[dict]:
        """The user frames, outermost first: {"file", "line", "function", "source"}."""
        return [dict(f) for f in self._frames]

    def select(self, frame: int) -> "PostMortem":
        self.frame = self._index(frame)
        return self

    def up(self) -> "PostMortem":
        """The caller's frame (as pdb's `up`); stays at the outermost."""
        self.frame = max(self.frame - 1, 0)
        return self

    def down(self) -> "PostMortem":
        """The callee's frame (as pdb's `down`); stays at the innermost."""
        self.frame = min(self.frame + 1, len(self._frames) - 1)
        return self

    def locals(self) -> dict[str, str]:
        """The current frame's locals: name -> type and short repr (tensors: shape,
        dtype, device). Runs on this rank only."""
        return self._ask(_engine.frame_locals, self._engine_index[self.frame])

    def eval(self, source: str):
        """`source` evaluated in the current frame on this rank (statements are
        executed; None); the value comes back pickled, so it must pickle.

        Raises:
            DistributedError: the expression raised on the rank.
        """
        answer = self._ask(_engine.evaluate, source, self._engine_index[self.frame], True)
        if answer["output"]:
            print(answer["output"], end="")
        if answer["error"] is not None:
            raise DistributedError(f"{self._where()}: `{source}` raised {answer['error']}")
        return answer["value"]

    def show(self, source: str) -> str:
        """What `%nbtrain debug EXPR` prints: the output and result of `source` (a
        short summary for a large tensor), or `*** Error: ...` as pdb prints it."""
        answer = self._ask(_engine.evaluate, source, self._engine_index[self.frame], False)
        parts = [answer["output"].rstrip("\n")] if answer["output"] else []
        if answer["error"] is not None:
            parts.append(f"*** {answer['error']}")
        elif answer["text"] is not None:
            parts.append(answer["text"])
        return "\n".join(parts)

    def render(self) -> str:
        """The failing ranks, this rank's frames (the current one marked) and its locals."""
        lines = [f"rank {self.rank} raised {self.summary}"]
        if self.failing != [self.rank]:
            lines[0] += f" (failing ranks: {', '.join(map(str, self.failing))}; --rank R picks)"
        hidden = f"; {self.hidden} of torch, nbtrain and packages hidden, --all-frames shows"
        lines.append(
            f"frames, outermost first (--frame N picks one{hidden if self.hidden else ''}):"
        )
        for i, f in enumerate(self._frames):
            mark = ">" if i == self.frame else " "
            lines.append(f"{mark} {i}  {f['file']}, line {f['line']}, in {f['function']}")
            if f["source"]:
                lines.append(f"        {f['source']}")
        lines.append(f"locals of frame {self.frame} ({self._frames[self.frame]['function']}):")
        shown = self.locals()
        width = max((len(n) for n in shown), default=0)
        lines.extend(f"  {name:<{width}}  {text}" for name, text in shown.items())
        if not shown:
            lines.append("  (none)")
        return "\n".join(lines)

    def interact(self, read=input) -> None:
        """A prompt in the current frame: each line is evaluated there and shown; `up`,
        `down`, `where` and `locals` move and look, as in pdb; `q` or an empty line ends."""
        print(self.render())
        while True:
            line = read(f"rank {self.rank} frame {self.frame}> ").strip()
            if line in _QUIT:
                return
            if line in ("u", "up", "d", "down"):
                (self.up if line[0] == "u" else self.down)()
                f = self._frames[self.frame]
                print(f"> {self.frame}  {f['file']}, line {f['line']}, in {f['function']}")
            elif line in ("w", "where", "locals"):
                print(self.render())
            else:
                print(self.show(line))

    def _ask(self, fn, *args):
        return _ask(self.cluster, [self.rank], fn, *args)[0]

    def _where(self) -> str:
        return f"rank {self.rank}, frame {self.frame} ({self._frames[self.frame]['function']})"

    def __repr__(self) -> str:
        return f"<PostMortem rank {self.rank} frame {self.frame}: {self.summary}>"


_FLAG_WITH_VALUE = {"--rank", "--frame"}
_FLAG_ALONE = {"-i", "--interactive", "--clear", "-h", "--help", "--all-frames"}


def split_expression(line: str) -> tuple[str, str]:
    """`debug [flags] EXPR` -> ("debug [flags]", "EXPR"), EXPR kept verbatim (its
    quotes and spaces); any other line comes back whole, with no expression."""
    words = list(re.finditer(r"\S+", line))
    if not words or words[0].group() != "debug":
        return line, ""
    i = 1
    while i < len(words):
        word = words[i].group()
        if word in _FLAG_WITH_VALUE:
            i += 2
        elif word in _FLAG_ALONE or word.split("=")[0] in _FLAG_WITH_VALUE:
            i += 1
        else:
            return line[: words[i].start()].rstrip(), line[words[i].start() :].strip()
    return line, ""
