"""The wheel: the gin configs ship as package data, every package is listed, and an installed wheel finds
``quickstart.gin`` (and its includes) without the repository."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the sources (an in-tree build would leave build/ and *.egg-info behind)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("treejax", "configs"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-build-isolation", "-w", str(out), str(src))
    (path,) = out.glob("*.whl")
    return path


def test_wheel_ships_the_gin_configs_and_every_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.gin"),
                                                           recursive=True)]
    assert "configs/include/treepo_loss.gin" in configs
    assert {"treejax/" + c.replace(os.sep, "/") for c in configs} <= names
    source_packages = {os.path.relpath(d, ROOT).replace(os.sep, ".")
                       for d, _, files in os.walk(os.path.join(ROOT, "treejax")) if "__init__.py" in files}
    wheel_packages = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert wheel_packages == source_packages  # pyproject's explicit package list is complete


def test_installed_wheel_finds_its_configs(wheel, tmp_path):
    """Installed without the repository, ``default_config_dir()`` is the package data folder and quickstart.gin
    parses there, its ``include "include/..."`` statements resolving inside the installed package."""
    site = tmp_path / "site"
    _pip("install", "--target", str(site), str(wheel))
    code = ("from treejax import train; d = train.default_config_dir(); "
            "cfg = train.parse([d + '/quickstart.gin'], []); print(d, cfg.loss.eps_high, cfg.model)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         check=True, capture_output=True, text=True).stdout.split()
    # eps_high and the model come from the two included files
    assert out == [str(site / "treejax" / "configs"), "0.28", "smollm2-135m-instruct"]
