"""What the notebook keeps per request stays bounded over a long session: the
ipyparallel Client's request history is trimmed, and the hub stores no results
(its default in-memory store kept the last 1024 requests with their output)."""

import pytest

pytest.importorskip("ipyparallel")
from IPython.utils.capture import capture_output

from nbtrain.notebook import cluster as cluster_module
from nbtrain.notebook import magics

pytestmark = pytest.mark.timeout(240)


def test_client_history_is_trimmed_and_the_hub_keeps_no_records(ipython, monkeypatch):
    monkeypatch.setattr(cluster_module, "HISTORY_KEPT", 4)
    ipython.run_line_magic("nbtrain", "start -n 2 --backend gloo")
    cluster = magics.current_cluster()
    try:
        client = cluster.client
        lengths = []
        for i in range(15):
            with capture_output():
                ipython.run_cell_magic("distributed", "", f"x = {i} + nbt.rank()")
            lengths.append(len(client.history))
        # Two requests a cell (one per rank); trimmed to 4 once over 8.
        assert max(lengths) <= 2 * 4 + 2, lengths
        assert lengths[-1] < 15 * 2
        assert len(client.results) <= 2 and len(client.metadata) <= 3
        with pytest.raises(Exception, match="NoData|not storing"):
            client.hub_history()  # the hub was started without a results store
        assert cluster.pull("x") == [14, 15]  # what the ranks hold is untouched
    finally:
        ipython.run_line_magic("nbtrain", "stop")
