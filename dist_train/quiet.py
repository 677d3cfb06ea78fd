"""Third-party noise, quieted so that the step lines stay readable; `logger.verbose=true` shows everything.

- A warning that repeats (torch's backward-hook warnings fire on every ZeRO-3 step: Python's once-per-location
  rule is undone each time a library enters `warnings.catch_warnings`, which resets the registries) is shown the
  first time, then counted; the run's end names each repeated one with its count.
- DeepSpeed, imported by transformers through Accelerate in every run, warns "Setting accelerator to CPU" on a
  machine without CUDA; there the CPU is the answer, so it is given (`DS_ACCELERATOR=cpu`, unless set).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from typing import Any

log = logging.getLogger("dist_train")


def quiet_deepspeed_on_cpu() -> None:
    """Before DeepSpeed is imported: on a machine without CUDA, name the CPU as its accelerator."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


class RepeatedWarnings:
    """Shows each distinct warning (category, text, where) once and counts the rest."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._previous: Any = None

    def install(self) -> "RepeatedWarnings":
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        return self

    def uninstall(self) -> None:
        if self._previous is not None:
            warnings.showwarning = self._previous
            self._previous = None

    def _show(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
              line: str | None = None) -> None:
        key = (category.__name__, str(message).splitlines()[0][:200], f"{filename}:{lineno}")
        self.counts[key] += 1
        if self.counts[key] == 1:
            self._previous(message, category, filename, lineno, file, line)

    def summary(self) -> list[str]:
        """One line per warning shown more than once: how many times, and its first line."""
        return [f"{n} x {cat} at {os.path.basename(where)}: {text}" for (cat, text, where), n in self.counts.items()
                if n > 1]

    def report(self) -> None:
        lines = self.summary()
        if lines:
            log.info("warnings shown once and repeated since (logger.verbose=true shows each): %s", " | ".join(lines))
