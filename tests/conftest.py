from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import FAST, train_ok


@pytest.fixture(scope="session")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The one-process baseline every strategy is compared with (run once per session)."""
    run_dir = tmp_path_factory.mktemp("single")
    return run_dir, train_ok(["strategy=single", "logger=none", *FAST], run_dir=run_dir)
