"""Every command the README and docs/ show, checked against the parsers that will read it.

A shell line `nbtrain <command> ...` (in a code block or inline code) is parsed by the
CLI's own argparse parser (`nbtrain.cli.build_parser`), and a `%nbtrain ...` or
`%%distributed ...` line by the magic's own parser. A synopsis (`[-n N]`,
`gloo|nccl`, an upper-case placeholder such as `RUN_DIR`) cannot be parsed whole:
each flag it names must exist. A failure names the file, the line and the bad flag.
"""

import argparse
import contextlib
import io
import re
import shlex
import warnings
from pathlib import Path

import pytest

from nbtrain.cli import build_parser
from nbtrain.comm.renamed import RenamedFlag

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAGIC = re.compile(r"(%%distributed|%nbtrain|%autodistributed)\b(.*)")
PROMPT = re.compile(r"^[\w.@-]*\$\s+")  # login1$ jupyter lab ...
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # N, S, RUN_DIR, ...


def _own_parser(parser, words: list[str]):
    """The parser whose flags `words` use: the sub-parser of the command or action that
    `words` begin with (`%nbtrain status ...`: status's), else `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and words:
            return action.choices.get(words[0], parser)
    return parser


def _cli_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


def _magic_parsers() -> dict:
    pytest.importorskip("IPython")
    from nbtrain.notebook.magics import NbtrainMagics

    return {
        "%nbtrain": NbtrainMagics.nbtrain.parser,
        "%%distributed": NbtrainMagics.distributed.parser,
        "%autodistributed": None,
    }  # takes on, off or nothing, no flags


def commands(text: str):
    """(line number, "cli" or a magic's name, the words after it, whether inline code)
    for each command shown."""
    found = []  # (line, kind, words, inline)
    lines = text.splitlines()
    in_code = False
    prose: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            prose.append((number, line))
            continue
        magic = MAGIC.search(line)
        if magic:  # the magic reads the whole line, a trailing comment included
            found.append((number, magic.group(1), magic.group(2).strip(), False))
            continue
        shell = PROMPT.sub("", line.strip())
        shell = re.sub(r"(^|\s)#.*", "", shell)  # the shell drops comments
        for part in re.split(r"&&|;", shell):
            part = part.strip()
            if re.match(r"nbtrain(\s|$)", part):
                found.append((number, "cli", part[len("nbtrain") :].strip(), False))
    # Inline code may wrap over lines of a paragraph.
    offsets, joined = [], ""
    for number, line in prose:
        offsets.append((len(joined), number))
        joined += line + "\n"
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        number = max(n for start, n in offsets if start <= span.start())
        code = " ".join(span.group(1).split())
        magic = MAGIC.match(code)
        if magic:
            found.append((number, magic.group(1), magic.group(2).strip(), True))
        elif re.match(r"nbtrain(\s|$)", code):
            found.append((number, "cli", code[len("nbtrain") :].strip(), True))
    return sorted(found)


def _is_synopsis(words: list[str]) -> bool:
    return any(
        set(w) & set("[]|") or "..." in w or PLACEHOLDER.match(w) or re.match(r"-\w/--", w)
        for w in words
    )


def _flags(words: list[str]) -> list[str]:
    out = []
    for word in words:
        for piece in re.split(r"[\[\]|/]", word):
            if piece.startswith("-") and len(piece) > 1 and not piece[1:].isdigit():
                out.append(piece.split("=")[0])
    return out


class UsageError(Exception):
    """Stands for IPython's UsageError where IPython is absent (no magic is checked then)."""


with contextlib.suppress(ImportError):
    from IPython.core.error import UsageError


def _parse(parser, words: list[str]) -> str | None:
    """The parser's complaint about `words`, or None when it accepts them."""
    err = io.StringIO()
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", FutureWarning)  # a renamed flag still parses
            parser.parse_args(words)
    except SystemExit as exit_:
        return None if exit_.code == 0 else err.getvalue().strip().splitlines()[-1]
    except UsageError as exc:  # IPython's magic parser raises it instead of exiting
        return str(exc)
    return None


def problems(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    cli = _cli_parsers()
    magics = None
    out = []
    for number, kind, rest, inline in commands(text):
        where = f"{path.name}:{number}: `{'nbtrain' if kind == 'cli' else kind} {rest}`"
        if kind != "cli" and re.search(r"(^|\s)#", rest):
            out.append(
                f"{where}: the magic takes the comment for arguments: put it on a line of its own"
            )
            continue
        try:
            words = shlex.split(rest)
        except ValueError as exc:
            out.append(f"{where}: {exc}")
            continue
        if kind == "cli":
            name = words[0] if words and not words[0].startswith("-") else ""
            if name not in cli:
                out.append(f"{where}: no command {name!r} (choose from {sorted(cli)[1:]})")
                continue
            parser, full = cli[name], ([name] if name else []) + words[1 if name else 0 :]
            if name == "":
                full = words
            words = words[1:] if name else words
        else:
            from IPython.utils.process import arg_split

            words = arg_split(rest)  # as IPython splits a magic's line (quotes kept)
            magics = magics or _magic_parsers()
            parser = magics[kind]
            if parser is None:
                if words not in ([], ["on"], ["off"]) and not _is_synopsis(words):
                    out.append(f"{where}: takes on, off or nothing")
                continue
            full = words
        own = _own_parser(parser, words)  # %nbtrain's action's parser knows its flags
        if path.name != "naming.md":  # the page that lists the old spellings
            for flag in _flags(words):
                action = own._option_string_actions.get(flag)
                if isinstance(action, RenamedFlag):
                    out.append(f"{where}: {flag} is renamed: show {action.new}")
        if (
            (inline and _is_synopsis(words))
            or "-h" in words
            or "--help" in words
            or re.search(r"[\[\]|]", rest)
        ):
            known = set(own._option_string_actions)
            out += [f"{where}: no flag {flag}" for flag in _flags(words) if flag not in known]
            continue
        complaint = (
            _parse(cli[""] if kind == "cli" else parser, full)
            if kind == "cli"
            else _parse(parser, words)
        )
        if complaint and inline and re.search(r"required|expected one argument", complaint):
            # Prose names a command or a flag without all it needs (`nbtrain report`,
            # `--ip`): what it names must exist.
            known = set(own._option_string_actions)
            out += [f"{where}: no flag {flag}" for flag in _flags(words) if flag not in known]
        elif complaint:
            out.append(f"{where}: {complaint}")
        else:  # argparse takes `--rank` for `--ranks`: the docs spell each flag out
            known = set(own._option_string_actions)
            out += [
                f"{where}: no flag {flag} (abbreviated?)"
                for flag in _flags(words)
                if flag not in known
            ]
    return out


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(path):
    assert problems(path) == []


def test_the_docs_show_commands_and_magics_to_check():
    # The check above sees every command: were the extraction to miss them, it would pass
    # on nothing.
    found = [c for p in DOCUMENTS for c in commands(p.read_text())]
    kinds = {kind for _, kind, _, _ in found}
    assert {"cli", "%nbtrain", "%%distributed"} <= kinds, kinds
    readme = commands((ROOT / "README.md").read_text())
    assert any(k == "cli" and r.startswith("demo") for _, k, r, _ in readme), readme
    assert len(found) >= 40, len(found)


def test_a_flag_that_does_not_exist_is_named_with_its_file_and_line():
    text = "\n".join(
        [
            "# A page",
            "",
            "```bash",
            "nbtrain bench --ranks 2 --no-such-flag",  # line 4
            "nbtrain demo --rank 2 && nbtrain bench --tp 2",  # line 5: argparse takes both
            "```",
            "",
            "Run `nbtrain validate --tp-size 2",  # line 8: inline, wrapped
            "--bogus 3` to check.",
            "",
            "```python",
            "%nbtrain start -n 2  # a comment the magic reads",  # line 12
            "%%distributed --no-such",  # line 13
            "```",
            "",
            "Synopsis: `%nbtrain start [-n N] [--frobnicate S]`, `nbtrain frob`.",  # line 16
            "Fine: `nbtrain demo --ranks 2`, `%nbtrain stop`, `nbtrain report RUN_DIR -o x.png`.",
        ]
    )
    found = problems(Path("page.md"), text)
    assert len(found) == 8, found
    expected = [
        ("page.md:4:", "--no-such-flag"),
        ("page.md:5:", "--tp is renamed: show --tp-size"),
        ("page.md:5:", "no flag --rank "),
        ("page.md:8:", "--bogus"),
        ("page.md:12:", "comment"),
        ("page.md:13:", "--no-such"),
        ("page.md:16:", "no flag --frobnicate"),
        ("page.md:16:", "no command 'frob'"),
    ]
    for (where, what), message in zip(expected, found):
        assert message.startswith(where) and what in message, (where, what, message)
