"""Getting started, as the README tells it: the install routes name extras that exist
and agree with environment.yml, the kernel registration command gives a kernel that
loads nbtrain, every tutorial and notebook is in the README's index and is saved
with the outputs of a run (small, no errors, no widget state), and CI's notebook mode
(`--nbval-lax`) still fails on a cell that raises when outputs are saved."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Absent on a bare GPU machine running only `pytest -m gpu`: skip there, not fail collection.
nbformat = pytest.importorskip("nbformat")

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENV_YML = (ROOT / "environment.yml").read_text()
NOTEBOOKS = sorted(ROOT.glob("tutorials/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb"))
MAX_NOTEBOOK_BYTES = 150_000
WIDGET = "application/vnd.jupyter.widget-view+json"


def _section(title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", README, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def _requirement_names(reqs):
    return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_the_notebook_extra_brings_jupyterlab_and_the_widget_frontend():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"jupyterlab", "ipywidgets", "jupyterlab-widgets", "ipykernel"} <= _requirement_names(
        extras["notebook"]
    )
    # The test extra has no JupyterLab of its own: CI installs both extras
    # (tests/run.sh), a user who only runs tests needs no JupyterLab.
    assert "jupyterlab" not in _requirement_names(extras["test"])
    assert '-e ".[test,notebook]"' in (ROOT / "tests" / "run.sh").read_text()


def test_every_extra_the_docs_name_exists_and_environment_yml_matches_pyproject():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = set()
    for text in (README, ENV_YML, (ROOT / "tests" / "run.sh").read_text()):
        for group in re.findall(r"\.\[([\w,\- ]+)\]", text):
            named.update(e.strip() for e in group.split(","))
    assert named and named <= extras, named - extras
    assert re.search(r"-e \.\[[\w,]*notebook[\w,]*\]", ENV_YML), (
        "environment.yml lacks the notebook extra"
    )
    torch_spec = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert re.search(rf"^\s*- {re.escape(torch_spec)}\b", ENV_YML, re.M), (torch_spec, ENV_YML)
    install = _section("Install")
    for needle in (
        "pip install torch==2.13.0",
        '".[notebook]"',
        '".[gpu,notebook]"',
        "--index-url",
        "conda env create -f environment.yml",
        "python3 -m ipykernel install --user --name nbtrain",
    ):
        assert needle in install, needle
    assert "ipykernel install --user --name nbtrain" in ENV_YML


def test_the_registered_kernel_runs_this_python_and_loads_nbtrain(tmp_path):
    env = {
        **os.environ,
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }
    cmd = [
        sys.executable,
        "-m",
        "ipykernel",
        "install",
        "--user",
        "--name",
        "nbtrain",
        "--display-name",
        "Python (nbtrain)",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "data" / "kernels" / "nbtrain" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and spec["display_name"] == "Python (nbtrain)"
    code = textwrap.dedent("""
        import os
        from jupyter_client.manager import start_new_kernel
        km, kc = start_new_kernel(kernel_name="nbtrain")
        try:
            out = []
            reply = kc.execute_interactive(
                "%load_ext nbtrain\\n"
                "import sys, nbtrain; print(sys.executable, nbtrain.__version__)",
                output_hook=lambda m: out.append(m["content"].get("text", "")), timeout=60)
            assert reply["content"]["status"] == "ok", reply["content"]
            print("".join(out))
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    """)
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{sys.executable} " in run.stdout, run.stdout


def test_the_readme_indexes_every_tutorial_and_notebook():
    index = _section("Tutorials")
    for path in NOTEBOOKS:
        rel = str(path.relative_to(ROOT))
        line = next((ln for ln in index.splitlines() if f"`{rel}`" in ln), None)
        assert line, f"{rel} is missing from the README's tutorial index"
        assert len(line.split(":", 1)[-1].split()) >= 5, f"say what {rel} teaches: {line}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_with_the_outputs_of_a_run(path):
    nb = nbformat.read(path, as_version=4)
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    assert "widgets" not in nb.metadata  # the live dashboard's state: most of the bytes
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: cells not saved from one top-to-bottom run: {counts}; "
        f"run `python tutorials/save_outputs.py {path.relative_to(ROOT)}`"
    )
    assert any(c.outputs for c in code), path.name
    for cell in code:
        for out in cell.outputs:
            assert out.output_type != "error", (path.name, cell.source[:80])
            assert WIDGET not in out.get("data", {}), (path.name, cell.source[:80])
            # A warning nbtrain raises means the cell uses it in a way it warns against
            # (tutorial 12 once built a MoE GPT without its ep layout and saved the warning)
            warned = [
                line
                for line in out.get("text", "").splitlines()
                if "Warning" in line and "/nbtrain/" in line
            ]
            assert not warned, (path.name, cell.source[:80], warned)


def test_nbval_lax_fails_on_a_raising_cell_though_outputs_are_saved(tmp_path):
    def notebook(name, source, saved_text):
        cell = nbformat.v4.new_code_cell(
            source,
            execution_count=1,
            outputs=[nbformat.v4.new_output("stream", name="stdout", text=saved_text)],
        )
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / name)

    notebook("raises.ipynb", "raise ValueError('a tutorial cell failed')", "fine\n")
    notebook("differs.ipynb", "print(1)", "2\n")  # volatile output: not compared
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {
        **os.environ,
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--nbval-lax",
            "raises.ipynb",
            "differs.ipynb",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "a tutorial cell failed" in run.stdout
    assert re.search(r"\b1 failed, 1 passed\b", run.stdout), run.stdout


def test_saving_outputs_drops_widget_state_and_keeps_images_small():
    import base64
    import importlib.util
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    spec = importlib.util.spec_from_file_location(
        "save_outputs", ROOT / "tutorials" / "save_outputs.py"
    )
    save = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(save)

    fig, ax = plt.subplots(figsize=(9, 6), dpi=100)
    for i in range(12):  # a busy plot: a large PNG
        ax.plot(np.random.default_rng(i).standard_normal(2000).cumsum(), lw=0.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    assert len(buf.getvalue()) > save.PALETTE_ABOVE

    out = nbformat.v4.new_output
    view = {"model_id": "ab", "version_major": 2}
    cell = nbformat.v4.new_code_cell(
        "x",
        execution_count=1,
        outputs=[
            out("display_data", data={WIDGET: view, "text/plain": "VBox()"}),
            out("display_data", data={WIDGET: {**view, "model_id": "cd"}, "text/plain": "VBox()"}),
            out(
                "stream", name="stdout", text="train:  10%|#\rtrain: 100%|##########|\nnext line\n"
            ),
            out("display_data", data={"image/png": png, "text/plain": "<Figure>"}),
        ],
        metadata={"execution": {"iopub.status.busy": "2026-01-01"}},
    )
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {"state": {"ab": {}}}})
    save.sanitize(nb)
    assert "widgets" not in nb.metadata and "execution" not in cell.metadata
    kinds = [list(o.get("data", {})) or o.output_type for o in cell.outputs]
    assert kinds == [["text/plain"], "stream", ["image/png", "text/plain"]]  # one placeholder
    assert cell.outputs[0].data["text/plain"] == save.PLACEHOLDER
    assert cell.outputs[1].text == "train: 100%|##########|\nnext line\n"
    small = base64.b64decode(cell.outputs[2].data["image/png"])
    assert small[:4] == b"\x89PNG" and len(small) < len(buf.getvalue()) / 2
    nbformat.validate(nb)
