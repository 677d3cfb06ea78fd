"""Launch real training runs the way users do (python or torchrun) and read what they leave behind; compose a run's
config in this process (`run_config`), for the tests that check one without launching it."""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "launch" / "train.py"

# Small and fast: the tiny model, 5 steps, every step logged, 4 micro-batches of 2 on one process; no W&B run
# (an offline one costs a run about 1 s of its 2-3 s forked: a test of W&B's output says `logger=wandb` after FAST).
FAST = ["logger=none", "model=tiny", "train.steps=5", "train.log_every=1", "train.global_batch_size=8",
        "train.micro_batch_size=2"]


@functools.cache
def _hydra_ready() -> None:
    from dist_train.rundir import register_resolvers
    from dist_train.strategies.registry import register_configs

    register_configs()
    register_resolvers()


def run_config(*overrides: str) -> tuple[Any, Any]:
    """conf/config.yaml composed with `overrides` as launch/train.py composes it, in this process: the Hydra config
    and the RunConfig it becomes (nothing is checked or launched)."""
    from hydra import compose, initialize_config_dir

    from dist_train.train import to_run_config

    _hydra_ready()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return cfg, to_run_config(cfg)


def env(*, cuda: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a launch: on the CPU (tests/conftest.py), or with `cuda` the GPUs the suite saw."""
    e = dict(os.environ)
    if cuda:
        visible = e.pop("DIST_TRAIN_TEST_CUDA_VISIBLE_DEVICES", "")
        e.pop("CUDA_VISIBLE_DEVICES", None)
        if visible:
            e["CUDA_VISIBLE_DEVICES"] = visible
    e.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE=e.get("WANDB_MODE", "offline"),
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
    )
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    e.pop("COLUMNS", None)  # a developer's narrow terminal would shorten the console lines the tests read
    e.update(extra)
    return e


def launch(
    overrides: list[str],
    *,
    run_dir: Path | None,
    nproc: int = 0,
    timeout: float = 600,
    script: Path = TRAIN,
    extra_env: dict[str, str] | None = None,
    cuda: bool = False,
) -> subprocess.CompletedProcess[str]:
    """nproc=0: `python launch/train.py`; nproc>=1: `torchrun --standalone --nproc_per_node=nproc`. `run_dir=None`:
    no hydra.run.dir (a script whose arguments are `overrides` alone)."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    cmd += overrides + ([] if run_dir is None else [f"hydra.run.dir={run_dir}"])
    return subprocess.run(
        cmd, cwd=ROOT, env=env(cuda=cuda, **(extra_env or {})), capture_output=True, text=True, timeout=timeout
    )


class ForkServer:
    """The client of tests/forkserver.py: launches forked from one process that imported torch & co. once.

    Started at the first launch of a pytest session, in the environment `env()` gives (so that what modules read
    from it at import is what a fresh launch would read); ended with the session. `None` from `get()` where it
    cannot serve (DIST_TRAIN_TEST_FORK=0, or its imports left a thread running): the caller launches for real."""

    _instance: ForkServer | None = None
    _unavailable = False

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=ROOT, env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._pending = b""  # what was read from its answers past the last full line
        self.ready = json.loads(self._line(timeout=300))
        atexit.register(self.close)

    @classmethod
    def get(cls) -> ForkServer | None:
        if cls._instance is None and not cls._unavailable:
            if os.environ.get("DIST_TRAIN_TEST_FORK", "1") == "0":
                cls._unavailable = True
                return None
            server = cls()
            if server.ready.get("threads") != 1:
                server.close()
                cls._unavailable = True
                return None
            cls._instance = server
        return cls._instance

    def _line(self, timeout: float) -> str:
        """The server's next answer, read from the pipe's descriptor itself (a buffered reader could hold the next
        answer already, which select would not see)."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                raise RuntimeError(f"tests/forkserver.py did not answer within {timeout:.0f} s "
                                   f"(exit {self.proc.poll()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def run(self, argv: list[str], *, nproc: int, environ: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="forkrun-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"argv": argv, "env": environ, "cwd": str(ROOT), "nproc": nproc,
                       "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            agent = json.loads(self._line(timeout=60))["pid"]
            try:
                code = json.loads(self._line(timeout=timeout))["rc"]
            except RuntimeError:
                os.killpg(agent, signal.SIGKILL)  # the agent and its workers: one process group
                self._line(timeout=60)
                raise subprocess.TimeoutExpired(["forkserver", *argv], timeout,
                                                output=out.read_text(errors="replace"),
                                                stderr=err.read_text(errors="replace")) from None
            cmd = ["forkserver", f"--nproc_per_node={nproc}", *argv]
            return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def forked(overrides: list[str], *, run_dir: Path | None, nproc: int = 0, timeout: float = 600, script: Path = TRAIN,
           extra_env: dict[str, str] | None = None, cuda: bool = False) -> subprocess.CompletedProcess[str]:
    """`launch`, with the workers forked from tests/forkserver.py (the imports paid once per session) where it can
    serve: a run expected to succeed, on the CPU. Otherwise (CUDA, DIST_TRAIN_TEST_FORK=0) `launch` itself.
    `run_dir=None`: a script that takes no hydra.run.dir (its arguments are `overrides` alone)."""
    server = None if cuda else ForkServer.get()
    if server is None:
        return launch(overrides, run_dir=run_dir, nproc=nproc, timeout=timeout, script=script, extra_env=extra_env,
                      cuda=cuda)
    where = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    return server.run([str(script), *overrides, *where], nproc=nproc, environ=env(**(extra_env or {})),
                      timeout=timeout)


def forked_python(argv: list[str], *, timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """`python argv...` (a script, or -m module) from the checkout, forked from tests/forkserver.py where it can serve:
    for a command whose result the test reads from its output or files (a refusal's exact output, where an
    import's own message would count, goes through subprocess)."""
    server = ForkServer.get()
    if server is None:
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env(**extra_env), capture_output=True, text=True,
                              timeout=timeout)
    return server.run(argv, nproc=0, environ=env(**extra_env), timeout=timeout)


def train_ok(overrides: list[str], *, run_dir: Path, nproc: int = 0, **kw: Any) -> dict[str, Any]:
    """Run to completion and return summary.json; fail the test with the run's output otherwise. The run's
    processes are forked from tests/forkserver.py (`forked`): what is read here is the run's files."""
    proc = forked(overrides, run_dir=run_dir, nproc=nproc, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return summary(run_dir)


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_step(run_dir: Path) -> list[dict[str, Any]]:
    """Records of the last logged step, one per rank, in rank order."""
    rows = metrics(run_dir)
    last = max(r["step"] for r in rows)
    return sorted((r for r in rows if r["step"] == last), key=lambda r: r["rank"])


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_losses(single: dict[str, Any], other: dict[str, Any], *, steps: int = 5) -> None:
    """Every step's loss within relative 1e-5 of one process's (summary.json of each), both `steps` long."""
    assert len(other["losses"]) == len(single["losses"]) == steps
    for step, (a, b) in enumerate(zip(other["losses"], single["losses"]), start=1):
        assert rel_diff(a, b) < 1e-5, f"step {step}: {a} vs single {b}"


def compare_from(out: Path, *run_dirs: Path) -> dict[str, dict[str, Any]]:
    """The comparison report of runs that already happened (`compare.from`), by strategy (launch/compare.py forked
    from tests/forkserver.py: its table.json is what is read)."""
    proc = forked_python(["launch/compare.py", f"compare.out_dir={out}", "compare.wandb=false",
                          f"compare.from=[{','.join(str(d) for d in run_dirs)}]"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
