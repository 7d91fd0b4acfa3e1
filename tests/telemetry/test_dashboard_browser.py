"""The executed dashboard notebook, exported to HTML and drawn by headless Chromium.

Widget JavaScript is served from local files (npm pack), as the CDNs the default
export uses may be unreachable. The screenshot is kept in tests/artifacts/.
"""
import os
import shutil
import subprocess
import tarfile

import pytest

ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PACKAGES = {"@jupyter-widgets/html-manager@1.0.15": "embed-amd.js", "requirejs@2.3.8": "require.js"}
COMPUTE_RGB = (0x4C, 0x72, 0xB0)  # nbtrain.telemetry.panels.COMPUTE_COLOR
COMM_RGB = (0xDD, 0x84, 0x52)     # COMM_COLOR (drawn at alpha 0.7 over white)


def _browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium-headless-shell"],
                       capture_output=True, timeout=300)
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
        proc = subprocess.run(["npm", "pack", package], cwd=folder, capture_output=True,
                              text=True, timeout=180)
        if proc.returncode != 0:
            pytest.skip(f"npm pack {package} failed (offline?): {proc.stderr.strip()[-300:]}")
        tgz = os.path.join(folder, proc.stdout.strip().splitlines()[-1])
        with tarfile.open(tgz) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + name))
            with open(paths[name], "wb") as out:
                out.write(tar.extractfile(member).read())
    return paths


def _near(pixels, rgb, tol=0.06):
    import numpy as np

    target = np.array(rgb) / 255.0
    return int((np.abs(pixels[..., :3] - target).max(axis=-1) < tol).sum())


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
    body, _ = HTMLExporter(config=config).from_filename(str(dashboard_run[0]))
    page = tmp_path / "dashboard.html"
    page.write_text(body)
    shot = tmp_path / "dashboard.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--allow-file-access-from-files",
                           "--virtual-time-budget=8000", f"--screenshot={shot}",
                           "--window-size=1100,800", f"file://{page}"],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(shot, os.path.join(ARTIFACTS, "dashboard.png"))
    pixels = imread(shot)
    # The figure's compute (blue) and comm (orange) bars are drawn: the widgets rendered.
    assert _near(pixels, COMPUTE_RGB) > 300, "no compute bars: the dashboard did not render"
    comm_blended = tuple(int(0.7 * c + 0.3 * 255) for c in COMM_RGB)
    assert _near(pixels, comm_blended) > 300, "no communication bars on the page"
