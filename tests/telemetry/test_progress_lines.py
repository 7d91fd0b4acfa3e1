"""rank 0's text progress bar on an engine prints its final count once."""

import contextlib
import io

import pytest
from tqdm import tqdm

from nbtrain.telemetry.progress import _close, _counted, _Lines


@pytest.mark.parametrize("mininterval_s", [0.0, 100.0])
def test_final_count_is_printed_once(mininterval_s):
    # mininterval 0: the last step's refresh already printed "3/3" (close used to print
    # it again); 100 s: only the first line was printed, close prints the final one.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bar = tqdm(total=3, file=_Lines(), mininterval=mininterval_s, ascii=True)
        for _ in _counted(range(3), bar):
            pass
        _close(bar, lines=True)
    lines = out.getvalue().splitlines()
    assert sum("3/3" in line for line in lines) == 1, lines
    assert "3/3" in lines[-1] and "0/3" in lines[0]
