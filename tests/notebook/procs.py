"""Process checks shared by the notebook tests."""


def wait_gone(pids, timeout_s=15.0):
    """Pids of `pids` still alive (not zombies) after waiting up to `timeout_s`."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def signal_when(ready, pid: int, signum: int, limit_s: float = 60.0) -> list:
    """From a thread: send `signum` to `pid` once `ready()` is true. The list returned
    gets the monotonic time it was sent. Nothing is sent if `ready()` stays false for
    `limit_s` (the list stays empty): a late signal could hit whatever runs by then,
    or a pid that is no longer the one meant."""
    import os
    import threading
    import time

    sent = []

    def wait_then_send():
        until = time.monotonic() + limit_s
        while not ready():
            if time.monotonic() > until:
                return
            time.sleep(0.02)
        sent.append(time.monotonic())
        os.kill(pid, signum)

    threading.Thread(target=wait_then_send, daemon=True).start()
    return sent
