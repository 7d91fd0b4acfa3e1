"""`%autodistributed`: an input transformer that runs every plain cell on the ranks
(as if it began with `%%distributed`), and switching it on and off."""

from __future__ import annotations


def autodistribute(lines: list[str]) -> list[str]:
    """Input transformer: prefix the cell with `%%distributed` unless it is a magic,
    a shell command, or empty."""
    first = next((line.lstrip() for line in lines if line.strip()), "")
    if not first or first[0] in "%!":
        return lines
    return ["%%distributed\n"] + lines


def autodistributed_on(shell) -> bool:
    return autodistribute in shell.input_transformers_cleanup


def set_autodistributed(shell, on: bool) -> None:
    transformers = shell.input_transformers_cleanup
    while autodistribute in transformers:
        transformers.remove(autodistribute)
    if on:
        transformers.append(autodistribute)
