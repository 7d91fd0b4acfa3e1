"""`import nbtrain` only defines names: no import finder, no event subscriber, and
`nbtrain.kernels` still imports (the top-level kernels/ folder, from a checkout too)."""

import json
import subprocess
import sys

PROBE = """
import json, sys
meta_path = [repr(f) for f in sys.meta_path]
import nbtrain
from nbtrain.comm import events
after_import = {"meta_path": [repr(f) for f in sys.meta_path] == meta_path,
                "subscribers": len(events.HUB.subscribers)}
import nbtrain.kernels
after_kernels = [repr(f) for f in sys.meta_path] == meta_path
nbtrain.init_distributed()
print(json.dumps({**after_import, "kernels_meta_path": after_kernels,
                  "kernels_ops": hasattr(nbtrain.kernels, "pick_impl"),
                  "kernels_name": nbtrain.kernels.__name__,
                  "recorder": nbtrain.telemetry.RECORDER in events.HUB.subscribers}))
"""


def _probe() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_nbtrain_only_defines_names():
    found = _probe()
    assert found["meta_path"], "import nbtrain changed sys.meta_path"
    assert found["subscribers"] == 0, "import nbtrain subscribed to the engine's events"
    assert found["kernels_meta_path"], "import nbtrain.kernels changed sys.meta_path"
    # kernels/ itself under the name nbtrain.kernels, installed or from a checkout.
    assert found["kernels_name"] == "nbtrain.kernels" and found["kernels_ops"]
    # The recorder starts with the run, so the telemetry tests still see every event.
    assert found["recorder"]
