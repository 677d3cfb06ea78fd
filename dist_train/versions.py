"""The installed versions of the stack a run depends on: summary.json's `versions`, and CI's output.

Read from the packages' installed metadata (importlib.metadata), so that nothing heavy is imported: recording the
versions costs no start-up time, and a package that is absent reads None rather than failing the run.
`python -m dist_train.versions` prints one `name version` line per package.
"""

from __future__ import annotations

import importlib.metadata
import platform

# The distributions (as pip names them) whose release changes what a run computes or measures.
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "hydra-core", "omegaconf", "wandb", "peft",
            "bitsandbytes")


def installed_versions() -> dict[str, str | None]:
    """{"python": "3.11.7", "torch": "2.13.0+cpu", ...}: each of PACKAGES' installed version, None where absent."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def main() -> None:
    for name, version in installed_versions().items():
        print(f"{name} {version or 'not installed'}")


if __name__ == "__main__":
    main()
