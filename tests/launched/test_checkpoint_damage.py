"""Checkpoints that survive damage: each part of a checkpoint damaged in turn, for ddp, fsdp (DCP) and zero2
(DeepSpeed's format). `checkpoint.resume=auto` warns once, naming the bad file, and resumes from the newest whole
checkpoint, bit-exact; a damaged checkpoint named explicitly is one line and exit 2; nothing is deleted.

The damaged checkpoints are copies of the `straight_run` fixture's (steps 4 and 8, every strategy's 8-step run,
shared with tests/launched/test_checkpoint.py); its resume from step 4 of fsdp and zero2 is this file's launched
run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from dist_train.checkpoint.layout import resolve_resume, step_dir_name
from dist_train.checkpoint.verify import problem
from tests.conftest import CHECKPOINTED
from tests.helpers import ROOT, TRAIN, env, forked, summary


STEP4, STEP8 = step_dir_name(4), step_dir_name(8)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage" * 8)


def _same_size_garbage(path: Path) -> None:
    path.write_bytes(b"x" * path.stat().st_size)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _first(directory: Path, pattern: str) -> str:
    return sorted(directory.glob(pattern))[0].relative_to(directory).as_posix()


# (what is damaged: a path inside the checkpoint, or a glob resolved against it; how)
DCP_DAMAGE: list[tuple[str, Callable[[Path], None]]] = [
    ("COMPLETE", _garbage),
    ("trainer.json", _truncate),
    ("trainer.json", _remove),
    ("rng/rank1.pt", _remove),
    ("rng/rank0.pt", _truncate),
    ("dcp/.metadata", _garbage),
    ("dcp/.metadata", _same_size_garbage),
    ("dcp/*.distcp", _truncate),
    ("dcp", _remove),
]
DEEPSPEED_DAMAGE: list[tuple[str, Callable[[Path], None]]] = [
    ("COMPLETE", _garbage),
    ("trainer.json", _remove),
    ("rng/rank1.pt", _truncate),
    ("deepspeed/state/*optim_states.pt", _truncate),
    ("deepspeed/state/*model_states.pt", _remove),
    ("deepspeed", _remove),
]
DAMAGE = {"ddp": DCP_DAMAGE, "fsdp": DCP_DAMAGE, "zero2": DEEPSPEED_DAMAGE}


def _copy_checkpoints(straight_dir: Path, to: Path) -> Path:
    root = to / "checkpoints"
    shutil.copytree(straight_dir / "checkpoints", root)
    return root


def _damage(checkpoint: Path, part: str, how: Callable[[Path], None]) -> Path:
    rel = _first(checkpoint, part) if "*" in part else part
    how(checkpoint / rel)
    return checkpoint / rel


@pytest.mark.parametrize("strategy", sorted(DAMAGE))
def test_each_damaged_part_is_named_and_auto_falls_back_to_the_newest_whole_checkpoint(strategy, straight_run,
                                                                                      tmp_path):
    straight_dir, _ = straight_run(strategy)
    assert problem(straight_dir / "checkpoints" / STEP8) is None  # as saved: whole
    for i, (part, how) in enumerate(DAMAGE[strategy]):
        root = _copy_checkpoints(straight_dir, tmp_path / str(i))
        bad = _damage(root / STEP8, part, how)
        why = problem(root / STEP8)
        assert why is not None and why.startswith(str(bad)), (part, how.__name__, why)
        warnings: list[str] = []
        chosen = resolve_resume("auto", default_root=root, verify=problem, warn=warnings.append)
        assert chosen == root / STEP4, (part, how.__name__)
        assert warnings == [f"checkpoint.resume=auto: skipping {STEP8}, which is damaged: {why}; trying {STEP4}"]
        with pytest.raises(ValueError, match="is damaged and cannot be resumed from: ") as refused:
            resolve_resume(str(root / STEP8), default_root=None, verify=problem)
        assert str(bad) in str(refused.value) and "\n" not in str(refused.value)
        assert sorted(p.name for p in root.iterdir()) == [STEP4, STEP8]  # nothing deleted


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_checkpoint_saved_before_files_were_recorded_is_checked_by_its_structure(strategy, straight_run, tmp_path):
    """Checkpoints committed before the marker listed their files: DCP's metadata is read and every byte range it
    points at must lie inside its file; DeepSpeed needs one optimizer partition per saved rank."""
    straight_dir, _ = straight_run(strategy)
    root = _copy_checkpoints(straight_dir, tmp_path)
    marker = root / STEP8 / "COMPLETE"
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}
    marker.write_text(json.dumps(old))
    assert problem(root / STEP8) is None
    part = "dcp/*.distcp" if strategy == "fsdp" else "deepspeed/state/*optim_states.pt"
    bad = _damage(root / STEP8, part, _truncate if strategy == "fsdp" else _remove)
    why = problem(root / STEP8)
    assert why is not None and (str(bad) in why if strategy == "fsdp" else "1 optimizer partitions for 2" in why)


def test_every_checkpoint_damaged_is_refused_not_a_silent_fresh_start(straight_run, tmp_path):
    straight_dir, _ = straight_run("ddp")
    root = _copy_checkpoints(straight_dir, tmp_path)
    for step in (STEP4, STEP8):
        _garbage(root / step / "trainer.json")
    with pytest.raises(ValueError, match=f"every checkpoint in {root} is damaged .*a new hydra.run.dir starts"):
        resolve_resume("auto", default_root=root, verify=problem, warn=lambda line: None)


# One launch per strategy, as a user runs it: the README's launcher, the same command in the same run directory.
# One launch per checkpoint format: DCP's (fsdp; ddp writes the same format, and its damaged parts are judged above)
# and DeepSpeed's (zero2).
LAUNCHED = {"fsdp": ("dcp/*.distcp", _truncate), "zero2": ("deepspeed/state/*optim_states.pt", _truncate)}


@pytest.mark.parametrize("strategy", sorted(LAUNCHED))
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_bit_exact(strategy, straight_run, tmp_path):
    straight_dir, straight = straight_run(strategy)
    run_dir = tmp_path / "run"
    shutil.copytree(straight_dir, run_dir)  # the run directory as the first launch left it
    bad = _damage(run_dir / "checkpoints" / STEP8, *LAUNCHED[strategy])
    launch = [sys.executable, "-m", "dist_train.torchrun", "--standalone", "--nproc_per_node=2", str(TRAIN),
              f"strategy={strategy}", *CHECKPOINTED, f"hydra.run.dir={run_dir}"]

    named = subprocess.run([*launch, f"checkpoint.resume={run_dir / 'checkpoints' / STEP8}"], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=180)
    assert named.returncode == 2, named.stderr[-3000:]
    assert named.stderr.splitlines() == [named.stderr.strip()] and str(bad) in named.stderr  # one line, the file

    # the resume itself forked (tests/forkserver.py: what a fresh launch adds is the refusal's exact output above)
    proc = forked([f"strategy={strategy}", *CHECKPOINTED], run_dir=run_dir, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "which is damaged" in ln]
    assert len(warned) == 1 and str(bad) in warned[0] and f"skipping {STEP8}" in warned[0], proc.stderr[-4000:]
    resumed = summary(run_dir)
    assert resumed["start_step"] == 4 and resumed["resumed_from"] == str(run_dir / "checkpoints" / STEP4)
    assert resumed["losses"] == straight["losses"]  # 4 restored, 4 recomputed: bit-exact
    assert resumed["eval_losses"] == straight["eval_losses"]
    # the new step 8 replaced the damaged one, which was set aside, not deleted
    assert problem(run_dir / "checkpoints" / STEP8) is None
    aside = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(f"{STEP8}.damaged-")]
    assert len(aside) == 1 and (aside[0] / bad.relative_to(run_dir / "checkpoints" / STEP8)).exists()


# (strategy, what is overwritten with bytes of its own size, the rank that fails reading it, its failure's type)
READ_DAMAGE = [("ddp", "rng/rank0.pt", 0, "UnpicklingError"),
               ("zero2", "deepspeed/state/*rank_1*optim_states.pt", 1, "")]


@pytest.mark.parametrize(("strategy", "part", "rank", "kind"), READ_DAMAGE, ids=[s for s, *_ in READ_DAMAGE])
def test_damage_only_reading_shows_is_one_line_naming_the_checkpoint(strategy, part, rank, kind, straight_run,
                                                                     tmp_path):
    """A file overwritten with bytes of its own size passes the pre-flight check (its size and the marker's record
    agree); reading it then fails on one rank alone. One `config error:` line naming the checkpoint, the rank and the
    failure (not torch.load's advice to retry with weights_only=False), exit 2, no traceback, no launcher failure
    report. ddp (DCP): the RNG file; the ranks agree on the failure before any step (rank 1 does not wait in one for
    torchrun to stop it). zero2: rank 1's optimizer partition, inside DeepSpeed's own load, which may go on into
    collectives of its own (ZeRO-3's persistent parameters): that rank stops alone, and the launcher stops the other."""
    straight_dir, _ = straight_run(strategy)
    root = _copy_checkpoints(straight_dir, tmp_path)
    _damage(root / STEP4, part, _same_size_garbage)
    assert problem(root / STEP4) is None  # what the pre-flight check cannot see
    proc = subprocess.run([sys.executable, "-m", "dist_train.torchrun", "--standalone", "--nproc_per_node=2",
                           str(TRAIN), f"strategy={strategy}", *CHECKPOINTED, f"checkpoint.resume={root / STEP4}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error: ")]
    assert len(lines) == 1 and f"checkpoint {root / STEP4} could not be loaded (rank {rank}: {kind}" in lines[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr and "FAILED" not in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == [STEP4, STEP8]  # nothing deleted
