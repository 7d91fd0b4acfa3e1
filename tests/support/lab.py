"""A real JupyterLab on loopback driven by Chromium through Playwright, as a user's.

`JupyterLab(root)` starts `jupyter lab` on 127.0.0.1 with a random token and private
homes (the caller's IPYTHONDIR and JUPYTER_* folders), and ends it by its PID.
`open_notebook` opens a notebook in headless Chromium (the distribution's, as
Playwright's own download is not reachable everywhere); `run_cell` runs one cell
through the UI with Shift+Enter and waits for its prompt to show a number.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    for module in ("playwright", "jupyterlab", "jupyterlab_widgets"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[test]')"
    if chromium() is None:
        return "no chromium (apt-get install chromium)"
    return None


def chromium() -> str | None:
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` serving `root` on loopback; a context manager."""

    def __init__(self, root: str, log_path: str, timeout_s: float = 90.0):
        self.root, self.log_path, self.timeout_s = root, log_path, timeout_s
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def __enter__(self) -> "JupyterLab":
        log = open(self.log_path, "w")  # kept open for the server's life
        # No "notified about Jupyter news?" toast over the cells (news_url= alone still asks).
        settings = os.path.join(self.root, ".lab-settings")
        toast = os.path.join(settings, "@jupyterlab", "apputils-extension")
        os.makedirs(toast, exist_ok=True)
        with open(os.path.join(toast, "notification.jupyterlab-settings"), "w") as f:
            f.write('{"fetchNews": "false"}')
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                "--LabApp.news_url=",
                f"--LabApp.user_settings_dir={settings}",
                "--ServerApp.terminals_enabled=False",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            ]
            + (["--allow-root"] if os.geteuid() == 0 else []),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url(f"api/status?token={self.token}"), timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError(f"jupyter lab not up in {self.timeout_s:g} s: {self.log()[-2000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # the server shuts its kernels down
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its processes
            self.proc.wait(10)


def write_notebook(path: str, cells: list[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


def launch(playwright):
    return playwright.chromium.launch(
        executable_path=chromium(),
        headless=True,
        args=["--disable-gpu", "--disable-dev-shm-usage", "--no-sandbox"],
    )


def open_notebook(browser, lab: JupyterLab, name: str, errors: list, width=1400, height=1000):
    """A page with `name` open and its kernel idle; console errors go to `errors`."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.on("pageerror", lambda err: errors.append(f"pageerror: {err}"))
    page.on(
        "console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else 0
    )
    page.goto(lab.url(f"lab/tree/{name}?token={lab.token}"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    wait_kernel_idle(page)
    return page


def wait_kernel_idle(page, timeout_s: float = 90.0) -> None:
    page.wait_for_function(
        """() => {
            const s = document.querySelector('.jp-Notebook-ExecutionIndicator');
            return s && s.getAttribute('data-status') === 'idle';
        }""",
        timeout=timeout_s * 1000,
    )


def run_cell(page, index: int, timeout_s: float = 180.0, wait: bool = True) -> None:
    """Select cell `index`, Shift+Enter; with `wait`, until its prompt has a new number.

    A key press that reached no cell (focus still elsewhere while the page settles)
    is pressed again once the prompt has not changed for 30 s (on a loaded machine a
    press that did reach the cell can take over 10 s to show, and pressing again ran
    the cell twice).
    """
    prompt = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputArea-prompt")
    before = prompt.text_content()
    for attempt in range(2):
        dismiss_dialogs(page)
        prompt.click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                """([i, before]) => {
                    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
                    const p = cell && cell.querySelector('.jp-InputArea-prompt');
                    return p && p.textContent !== before;
                }""",
                arg=[index, before],
                timeout=30_000,
            )
            break
        except Exception:  # playwright's TimeoutError: press again
            if attempt:
                raise
    if wait:
        wait_cell_done(page, index, timeout_s)


def dismiss_dialogs(page) -> list[str]:
    """Close any JupyterLab dialog in front of the notebook with its default button.

    On a loaded machine JupyterLab can put up a modal dialog on its own (a slow
    server answer: "Server Connection Error"), and a modal takes every click.
    Each dialog's text is appended to `page.dialogs` (created here) for the test
    to report; console errors that came with it still fail the test.
    """
    seen = getattr(page, "dialogs", None)
    if seen is None:
        seen = page.dialogs = []
    texts = []
    dialogs = page.locator(".jp-Dialog")
    for _ in range(5):
        if not dialogs.count():
            break
        dialog = dialogs.first
        texts.append(" ".join(dialog.inner_text().split()))
        accept = dialog.locator(".jp-Dialog-footer .jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        page.wait_for_timeout(200)
    seen.extend(texts)
    return texts


def wait_cell_done(page, index: int, timeout_s: float = 180.0) -> None:
    page.wait_for_function(
        """(i) => {
            const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
            const prompt = cell && cell.querySelector('.jp-InputArea-prompt');
            return prompt && /\\[\\d+\\]/.test(prompt.textContent);
        }""",
        arg=index,
        timeout=timeout_s * 1000,
    )


def cell_outputs(page, index: int) -> list[dict]:
    """Each output of cell `index`: its text and whether JupyterLab shows it as stderr."""
    return page.evaluate(
        """(i) => {
            const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
            return [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => ({
                text: o.innerText,
                stderr: o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr',
            }));
        }""",
        index,
    )


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
