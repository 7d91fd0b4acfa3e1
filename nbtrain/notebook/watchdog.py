"""Ends a cluster's processes when the notebook kernel dies without stopping it.

Run as a script (not `-m`, so it imports neither torch nor nbtrain) with a pipe
from the kernel on stdin. The kernel writes "PID CREATE_TIME" for each process
the cluster starts and "stop" when it stops the cluster itself. End of file means
the kernel is gone, however it went (even SIGKILL): the listed processes that are
still the same processes (same creation time) are killed.
"""
import sys

import psutil


def main() -> None:
    procs = []
    for line in sys.stdin:
        line = line.strip()
        if line == "stop":
            return
        try:
            pid, created = line.split()
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - float(created)) < 0.5:
                procs.append(proc)
        except (ValueError, psutil.Error):
            continue
    for proc in procs:
        try:
            proc.kill()  # psutil refuses if the pid now names another process
        except psutil.Error:
            pass


if __name__ == "__main__":
    main()
