"""The documentation in docs/ (Markdown pages and the API reference generated from the
docstrings) builds with Sphinx, every warning an error: a docstring that reStructuredText
cannot read, a link to a page or section that is gone, a module the reference names that
no longer imports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [
    "parallelisms",
    "runtime",
    "larger-than-device",
    "notebook",
    "benchmarks",
    "multi-node",
    "bmtrain",
    "architecture",
    "testing",
    "security",
]

# Absent on a bare GPU machine running only `pytest -m gpu`; the test extra brings them.
pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")


def _build(tmp_path, source, **env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(source),
            str(tmp_path / "html"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.timeout(320)
def test_the_docs_build_without_a_warning(tmp_path):
    run = _build(tmp_path, DOCS)
    assert run.returncode == 0, run.stdout + run.stderr
    html = tmp_path / "html"
    for page in PAGES:
        assert (html / f"{page}.html").is_file(), page
    zero = (html / "api" / "zero.html").read_text()
    # The reference holds the docstrings, not the directives' source.
    assert 'id="nbtrain.zero.Block"' in zero and "automodule" not in zero


@pytest.mark.timeout(320)
def test_a_broken_docstring_fails_the_build(tmp_path):
    # The check above can fail: a docstring with an unclosed inline literal is an error.
    bad = tmp_path / "src"
    (bad / "api").mkdir(parents=True)
    (bad / "conf.py").write_text((DOCS / "conf.py").read_text())
    (tmp_path / "badmod.py").write_text(
        '"""A module."""\n\n\ndef f():\n    """Returns ``x, never closed."""\n'
    )
    (bad / "index.md").write_text("# t\n\n```{eval-rst}\n.. automodule:: badmod\n```\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    run = _build(tmp_path, bad, PYTHONPATH=path)
    assert run.returncode != 0
    assert "badmod" in run.stdout + run.stderr, run.stdout + run.stderr
