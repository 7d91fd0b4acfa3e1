"""A notebook that trains a small GPT on 2 ranks with the live dashboard, executed
by nbclient in a real kernel; the client records widget updates as they arrive."""

import os
import time

import nbformat
from nbclient import NotebookClient

STEPS = 16

CELLS = [
    "%load_ext nbtrain\n%nbtrain start -n 2",
    f"""%%distributed
import time
from nbtrain.models import GPT, GPTConfig
from nbtrain import progress
from nbtrain import telemetry
torch.set_num_threads(1)
cfg = GPTConfig.preset("tiny")
model = nbt.wrap(GPT(cfg), zero_level=3)   # ZeRO-3: each rank holds half of every block
opt = nbt.optim.AdamOptimizer(model.parameters(), lr=3e-3)
optim = nbt.optim.OptimManager(loss_scale=None)
optim.add_optimizer(opt, nbt.lr_scheduler.Cosine(opt, 3e-3, 4, {STEPS}))
telemetry.watch(model, opt)
x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1),
                  generator=torch.Generator().manual_seed(nbt.rank()))""",
    f"""%%distributed --dashboard
for step in progress(range({STEPS}), desc="train"):
    optim.zero_grad()
    optim.backward(model.loss(x[:, :-1], x[:, 1:]))
    optim.clip_grad_norm(1.0)
    if step % 4 == 3:
        with torch.no_grad():
            telemetry.metric(val_loss=model.loss(x[:, :-1], x[:, 1:]))
    telemetry.metric(tokens=x[:, :-1].numel())
    optim.step()    # records loss, lr, grad norm and step time; ends the step
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
    client = RecordingClient(
        nb,
        timeout=timeout_s,
        kernel_name="python3",
        store_widget_state=True,
        resources={"metadata": {"path": os.path.dirname(path)}},
    )
    client.execute()
    nbformat.write(nb, path)
    return client
