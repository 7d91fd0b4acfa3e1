"""The checkout's `kernels/` folder is nbtrain.kernels; imported by its folder's name
from the checkout's root (pytest, a script or a Jupyter kernel started there), it hands
over to an installed package called `kernels` (Hugging Face's, which transformers
5.25 imports at `import transformers.activations`) instead of hiding it."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path, **env) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_installed_kernels_package_wins_over_the_folder(tmp_path):
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'the installed one'\n")
    # `python -c` in the root puts the root first on sys.path, the installed one after.
    out = _python(
        "import kernels, nbtrain.kernels as nk; from kernels import CUDAProperties; "
        "print(CUDAProperties, kernels.__file__ != nk.__file__, nk.pick_impl('torch'))",
        ROOT,
        PYTHONPATH=str(tmp_path / "site"),
    )
    assert out == "the installed one True torch", out


@pytest.mark.skipif(
    not any(d.metadata["Name"] == "kernels" for d in metadata.distributions()),
    reason="Hugging Face's kernels package is not installed",
)
def test_transformers_imports_its_kernels_from_the_root():
    pytest.importorskip("transformers")
    out = _python("import transformers.activations, kernels; print(kernels.__file__)", ROOT)
    assert not out.startswith(str(ROOT / "kernels")), out
