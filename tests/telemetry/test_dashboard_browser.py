"""The executed dashboard notebook, exported to HTML and drawn by headless Chromium.

Widget JavaScript is served from local files (npm pack), as the CDNs the default
export uses may be unreachable. The page holds the notebook up to its training cell
(the cluster starting, the dashboard, rank 0's progress); the screenshot is kept in
tests/artifacts/ (and notebooks/img/dashboard.png: what an exported notebook shows). Each
panel is found by the colours only it draws.
"""

import os
import shutil
import subprocess
import tarfile

import pytest

ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PACKAGES = {"@jupyter-widgets/html-manager@1.0.15": "embed-amd.js", "requirejs@2.3.8": "require.js"}
COMPUTE_RGB = (0x4C, 0x72, 0xB0)  # nbtrain.telemetry.panels_base.COMPUTE_COLOR
COMM_RGB = (0xDD, 0x84, 0x52)  # COMM_COLOR (in the timeline at alpha 0.7 over white)
SKEW_RGB = (0xC4, 0x4E, 0x52)  # SKEW_COLOR: the slowest/fastest line and its axis label
SPLIT_RGB = {
    "parameters": (0x2A, 0x9D, 0x8F),
    "gradients": (0xE9, 0xC4, 0x6A),
    "optimizer state": (0x81, 0x72, 0xB3),
}  # panels_system.SPLIT, at alpha 0.85
RANK_RGB = ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E))  # matplotlib's C0, C1: rank 0, rank 1
VAL_LOSS_RGB = (0xD6, 0x27, 0x28)  # C3: the first user metric


def _browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "chromium-headless-shell"],
            capture_output=True,
            timeout=300,
        )
        found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip("no chromium and it could not be installed with apt-get (needs root)")
    return found


def _widget_js() -> dict:
    """Local copies of embed-amd.js and require.js, fetched once with `npm pack`."""
    folder = os.path.join(ARTIFACTS, "widget-js")
    paths = {name: os.path.join(folder, name) for name in PACKAGES.values()}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: cannot fetch the widget JavaScript")
    os.makedirs(folder, exist_ok=True)
    for package, name in PACKAGES.items():
        proc = subprocess.run(
            ["npm", "pack", package], cwd=folder, capture_output=True, text=True, timeout=180
        )
        if proc.returncode != 0:
            pytest.skip(f"npm pack {package} failed (offline?): {proc.stderr.strip()[-300:]}")
        tgz = os.path.join(folder, proc.stdout.strip().splitlines()[-1])
        with tarfile.open(tgz) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + name))
            with open(paths[name], "wb") as out:
                out.write(tar.extractfile(member).read())
    return paths


def _mask(pixels, rgb, tol=0.06, alpha=1.0):
    import numpy as np

    target = alpha * np.array(rgb) / 255.0 + (1 - alpha)  # drawn over white
    return np.abs(pixels[..., :3] - target).max(axis=-1) < tol


def _near(pixels, rgb, tol=0.06, alpha=1.0):
    return int(_mask(pixels, rgb, tol, alpha).sum())


def _line_pixels(pixels, rgb, tol=0.04) -> int:
    """Pixels of a thin antialiased line: `rgb` blended over white at alpha 0.5 to 1."""
    import numpy as np

    color = np.array(rgb) / 255.0
    used = (1 - color) > 0.25  # channels far enough from white to estimate alpha from
    alpha = ((1 - pixels[..., :3][..., used]) / (1 - color[used])).mean(axis=-1)
    rebuilt = alpha[..., None] * color + (1 - alpha[..., None])
    hit = np.abs(rebuilt - pixels[..., :3]).max(axis=-1) < tol
    return int((hit & (alpha >= 0.5) & (alpha <= 1.05)).sum())


def _check_panels(pixels):
    """The new panels, each by the colours only it draws."""
    import numpy as np

    for name, rgb in SPLIT_RGB.items():  # the model-state panel's stacked areas
        # (about 1400 px each in a good page; none when the panel is missing)
        assert _near(pixels, rgb, alpha=0.85) > 800, f"no {name} area in the model-state panel"
    # The comm-by-kind panel: the model-state panel's row, right of that panel.
    state = _mask(pixels, SPLIT_RGB["parameters"], alpha=0.85)
    rows, cols = np.nonzero(state)
    band = pixels[rows.min() : rows.max() + 1, cols.max() + 1 :]
    assert _near(band, COMM_RGB) > 300, "no bytes-per-step bars in the comm-by-kind panel"
    assert _near(band, COMPUTE_RGB) > 300, "no bandwidth bars in the comm-by-kind panel"
    # Step time with its skew line; lines of two ranks over several panels; val_loss.
    # (Measured on a good page: 255 skew, 1028 and 1448 rank, 94 val_loss pixels; the
    # old three-panel figure drew rank curves in one panel only.)
    assert _line_pixels(pixels, SKEW_RGB) > 100, "no slowest/fastest skew line"
    for rank, rgb in enumerate(RANK_RGB):
        assert _line_pixels(pixels, rgb) > 500, f"too few rank {rank} curves"
    assert _line_pixels(pixels, VAL_LOSS_RGB) > 40, "the val_loss metric is not drawn"


def _assert_picture_stored(nb, cell: int) -> None:
    """The training cell's dashboard image has its PNG in the saved widget state."""
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    views = [
        o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
        for o in nb.cells[cell].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    boards = [state[v] for v in views if state[v]["model_name"] == "VBoxModel"]
    assert boards, f"no dashboard in cell {cell}'s outputs"
    children = [state[c.removeprefix("IPY_MODEL_")] for c in boards[0]["state"]["children"]]
    images = [m for m in children if m["model_name"] == "ImageModel"]
    assert images and images[0].get("buffers"), "the cell's picture was not in the saved notebook"


def test_dashboard_renders_in_chromium(dashboard_run, tmp_path):
    from matplotlib.image import imread
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    browser = _browser()
    js = _widget_js()
    config = Config()
    config.HTMLExporter.require_js_url = "file://" + js["require.js"]
    config.HTMLExporter.widget_renderer_url = "file://" + js["embed-amd.js"]
    config.HTMLExporter.mathjax_url = ""
    config.HTMLExporter.exclude_input = True
    import nbformat
    from dashboard_notebook import TRAIN_CELL

    nb = nbformat.read(str(dashboard_run[0]), as_version=4)
    _assert_picture_stored(nb, TRAIN_CELL)  # else a blank page is the notebook's fault
    nb.cells = nb.cells[: TRAIN_CELL + 1]
    body, _ = HTMLExporter(config=config).from_notebook_node(nb)
    page = tmp_path / "dashboard.html"
    page.write_text(body)
    shot = tmp_path / "dashboard.png"
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--allow-file-access-from-files",
            "--virtual-time-budget=8000",
            f"--screenshot={shot}",
            "--window-size=1000,1010",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(shot, os.path.join(ARTIFACTS, "dashboard.png"))
    pixels = imread(shot)
    # The figure's compute (blue) and comm (orange) bars are drawn: the widgets rendered.
    assert _near(pixels, COMPUTE_RGB) > 300, "no compute bars: the dashboard did not render"
    comm_blended = tuple(int(0.7 * c + 0.3 * 255) for c in COMM_RGB)
    assert _near(pixels, comm_blended) > 300, "no communication bars on the page"
    _check_panels(pixels)
