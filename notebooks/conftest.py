"""The research notebooks run under the same guard as the tutorials: a private
IPython/Jupyter home for the kernels and, afterwards, any cluster a failing
notebook left behind stopped by its cluster id."""
import os
import runpy

globals().update({k: v for k, v in runpy.run_path(
    os.path.join(os.path.dirname(__file__), os.pardir, "tutorials", "conftest.py")).items()
    if not k.startswith("__")})
