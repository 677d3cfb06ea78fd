"""Installs that do not drift: pyproject.toml's ranges, constraints.txt's pins, the Makefile that installs with them,
and the versions a run records (dist_train/versions.py)."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dist_train import versions
from dist_train.versions import PACKAGES, installed_versions
from tests.helpers import ROOT

CONSTRAINTS = ROOT / "constraints.txt"


def pins() -> dict[str, Version]:
    """constraints.txt as {canonical name: pinned version}; every line that is not a comment is `name==version`."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[A-Za-z0-9._-]+", name), f"constraints.txt: not a `name==version` pin: {line}"
            out[canonicalize_name(name)] = Version(version)
    return out


def declared_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and its `dev` extra: what `pip install -e ".[dev]"` asks for."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


# ------------------------------------------------------------------------------------------------ versions.py
def test_installed_versions_are_the_installed_metadata():
    found = installed_versions()
    assert list(found) == ["python", *PACKAGES]
    assert found["python"] == platform.python_version()
    assert found["torch"] == importlib.metadata.version("torch") and found["torch"].startswith("2.")
    assert found["transformers"] == importlib.metadata.version("transformers")
    assert found["hydra-core"] == importlib.metadata.version("hydra-core")


def test_an_absent_package_reads_none(monkeypatch):
    monkeypatch.setattr(versions, "PACKAGES", ("torch", "no-such-distribution-here"))
    assert installed_versions() == {"python": platform.python_version(), "torch": importlib.metadata.version("torch"),
                                    "no-such-distribution-here": None}


def test_the_command_prints_one_line_per_package_and_imports_none_of_them():
    code = ("import runpy, sys; runpy.run_module('dist_train.versions', run_name='__main__'); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'wandb') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *lines, imported = proc.stdout.splitlines()
    assert imported == "[]"  # metadata only: no heavy import
    assert lines == [f"{name} {version or 'not installed'}" for name, version in installed_versions().items()]


# ------------------------------------------------------------------------------------------------ constraints.txt
def test_every_declared_requirement_is_pinned_within_its_range():
    pinned = pins()
    outside = [f"{r} (pinned {pinned.get(canonicalize_name(r.name))})" for r in declared_requirements()
               if pinned.get(canonicalize_name(r.name)) not in r.specifier]
    assert not outside, f"constraints.txt pins these outside pyproject.toml's ranges, or not at all: {outside}"


def test_torch_is_pinned_without_a_local_label_so_cpu_and_cuda_builds_match():
    torch_pin = pins()["torch"]
    assert torch_pin.local is None, torch_pin
    assert Version(importlib.metadata.version("torch")).public == str(torch_pin)


def test_this_environment_has_the_pinned_versions():
    """The venv the suite runs in was installed with `-c constraints.txt` (Makefile): what passes here is what is
    pinned. A package upgraded by hand fails this: `make install CONSTRAINTS=` is the way to test other versions."""
    differ = []
    for name, version in pins().items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # pinned for another platform or extra
        if installed.public != version.public:
            differ.append(f"{name} {installed} (pinned {version})")
    assert not differ, differ


# ------------------------------------------------------------------------------------------------ Makefile, CI
def _make_dry_run(*variables: str) -> str:
    """The commands `make install` would run into a venv that does not exist yet (make -n: nothing is run)."""
    proc = subprocess.run(["make", "-n", "install", "VENV=/nonexistent/venv", *variables], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stdout.splitlines() if "-e \".[dev]\"" in line)


def test_make_install_installs_with_the_constraints_and_the_torch_pin():
    command = _make_dry_run()
    assert "-c constraints.txt" in command and '"torch==2.13.0"' in command and "--extra-index-url" not in command


def test_make_install_takes_torch_from_another_index_when_asked():
    command = _make_dry_run("TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in command and "-c constraints.txt" in command
    assert "-c " not in _make_dry_run("CONSTRAINTS=")


def test_ci_prints_the_installed_versions():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-m dist_train.versions" in ci and ci.index("make install") < ci.index("dist_train.versions")
