"""Telemetry tests: private IPython/Jupyter homes and the dist helpers on sys.path."""
import os
import sys
import tempfile

_HOME = tempfile.mkdtemp(prefix="nbtrain-telemetry-tests-")
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR",
             "MPLCONFIGDIR"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())
os.environ["OMP_NUM_THREADS"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dist"))  # ranks.py, cases.py
ARTIFACTS = os.path.join(os.path.dirname(HERE), "artifacts")
