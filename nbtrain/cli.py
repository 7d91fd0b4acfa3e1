"""`nbtrain demo | bench | report | validate`: the command-line entry point.

Each subcommand lives in its own module; this file only dispatches, so
`nbtrain --help` stays fast (no torch import until a subcommand runs).
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("nbtrain.demo", "train a small GPT with ZeRO-3 on local ranks"),
    "bench": ("nbtrain.bench", "compare nbtrain ZeRO-3/ZeRO-2 with FSDP2 and DDP (--tp T: "
                               "tensor parallelism with DTensor)"),
    "report": ("nbtrain.telemetry.report", "render a telemetry run folder to PNG or HTML"),
    "validate": ("nbtrain.runtime.validate", "check a parallel layout (--tp, --pp) against "
                                             "the reference, step by step"),
}


def _usage() -> str:
    lines = ["usage: nbtrain <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "`nbtrain <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"nbtrain: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
