"""The dry run seen from the estimator: each asked rank run in a process of its own, beside the prediction for the
same keys, and the table that prints them."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dist_train.estimate.setup import Setup
    from dist_train.estimate.shapes import ModelShape


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def run_ranks(overrides: list[str], *, world_size: int, ranks: list[int], timeout_s: float) -> list[dict[str, Any]]:
    """Each rank in a process of its own (a process joins one process group), one after the other.

    Forked from this process once it has imported the training stack (`_preload`), where it can be forked safely
    (Linux, no thread but this one: torch starts an OpenMP thread at import unless OMP_NUM_THREADS=1): each rank then
    skips the interpreter's start and the imports. What this process holds is frozen out of the collector while the
    ranks run: a collection in a rank would otherwise touch every object and copy the page it sits on
    (copy-on-write). Otherwise, or with DIST_TRAIN_DRYRUN_FORK=0, a fresh interpreter per rank."""
    fork = os.environ.get("DIST_TRAIN_DRYRUN_FORK", "1") != "0" and hasattr(os, "fork")
    if fork:
        _preload()
        fork = _single_threaded()
    one = _forked_rank if fork else _process_rank
    # A caller that froze its own objects keeps them frozen: unfreeze() would thaw them too, so nothing is done then.
    freeze = fork and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        return [one(overrides, world_size=world_size, rank=rank, timeout_s=timeout_s) for rank in ranks]
    finally:
        if freeze:
            gc.unfreeze()  # this process's own garbage is collected again


def _process_rank(overrides: list[str], *, world_size: int, rank: int, timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    proc = subprocess.run([sys.executable, "-m", "dist_train.estimate.dryrun", "--world-size", str(world_size),
                           "--rank", str(rank)], input=json.dumps(overrides), capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rank"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"dry run of rank {rank} of {world_size} failed: {_last_line(proc.stderr)}")
    return json.loads(lines[-1])


def _preload() -> None:
    """What every rank imports, imported once here, before the forks: about 3 s a rank here, half of a small model's
    rank (torch._dynamo, which FakeTensorMode imports, and transformers' modelling code of the architectures built
    from a config, which its lazy modules import at first use). Not DeepSpeed, whose import starts a thread: its ranks
    import it themselves. Python's collector is off meanwhile (launch/train.py's reason:
    dist_train.runtime.imports_done); run_ranks then freezes what they made."""
    import gc

    collecting = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
        from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

        import dist_train.estimate.dryrun.rank  # noqa: F401
        import dist_train.session  # noqa: F401
        import dist_train.strategies.registry  # noqa: F401
    finally:
        if collecting:
            gc.enable()


def _single_threaded() -> bool:
    """Whether this process has one thread (native ones counted): a fork copies only the calling thread, and a lock
    held by another one (an OpenMP pool, a logger's) would stay held in the child."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _forked_rank(overrides: list[str], *, world_size: int, rank: int, timeout_s: float) -> dict[str, Any]:
    import select
    import signal
    import tempfile
    import time

    err = tempfile.TemporaryFile()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank: its output apart from this process's (whose stdout may be the estimator's JSON)
        code = 1
        try:
            os.close(read_end)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # whatever they were
            for key in _LAUNCH_VARS:
                os.environ.pop(key, None)
            from dist_train.estimate.dryrun.rank import run_rank
            from dist_train.quiet import quiet_deepspeed_on_cpu

            quiet_deepspeed_on_cpu()
            result = json.dumps(run_rank(overrides, world_size=world_size, rank=rank)).encode()
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(result)
            code = 0
        except BaseException:  # noqa: B036 - whatever it is, the parent reads its last line
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)  # no interpreter teardown under the fake group's threads
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(f"dry run of rank {rank} of {world_size}", timeout_s)
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    err.seek(0)
    if os.waitstatus_to_exitcode(status) != 0 or not chunks:
        raise RuntimeError(f"dry run of rank {rank} of {world_size} failed: "
                           f"{_last_line(err.read().decode(errors='replace'))}")
    return json.loads(b"".join(chunks))


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no output)"])[-1]


def dryrun_rows(overrides: list[str], shape: ModelShape, setup: Setup, *, ranks: list[int],
                timeout_s: float, predict: bool = True) -> list[dict[str, Any]]:
    """Per asked rank: the dry run's figures (summary.json's ranks[] keys), the prediction for the same keys, and
    their relative difference (dry run / predicted - 1). predict=False (LoRA, which the estimator does not model):
    the dry run's figures alone."""
    from dist_train.estimate.comm import predict_comm
    from dist_train.estimate.memory import category_bytes, predict_memory
    from dist_train.parallel_dims import ORDER

    measured = run_ranks(overrides, world_size=setup.world_size, ranks=ranks, timeout_s=timeout_s)
    if not predict:
        return [{"rank": m["rank"], "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": {},
                 "diff": {}} for m in measured]
    predicted_ranks, comm = predict_memory(shape, setup), predict_comm(shape, setup)
    rows = []
    for m in measured:
        r = m["rank"]
        predicted: dict[str, float] = {f"memory/{c}_bytes": category_bytes(predicted_ranks[r], c)
                                       for c in ("params", "grads", "optimizer")}
        if predicted_ranks[r].peak_live is not None:
            predicted["memory/peak_live_bytes"] = predicted_ranks[r].peak_live
        # Per op, and per mesh dimension where the rank's telemetry names its mesh (parallel/catalog.py's dims; a
        # collective over several dimensions at once, such as fsdp_tp's gradient norm, is counted under none)
        by_dim = any(k.split("/")[1] in ORDER for k in m if k.startswith("comm/"))
        for c in comm[r] if r < len(comm) else comm[0]:
            for key in (f"comm/{c.op}/bytes", *([f"comm/{c.dim}/{c.op}/bytes"] if by_dim and c.dim else [])):
                predicted[key] = predicted.get(key, 0.0) + c.bytes
        diff = {k: (m[k] / v - 1 if v else None) for k, v in predicted.items() if k in m}
        rows.append({"rank": r, "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": predicted,
                     "diff": diff})
    return rows


def dryrun_section(rows: list[dict[str, Any]], *, world_size: int) -> str:
    """The dry run's rows as a text table: per rank, what it measured, the prediction and the difference."""
    from dist_train.estimate.render import human_bytes, text_table

    keys = list(dict.fromkeys(k for row in rows for k in (*row["measured"], *row["predicted"])))
    table = []
    for key in keys:
        cells: list[object] = [key]
        for row in rows:
            m, p, d = row["measured"].get(key), row["predicted"].get(key), row["diff"].get(key)
            fmt = (lambda v: f"{v:,.0f}") if key.endswith("/count") else (
                (lambda v: f"{v:,.1f} s") if key.endswith("_s") else human_bytes)
            cells += [fmt(m) if m is not None else "-", human_bytes(p) if p is not None else "-",
                      f"{d:+.1%}" if d is not None else "-"]
        table.append(cells)
    headers = ["figure", *(h for row in rows for h in (f"rank {row['rank']} dry run", "predicted", "diff"))]
    return "\n".join([
        f"dry run: the real strategy code as each rank of {world_size}, one process each here (fake process group, "
        "FakeTensorMode: no data, no GPU); comm per step",
        text_table(headers, table),
    ])
