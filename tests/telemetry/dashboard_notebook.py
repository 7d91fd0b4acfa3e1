"""A notebook that trains a small GPT on 2 ranks with the live dashboard, executed
by nbclient in a real kernel; the client records widget updates as they arrive."""
import os
import time

import nbformat
from nbclient import NotebookClient

STEPS = 16

CELLS = [
    "%load_ext nbtrain\n%nbtrain start -n 2",
    """%%distributed
import time
from nbtrain.models import GPT, GPTConfig
from nbtrain import progress
from nbtrain import telemetry
torch.set_num_threads(1)
cfg = GPTConfig(hidden=32, heads=4, layers=3, seq_len=16, vocab_size=64)
model = nbt.wrap(GPT(cfg), zero_level=3)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
telemetry.watch(model, opt)
x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(nbt.rank()))""",
    f"""%%distributed --dashboard
for step in progress(range({STEPS}), desc="train"):
    loss = model.loss(x[:, :-1], x[:, 1:])
    opt.zero_grad()
    loss.backward()
    opt.step()
    telemetry.metric(loss=loss.detach(), lr=opt.param_groups[0]["lr"], loss_scale=1.0)
    time.sleep(0.25)  # a step long enough to watch: the dashboard must move meanwhile""",
    "%nbtrain dashboard",
    "%nbtrain stop",
]
TRAIN_CELL = 2
DASHBOARD_CELL = 3


class RecordingClient(NotebookClient):
    """nbclient that notes each widget update (comm_msg) with its cell and time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates: list[tuple[float, int, dict]] = []
        self.cell_done: dict[int, float] = {}

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] == "comm_msg" and msg["content"]["data"].get("method") == "update":
            self.updates.append((time.monotonic(), cell_index, msg["content"]["data"]))
        return super().process_message(msg, cell, cell_index)

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        result = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        self.cell_done[cell_index] = time.monotonic()
        return result


def run(path: str, timeout_s: int = 240) -> RecordingClient:
    """Write the notebook to `path`, execute it in place (widget state stored)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = RecordingClient(nb, timeout=timeout_s, kernel_name="python3",
                             store_widget_state=True,
                             resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
    nbformat.write(nb, path)
    return client
