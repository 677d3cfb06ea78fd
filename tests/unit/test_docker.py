"""The Docker image recipe, checked without a Docker engine: lint, the files it copies, the versions it pins."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
PINS = ROOT / "docker" / "requirements.txt"


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_copied_path_exists():
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            sources += line.split()[1:-1]
    assert sources and all((ROOT / s).exists() for s in sources), [s for s in sources if not (ROOT / s).exists()]


def _pins() -> dict[str, str]:
    lines = [ln.strip() for ln in PINS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    pins = dict(ln.split("==") for ln in lines)
    assert len(pins) == len(lines), "every line of docker/requirements.txt is NAME==VERSION"
    return pins


def test_every_dependency_is_pinned_within_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [Requirement(r) for r in (*project["dependencies"], *extras["deepspeed"], *extras["slurm"], *extras["bnb"],
                                                   *extras["datasets"])]
    pins = {_normal(k): v for k, v in _pins().items()}
    for req in wanted:
        name = _normal(req.name)
        assert name in pins, f"{req.name} is not pinned in docker/requirements.txt"
        assert req.specifier.contains(pins[name]), f"{req.name}=={pins[name]} is outside pyproject's {req.specifier}"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_pin_is_the_one_ci_installs():
    """docker/requirements.txt and constraints.txt (what `make install`, and so CI, installs from) pin the same
    versions: the image runs what the suite ran."""
    lines = [ln.strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()]
    constraints = {_normal(k): v for k, v in (ln.split("==") for ln in lines if ln and not ln.startswith("#"))}
    drift = {k: (v, constraints.get(_normal(k))) for k, v in _pins().items() if constraints.get(_normal(k)) != v}
    assert not drift, f"docker/requirements.txt pin, constraints.txt pin: {drift}"
