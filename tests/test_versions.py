"""One torch version story: pyproject.toml's ``torch`` extra is the supported range, and
the README, the install and PyTorch pages and hoccl.torch's import error say the same
minimum; the version the README's test command pins (CI's) is in that range, and so is
the torch installed here, whichever CI gets."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _torch_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(text) for text in project["optional-dependencies"]["torch"]]
    assert requirement.name == "torch"
    return requirement


def _minimum() -> str:
    (minimum,) = [spec.version for spec in _torch_requirement().specifier if spec.operator == ">="]
    return minimum


def _pinned_by_ci() -> str:
    (pin,) = re.findall(r"'torch==([0-9.]+)'", (ROOT / ".ci" / "run").read_text())
    return pin


def test_the_torch_extra_is_a_lower_bound_only():
    assert [spec.operator for spec in _torch_requirement().specifier] == [">="]


def test_the_version_ci_pins_is_in_the_supported_range():
    assert Version(_pinned_by_ci()) in _torch_requirement().specifier
    assert f"'torch=={_pinned_by_ci()}'" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", ["README.md", "docs/install.md", "docs/pytorch.md"])
def test_the_pages_give_the_extras_minimum(page):
    text = " ".join((ROOT / page).read_text().split())
    minimum = _minimum()
    said = set(re.findall(r"torch ≥ ([0-9.]+)|torch>=([0-9.]+)|torch ([0-9.]+) and later", text))
    said = {version for match in said for version in match if version}
    assert said == {minimum}, (page, said)


def test_the_install_page_names_the_version_ci_tests():
    assert f"torch {_pinned_by_ci()}" in " ".join((ROOT / "docs" / "install.md").read_text().split())


def test_hoccl_torch_import_error_gives_the_minimum():
    text = (ROOT / "hoccl" / "torch" / "__init__.py").read_text()
    assert f"PyTorch (>= {_minimum()})" in text


def test_the_installed_torch_is_supported():
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch not installed")
    assert Version(Version(installed).base_version) in _torch_requirement().specifier, installed
