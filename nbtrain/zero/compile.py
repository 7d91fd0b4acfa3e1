"""torch.compile of a Block's module: `Block(m, compile=True)` or `block.compile()`.

What is compiled is the wrapped module alone (`torch.compile(module)`), called by the
block between its gather and its release with the parameters' views installed. The
gather, the prefetch of the neighbour, the release and the gradient's reduce-scatter
stay outside the graph, so the block's overlap and memory are unchanged; activation
checkpointing recomputes through the compiled module.

The views the block installs are new tensor objects each forward, but torch.compile
guards on their shape, stride and dtype, not their identity: the first forward
compiles, later ones reuse the code. Blocks whose modules share a class (the layers of
a transformer) share it too, so a model compiles each layer class once.

The compiled module is held outside the module tree: `state_dict()` names are the
module's own (no `_orig_mod.`).

Graph breaks are counted once, at each block's first forward, from torch._dynamo's
counters: `block.compile_stats` holds them, and a warning names the block when there
are any.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class CompileStats:
    """What torch.compile made of a block's module, measured at its first forward.

    Attributes:
        graphs: graphs torch.compile captured for the module (1 without graph breaks).
        graph_breaks: how many times tracing broke off and resumed (graphs - 1 as a
            rule).
        reasons: the first line of each graph break's reason.
        reused: the block compiled nothing itself: it runs code compiled for an earlier
            block of the same module class, whose counts these are.
    """

    graphs: int = 0
    graph_breaks: int = 0
    reasons: list[str] = field(default_factory=list)
    reused: bool = False


# The first count for each module class (its forward's code object), handed to the
# blocks that reuse that class's compiled code.
_BY_CODE: dict = {}


def compile_options(setting) -> dict | None:
    """Block's `compile` argument as torch.compile keywords (None: do not compile).

    False/None: eager; True: torch.compile's defaults; a dict: torch.compile's keywords
    (backend, mode, fullgraph, dynamic, options).
    """
    if setting is None or setting is False:
        return None
    if setting is True:
        return {}
    if isinstance(setting, dict):
        return dict(setting)
    raise TypeError(
        f"compile={setting!r}: use False, True, or a dict of torch.compile "
        "keywords, e.g. dict(backend='aot_eager') or dict(mode='max-autotune')"
    )


def check_available(options: dict, device: torch.device) -> None:
    """Raises a RuntimeError saying why torch.compile cannot run here with `options`."""
    if not hasattr(torch, "compile"):
        raise RuntimeError(
            f"Block(compile=...): this torch ({torch.__version__}) has no "
            "torch.compile (it needs torch >= 2.0); build the block with "
            "compile=False"
        )
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported

        check_if_dynamo_supported()
    except ImportError:
        pass
    except RuntimeError as err:
        raise RuntimeError(
            f"Block(compile=...): torch.compile is unavailable here: {err}. "
            "Build the block with compile=False"
        ) from None
    backend = options.get("backend", "inductor")
    if backend == "inductor" and torch.device(device).type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            from torch._inductor.exc import InvalidCxxCompiler
        except ImportError:  # another torch layout: inductor reports it itself
            return
        try:
            get_cpp_compiler()
        except (InvalidCxxCompiler, OSError) as err:
            raise RuntimeError(
                "Block(compile=...): torch.compile's default backend (inductor) needs a C++ "
                f"compiler for CPU code and found none ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}). Install "
                "one (g++), or compile with dict(backend='aot_eager')"
            ) from None


class CompiledModule:
    """`torch.compile(module, **options)`, counting graphs and breaks on its first call."""

    def __init__(self, module: torch.nn.Module, options: dict, device: torch.device):
        check_available(options, device)
        self.options = dict(options)
        self.fn = torch.compile(module, **options)
        self.code = getattr(type(module).forward, "__code__", None)
        self.class_name = type(module).__name__
        self.stats: CompileStats | None = None

    def __call__(self, label: str, *args, **kwargs):
        if self.stats is not None:
            return self.fn(*args, **kwargs)
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        breaks = dict(counters["graph_break"])
        out = self.fn(*args, **kwargs)
        self._measure(
            label,
            counters["stats"]["unique_graphs"] - graphs,
            {
                k: v - breaks.get(k, 0)
                for k, v in counters["graph_break"].items()
                if v > breaks.get(k, 0)
            },
        )
        return out

    def _measure(self, label: str, graphs: int, new_breaks: dict) -> None:
        if graphs == 0 and self.code in _BY_CODE:
            first = _BY_CODE[self.code]
            self.stats = CompileStats(
                first.graphs, first.graph_breaks, list(first.reasons), reused=True
            )
            return
        reasons = [
            (str(k).strip().splitlines() or ["?"])[0]
            for k, n in new_breaks.items()
            for _ in range(n)
        ]
        self.stats = CompileStats(graphs, len(reasons), reasons)
        _BY_CODE.setdefault(self.code, self.stats)
        if reasons:
            shown = "; ".join(dict.fromkeys(reasons))
            warnings.warn(
                f"Block {label!r}: torch.compile split {self.class_name} into "
                f"{graphs} graphs at {len(reasons)} graph break(s): {shown}. "
                "The parts between breaks run compiled, the breaks themselves "
                "eagerly (block.compile_stats holds the counts)",
                stacklevel=2,
            )
