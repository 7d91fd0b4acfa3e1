"""The README stays short and true: it opens with the two commands, links every page of
docs/, and agrees with what it points at; the docs' reading order is the layer order
`tests/unit/test_layers.py` enforces; the tutorials ask for the kernel the README names;
a measured figure shown twice is the same figure."""

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
MAX_LINES = 250


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {title}' section"
    return match.group(1)


def test_the_readme_is_short_and_opens_with_the_two_commands():
    assert len(README.splitlines()) <= MAX_LINES, len(README.splitlines())
    first = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1)
    assert README.index("```bash") < README.index("\n## ")
    assert "nbtrain demo" in first
    assert re.search(r"^bash tests/run\.sh$", first, re.MULTILINE)  # what .ci/run calls
    assert "exec bash tests/run.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_links_every_docs_page_and_every_link_resolves():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README)
    for link in links:
        assert (ROOT / link).is_file(), link
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")} - {"docs/index.md"}
    assert pages <= set(links), sorted(pages - set(links))
    assert "docs/api/index.md" in links


def _layers() -> list[str]:
    tree = ast.parse((ROOT / "tests" / "unit" / "test_layers.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LAYERS":
            return ast.literal_eval(node.value)
    raise AssertionError("tests/unit/test_layers.py has no LAYERS")


def _reading_order() -> list[tuple[str, str]]:
    """(the item's first path, the item's text) for each numbered item of the list."""
    section = _section((DOCS / "architecture.md").read_text(), "Read the code in this order")
    items = re.split(r"^\d+\. ", section, flags=re.MULTILINE)[1:]
    assert items, "the reading order has no numbered items"
    return [(re.match(r"`([^`]+)`", item).group(1), item) for item in items]


def _package(path: str) -> str | None:
    """The layer an item's first path belongs to: a module with a layer of its own
    ("tensor_parallel.slices"), else its package."""
    module = re.match(r"nbtrain/(\w+)/(\w+)\.py$", path)
    if module and f"{module.group(1)}.{module.group(2)}" in _layers():
        return f"{module.group(1)}.{module.group(2)}"
    match = re.match(r"nbtrain/(\w+)(/|\.py$)", path)
    return match.group(1) if match else None


def test_the_reading_order_follows_the_layers_and_names_files_that_exist():
    layers = _layers()
    order = [_package(first) for first, _ in _reading_order()]
    assert [p for p in order if p in layers] == layers, (order, layers)
    for first, item in _reading_order():
        folder = ROOT / first if first.endswith("/") else (ROOT / first).parent
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", item):
            where = ROOT / name if name.startswith(("nbtrain/", "kernels/")) else folder / name
            assert where.exists(), f"the reading order names {name} ({where} is missing)"


def test_the_tutorials_ask_for_the_kernel_the_readme_names():
    install = _section(README, "Install")
    assert "`python3` kernel" in install and '"Python (nbtrain)"' in install
    for path in sorted(ROOT.glob("tutorials/*.ipynb")) + sorted(ROOT.glob("notebooks/*.ipynb")):
        spec = json.loads(path.read_text())["metadata"].get("kernelspec", {})
        assert spec.get("name") == "python3", (path.name, spec)


def test_the_memory_figures_agree_with_the_benchmark_notes():
    notes = (ROOT / "nbtrain" / "bench" / "NOTES.md").read_text()
    row = re.search(
        r"^\| meta\s+\| train \|\s+([\d.]+) \| [\d.]+\s+\| ([\d.]+)", notes, re.MULTILINE
    )
    peak, ratio = row.groups()
    table = (DOCS / "larger-than-device.md").read_text()
    assert re.search(rf"\| train 2 steps \(AdamW\) \| {re.escape(peak)} \| .*\| {ratio} \|", table)
    assert f"train\n  {ratio}x" in (DOCS / "benchmarks.md").read_text()
