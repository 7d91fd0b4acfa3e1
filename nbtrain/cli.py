"""`nbtrain demo | bench | report | plan | validate`: the command-line entry point.

Each subcommand lives in its own module; this file only dispatches, so
`nbtrain --help` stays fast (no torch import until a subcommand runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

COMMANDS = {
    "demo": ("nbtrain.demo", "train a small GPT with ZeRO-3 on local ranks"),
    "bench": (
        "nbtrain.bench",
        "measure nbtrain against its torch peer in one run: ZeRO-3/2 "
        "against FSDP2 and DDP; --tp-size against DTensor, "
        "--pipe-size against torch pipelining; --memory, --moe, "
        "--ring, --mfu, --compile, --dtype bf16",
    ),
    "report": ("nbtrain.telemetry.report", "render a telemetry run folder to PNG or HTML"),
    "plan": (
        "nbtrain.planner.cli",
        "predict each rank's peak memory for a layout (--tp-size, --pipe-size, "
        "--cp-size, --ep-size, --zero-level, --offload); --device-memory: which "
        "layouts over --ranks fit",
    ),
    "validate": (
        "nbtrain.runtime.validate",
        "train a layout (--tp-size, --pipe-size, "
        "--zero-level, --num-micro-batches; any "
        "registered model or a Hugging Face folder) "
        "beside one plain process, step by step; exit 1 "
        "beyond --tolerance",
    ),
}


def _usage() -> str:
    lines = ["usage: nbtrain <command> [options]", "", "commands:"]
    for name, (_, doc) in COMMANDS.items():
        lines += textwrap.wrap(doc, 80, initial_indent=f"  {name:<9}", subsequent_indent=" " * 11)
    lines += ["", "`nbtrain <command> --help` for a command's options."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line as one argparse parser, each command's own parser a
    subcommand of it (imports every command's module: for checks, not for `--help`)."""
    parser = argparse.ArgumentParser(prog="nbtrain", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (module, doc) in COMMANDS.items():
        own = importlib.import_module(module).build_parser()
        commands.add_parser(
            name, parents=[own], add_help=False, help=doc, description=own.description
        )
    return parser


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
