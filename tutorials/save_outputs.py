"""Execute notebooks on CPU and save them with their outputs, kept small.

    python tutorials/save_outputs.py                      # every tutorial and notebook
    python tutorials/save_outputs.py tutorials/01_quickstart.ipynb

Each notebook runs top to bottom in a fresh kernel (nbclient), from its own folder,
with a private IPython/Jupyter home, one compute thread per process and CUDA hidden,
so the saved outputs are those of a CPU run wherever this is run. Then:

* widget state is not saved (the live dashboard's would be most of the file); a
  widget's output becomes one text line saying a widget was drawn there;
* progress bars streamed with carriage returns keep their final state only;
* PNG images over PALETTE_ABOVE bytes get a 128-colour palette; one still larger than
  MAX_IMAGE_BYTES is an error (make the figure smaller);
* execution timings and the kernel's version details are dropped from metadata.

CI executes the notebooks again (`pytest --nbval-lax`): errors fail, and the saved
outputs are not compared (`tests/unit/test_getting_started.py` checks they are
there, error-free and small).
"""
from __future__ import annotations

import base64
import io
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("tutorials/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb"))
MAX_IMAGE_BYTES = 120_000
PALETTE_ABOVE = 40_000
WIDGET = "application/vnd.jupyter.widget-view+json"
PLACEHOLDER = ("[live widget (a progress bar or the dashboard): drawn while the cell runs, "
               "not saved]")


def _final_line_state(text: str) -> str:
    """What a terminal would show: for each line, the text after its last carriage return."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def _small_png(payload: str) -> str:
    """A PNG over PALETTE_ABOVE bytes re-encoded with a 128-colour palette (plots have
    few colours: about 3x smaller, same pixels size); base64 in, base64 out."""
    raw = base64.b64decode(payload)
    if len(raw) <= PALETTE_ABOVE:
        return payload
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("RGB").quantize(colors=128).save(buf, "PNG", optimize=True)
    if len(buf.getvalue()) >= len(raw):
        return payload
    return base64.b64encode(buf.getvalue()).decode() + "\n"


def sanitize(nb) -> None:
    """Drops widget state, widget views, timings; collapses progress bars. In place."""
    nb.metadata.pop("widgets", None)
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        outputs = []
        for out in cell.outputs:
            data = out.get("data", {})
            if WIDGET in data:
                # The model lives only in the running kernel: without its state a
                # frontend can draw nothing. Say what was there instead.
                outputs.append(nbformat.v4.new_output(
                    "display_data", data={"text/plain": PLACEHOLDER}))
                continue
            if out.output_type == "stream" and "\r" in out.text:
                out.text = _final_line_state(out.text)
            if "image/png" in data:
                data["image/png"] = _small_png(data["image/png"])
            for mime, payload in data.items():
                if mime.startswith("image/") and mime != "image/svg+xml":
                    size = len(base64.b64decode(payload))
                    if size > MAX_IMAGE_BYTES:
                        raise ValueError(f"a {mime} output of {size} bytes (limit "
                                         f"{MAX_IMAGE_BYTES}): make the figure smaller")
            outputs.append(out)
        # Consecutive identical placeholders (a bar per chunk) say it once.
        cell.outputs = [o for i, o in enumerate(outputs) if not (
            i and o == outputs[i - 1] and o.get("output_type") == "display_data")]


def execute(path: Path, timeout: int = 900) -> None:
    nb = nbformat.read(path, as_version=4)
    home = tempfile.mkdtemp(prefix="nbtrain-save-outputs-")
    env = {"IPYTHONDIR": os.path.join(home, "ipython"),
           "JUPYTER_RUNTIME_DIR": os.path.join(home, "runtime"),
           "MPLCONFIGDIR": os.path.join(home, "mpl"), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel, and the engines it starts, inherit these
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        from nbtrain.notebook.cluster import stop_leftover_clusters

        for cluster_id in stop_leftover_clusters(env["IPYTHONDIR"]):  # a failed notebook's
            print(f"  stopped cluster {cluster_id}, left running by {path.name}")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    sanitize(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or NOTEBOOKS
    for path in paths:
        print(f"executing {path.relative_to(ROOT)}", flush=True)
        execute(path)
        print(f"  saved, {path.stat().st_size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
