"""The console a user watches, from a real run: at COLUMNS=80 every progress and per-rank line fits. The lines
themselves (fields, widths, warnings): tests/unit/test_console.py."""

from __future__ import annotations

import pytest

from tests.helpers import FAST, launch


@pytest.mark.beside
def test_a_run_at_80_columns_prints_lines_that_fit(tmp_path):
    """As a user with COLUMNS=80 sees it: every progress and per-rank line, with its `[rank0] ` prefix, fits."""
    proc = launch(["strategy=single", *FAST, "train.steps=3"], run_dir=tmp_path,
                  extra_env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank0] step ")]
    assert len(progress) == 6, proc.stderr  # a line and a rank row for each of 3 steps
    assert all(len(ln) <= 80 for ln in progress), "\n".join(progress)
    assert all(k in progress[0] for k in ("step 1/3", "loss", "peak host RSS", "GiB", "ETA")), progress[0]
