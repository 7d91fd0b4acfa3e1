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
