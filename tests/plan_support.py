"""launch/plan.py as a user runs it, for tests/unit/test_plan.py (its answers and refusals) and
tests/launched/test_plan.py (plan.verify, which trains)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, env


def run_plan(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python launch/plan.py <args>` from the checkout, its output captured."""
    return subprocess.run([sys.executable, "launch/plan.py", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout)
