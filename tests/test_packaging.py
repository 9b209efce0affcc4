"""`kernels/` installs as `asyncspec.kernels`, never as a top-level `kernels` (a PyPI name transformers probes); the
benchmark prompts install as `asyncspec.bench_data`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
import importlib.util, asyncspec.kernels.paged_attention as pa
spec = importlib.util.find_spec("kernels")
print("asyncspec.kernels=" + pa.__file__)
print("top-level-kernels=" + str(None if spec is None else spec.origin))
"""


def test_installed_package_imports_kernels_under_asyncspec(tmp_path):
    # Run outside the repo so the source folder is not on sys.path: this is the installed view.
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = dict(line.split("=", 1) for line in out.stdout.strip().splitlines())
    assert Path(lines["asyncspec.kernels"]).resolve() == (REPO / "kernels" / "paged_attention.py").resolve()
    top_level = lines["top-level-kernels"]
    # None, or the PyPI package (transformers >= 5.25 installs it, into a venv that may sit inside the checkout)
    assert top_level == "None" or Path(top_level).resolve().parent != (REPO / "kernels").resolve()


def test_built_wheel_places_kernels_inside_the_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("asyncspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "asyncspec/kernels/__init__.py" in names
    assert "asyncspec/kernels/paged_attention.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    # `asyncspec bench`'s default prompts, for an installed package (an image) too.
    assert "asyncspec/bench_data/prompts-code.jsonl" in names
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    probe = "from asyncspec.cli import _default_dataset; print(_default_dataset())"
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    default = Path(out.stdout.strip())
    assert default == installed / "asyncspec" / "bench_data" / "prompts-code.jsonl"
    assert default.read_bytes() == (REPO / "benchmarks" / "data" / "prompts-code.jsonl").read_bytes()


_SHADOW_PROBE = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # the checkout's root first, as under pytest, then site-packages
import asyncspec.kernels.paged_attention
import kernels
print("kernels=" + str(getattr(kernels, "__file__", None)))
print("attributes=" + ",".join(sorted(n for n in vars(kernels) if not n.startswith("__"))))
try:
    from kernels.layer import WHERE
except ImportError:
    print("layer=missing")
else:
    print("layer=" + WHERE)
if sys.argv[3] == "ask-transformers":  # its public probe, the one whose import of `kernels` failed at c7df3a1
    from transformers.utils import is_kernels_available
    print("transformers_sees=" + str(is_kernels_available()))
"""


def _probe_top_level_kernels(tmp_path: Path, site: Path, transformers: bool) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _SHADOW_PROBE, str(REPO), str(site), "ask-transformers" if transformers else "-"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(line.split("=", 1) for line in out.stdout.strip().splitlines())


def test_checkout_on_sys_path_hands_top_level_kernels_to_the_installed_package(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("__version__ = '0.0.1'\n")
    (site / "kernels" / "layer.py").write_text("WHERE = 'installed'\n")
    lines = _probe_top_level_kernels(tmp_path, site, transformers=False)
    assert Path(lines["kernels"]).resolve() == (site / "kernels" / "__init__.py").resolve()
    assert lines["layer"] == "installed"


def test_checkout_on_sys_path_without_the_package_reads_as_not_installed(tmp_path):
    # An exception from the import would escape transformers' probe, which imports a package without metadata
    # to read its version; the empty module is what it takes for no install.
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    if "top-level-kernels=None" not in out.stdout:
        pytest.skip("the PyPI kernels package is installed in this environment (transformers >= 5.25 needs it)")
    site = tmp_path / "empty-site"
    site.mkdir()
    lines = _probe_top_level_kernels(tmp_path, site, transformers=True)
    assert lines == {"kernels": "None", "attributes": "", "layer": "missing", "transformers_sees": "False"}
