"""`nbtrain.kernels` in a source checkout: the repository's top-level kernels/ folder.

An installed wheel holds kernels/ itself under this name (pyproject's package-dir
mapping) and never contains this file. Run from a checkout (an editable install, or
`python3 -m pytest` from the repository root on a machine where nbtrain is not
installed), Python finds this package inside nbtrain/ first: it loads kernels/ under
the name `nbtrain.kernels` in its place, so both ways import the same module. Nothing
happens until `nbtrain.kernels` is imported.
"""

import importlib.util
import pathlib
import sys

_HOME = pathlib.Path(__file__).resolve().parents[2] / "kernels"
_spec = importlib.util.spec_from_file_location(
    __name__, _HOME / "__init__.py", submodule_search_locations=[str(_HOME)]
)
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module  # the import statement hands out what is here after this
_spec.loader.exec_module(_module)
