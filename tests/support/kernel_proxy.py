"""A Jupyter kernel run where this process runs, driven over stdin/stdout: the test on one
machine, the kernel on another (tests/support/netns.py's `login`, where the kernel's
ports on loopback are its own).

Run as `python -m support.kernel_proxy` (tests/ on PYTHONPATH). Each line in is a cell's
source as JSON; each answer is one line, `KERNEL_PROXY ` and a JSON object with the
cell's text (kernels.text_of) and the seconds it took. End of input stops the kernel.
`KernelProxy` is the test's side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TAG = "KERNEL_PROXY "


class KernelProxy:
    """The test's side: `run(source)` -> (text, seconds). `argv_prefix` puts the kernel
    on another machine (e.g. Machines.argv("login", [])); `env` is the kernel's."""

    def __init__(self, argv_prefix: list[str], env: dict | None = None, timeout_s: int = 300):
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(env or os.environ)
        env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "support.kernel_proxy", str(timeout_s)]
        self.proc = subprocess.Popen(
            argv_prefix + argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )

    def run(self, source: str) -> tuple[str, float]:
        """Runs one cell; its text and seconds. Raises RuntimeError if the proxy ended."""
        self.proc.stdin.write(json.dumps(source) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(TAG):
                answer = json.loads(line[len(TAG) :])
                return answer["text"], answer["seconds"]
        raise RuntimeError(f"the kernel proxy ended (exit status {self.proc.wait()})")

    def close(self, timeout_s: float = 60) -> None:
        """Ends the kernel (end of input), then the proxy by its pid if it lingers."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve(timeout_s: int) -> None:
    from support.kernels import new_client, run_cells, text_of

    nb, client = new_client(timeout_s)
    out = sys.stdout
    with client.setup_kernel():
        for line in sys.stdin:
            began = time.monotonic()
            cell = run_cells(client, nb, [json.loads(line)])[0]
            answer = {"text": text_of(cell), "seconds": time.monotonic() - began}
            out.write(TAG + json.dumps(answer) + "\n")
            out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
