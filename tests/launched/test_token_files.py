"""Token files that cannot be right are refused before step 1, through `launch/train.py --check-config` as a user
runs it: text, a size that is no whole number of ids, a sidecar that disagrees with the file or the model, an id the
model's vocabulary lacks (with or without a sidecar). The five bad files are launched together once (each launch is
seconds of imports); the scan and the checks in this process: tests/unit/test_token_files.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import TRAIN, env
from tests.token_files_support import NOTES, prepare_tokens_module, token_ids


def _bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (the file given as data.path, what the one line must say)."""
    prepare = prepare_tokens_module()
    notes, beyond, with_sidecar = d / "notes.txt", d / "beyond.bin", d / "sidecar" / "beyond.bin"
    odd, wide = d / "odd.bin", d / "wide.bin"
    notes.write_text(NOTES)
    token_ids(largest=300).astype(np.uint16).tofile(beyond)
    prepare.write(token_ids(largest=300).tolist(), with_sidecar, vocab_size=512, tokenizer="my-tokenizer",
                  source="s")
    odd.write_bytes(token_ids(largest=100).astype(np.uint16).tobytes()[:-1])
    token_ids(largest=100).astype(np.uint32).tofile(wide)  # uint32 ids, a sidecar that says uint16
    wide.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "num_tokens": 500}))
    return {
        "text": (notes, f"data.path='{notes}' looks like text, not token ids; tokenize it first with python "
                        f"launch/prepare_tokens.py {notes} {d / 'notes.bin'} --model DIR (or --tokenizer byte)"),
        "id beyond the vocabulary": (beyond, f"data.path='{beyond}' holds token id 300 (read as uint16) but "
                                             "model.vocab_size=256; set model.vocab_size=301 or more"),
        "id beyond, with a sidecar": (with_sidecar, f"data.path='{with_sidecar}' was tokenized with 'my-tokenizer' "
                                                    "(512 tokens) but model.vocab_size=256; set model.vocab_size=512"),
        "odd size": (odd, f"data.path='{odd}' has 999 bytes, not a whole number of uint16 tokens"),
        "wrong-dtype sidecar": (wide, f"data.path='{wide}' has 2,000 bytes but its sidecar {wide.with_suffix('.json')} "
                                      "says 500 uint16 tokens (1,000 bytes)"),
    }


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess[str], str]]:
    """Each bad file through `launch/train.py --check-config`, two launches at a time."""
    d = tmp_path_factory.mktemp("token-files")
    (d / "sidecar").mkdir()
    cases = _bad_files(d)

    def check(name: str) -> tuple[subprocess.CompletedProcess[str], str]:
        path, says = cases[name]
        cmd = [sys.executable, str(TRAIN), "--check-config", "data=tokens", f"data.path={path}", "logger=none",
               f"hydra.run.dir={d / 'runs' / str(CASES.index(name))}"]
        return subprocess.run(cmd, cwd=d, env=env(), capture_output=True, text=True, timeout=180), says

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(check, cases)))


CASES = ["text", "id beyond the vocabulary", "id beyond, with a sidecar", "odd size", "wrong-dtype sidecar"]


@pytest.mark.beside
@pytest.mark.parametrize("case", CASES)
def test_a_bad_token_file_is_one_line_before_anything_starts(case, checked):
    proc, says = checked[case]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
