"""A real Jupyter kernel driven by nbclient, for the notebook tests: a client on a new
notebook, cells run one by one, a cell's text, the pids a started cluster prints."""

from __future__ import annotations

import re

from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from support import REPO_DIR

# Cells that load the extension, start 2 ranks and print the cluster's pids (pids_from).
START = [
    "%load_ext nbtrain",
    "%nbtrain start -n 2",
    "import nbtrain.notebook.magics as _m\nprint('PIDS', *_m.current_cluster().pids())",
]


def text_of(cell) -> str:
    """What a cell printed, displayed as text or raised, without ANSI colours."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(out.ename + ": " + out.evalue + "\n" + "\n".join(out.traceback))
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"])
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(parts))


def run_cells(client, nb, sources) -> list:
    """Append each source to `nb` as a code cell and execute it; the executed cells."""
    cells = []
    for src in sources:
        nb.cells.append(new_code_cell(src))
        cells.append(client.execute_cell(nb.cells[-1], len(nb.cells) - 1))
    return cells


def new_client(timeout_s: int = 180):
    """(notebook, client): an empty notebook and a python3 kernel client for it, run from
    the checkout's root; errors are kept as outputs. Start it with client.setup_kernel()."""
    nb = new_notebook()
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO_DIR)}},
    )
    return nb, client


def pids_from(cell) -> list[int]:
    """The pids printed by START's last cell."""
    line = next(l for l in text_of(cell).splitlines() if l.startswith("PIDS"))  # noqa: E741
    return [int(p) for p in line.split()[1:]]
