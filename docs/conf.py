"""Sphinx configuration: the pages in docs/ (Markdown, through myst-parser) and the API
reference generated from nbtrain's docstrings. CI builds it with warnings as errors:

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the checkout's nbtrain, installed or not

project = "nbtrain"
author = "nbtrain contributors"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the Google-style docstrings (Args:, Returns:, Raises:)
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# Pages link to each other's sections: "parallelisms.md#tensor-parallelism".
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False  # torch's Function.forward docs point into torch's own
napoleon_use_ivar = True  # "Attributes:" as fields, not a second entry beside a property
# Type hints name classes of torch and of other packages that this build has no
# inventory for; they are shown as written, not linked.
nitpicky = False

html_theme = "alabaster"
html_title = "nbtrain"


# Each package has its page (docs/api/); a name a package re-exports from another one
# (nbtrain.nn.SequenceLayout is nbtrain.context_parallel's) is documented on its owner's
# page only. The top-level page lists every name once more, without index entries.
PAGES = ["nbtrain", "nbtrain.comm", "nbtrain.zero", "nbtrain.nn", "nbtrain.context_parallel",
         "nbtrain.moe", "nbtrain.pipeline", "nbtrain.optim", "nbtrain.checkpoint",
         "nbtrain.models", "nbtrain.telemetry", "nbtrain.debug", "nbtrain.notebook",
         "nbtrain.runtime", "nbtrain.distributed", "nbtrain.planner", "nbtrain.inspect",
         "nbtrain.kernels"]
_documenting = {"module": None}


def _owner(module_name):
    owners = [p for p in PAGES if module_name == p or module_name.startswith(p + ".")]
    return max(owners, key=len) if owners else None


def _skip_reexports(app, what, name, obj, skip, options):
    if what != "module" or _documenting["module"] in (None, "nbtrain"):
        return None  # the top-level page shows every name, unindexed (api/nbtrain.md)
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and _owner(module) not in (None, _documenting["module"]):
        return True
    return None


# nbtrain's docstrings show code the plain-text way, an indented block after a
# paragraph (`Read in this order:` then the files, or a blank line then an example);
# reStructuredText would read these as quotes or definition lists. Make each a literal
# block. Google-style section headers (Args:, Returns:, ...) are left to napoleon.
SECTIONS = {"args", "arguments", "attributes", "example", "examples", "keyword args",
            "keyword arguments", "methods", "note", "notes", "other parameters",
            "parameters", "raises", "returns", "return", "see also", "todo", "warning",
            "warnings", "warns", "yield", "yields"}


def _indent(line):
    return len(line) - len(line.lstrip())


def _literal_blocks(app, what, name, obj, options, lines):
    if what == "module":
        _documenting["module"] = _owner(name)
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.strip() or line.rstrip().endswith("::"):
            continue
        is_section = line.strip().rstrip(":").lower() in SECTIONS and line.rstrip().endswith(":")
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= _indent(line) or is_section:
            continue
        if j == i and not line.rstrip().endswith(":"):
            continue  # a wrapped line of the same paragraph, or a field's continuation
        if j == i:
            out[-1] = line.rstrip() + ":"  # "Read in this order:" -> "...order::"
            out.append("")
        else:
            out.extend(["", " " * _indent(line) + "::"])
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
            j += 1
        while j > i and not lines[j - 1].strip():
            j -= 1
        out.extend(lines[i:j])
        out.append("")
        i = j
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _literal_blocks, priority=400)
    app.connect("autodoc-skip-member", _skip_reexports)
