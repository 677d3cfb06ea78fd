"""A real comparison on CPU: single and fsdp (2 processes, 3 steps, tiny model; ddp is the sweep's, below) plus two
rows that fail."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dist_train.compare.runner import failure_reason
from dist_train.compare.settings import StrategySpec, split_argv
from tests.helpers import ROOT, env, forked_python


COMPARE = ROOT / "launch" / "compare.py"
STRATEGIES = "[single,fsdp]"


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]], str]:
    out = tmp_path_factory.mktemp("compare")
    cmd = [sys.executable, str(COMPARE), f"compare.strategies={STRATEGIES}", "compare.nproc=2",
           f"compare.out_dir={out}", "compare.wandb=true", "compare.fit_gpus=[8,1024]",
           "logger=wandb", "model=tiny", "train.steps=3", "train.log_every=1",  # W&B offline (tests.helpers.env)
           "eval.every_steps=3", "compare.dryrun_world_sizes=[8]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    return out, rows, proc


def test_every_strategy_is_a_row(comparison):
    out, rows, proc = comparison
    stdout = proc.stdout
    assert list(rows) == ["single", "fsdp"]
    for name in ("single", "fsdp"):
        assert rows[name]["status"] == "ok", rows[name]
    with open(out / "table.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in csv_rows] == list(rows)
    assert "report:" in stdout


@pytest.mark.beside
def test_every_row_is_checked_before_the_first_runs(tmp_path):
    """A typo in the last row is one line before anything runs, naming each bad row, not a failed row an hour in."""
    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, str(COMPARE), "compare.strategies=[single,ddp,fdsp,fsdp+train.lr=-1]",
                           f"compare.out_dir={out}", "compare.wandb=false", "logger=none"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("config error: compare.strategies: fdsp: strategy=fdsp is not an option")
    assert "; fsdp+train.lr=-1: train.lr=-1.0 must be > 0" in lines[0]
    assert "running" not in proc.stderr and not any(out.glob("*/compare.log"))


@pytest.mark.beside
def test_a_failed_row_keeps_the_report_and_the_exit_code_says_so(tmp_path):
    """A row that fails while it runs (here a fault injected at step 2) is a failed row with its reason; the
    report is written, and the comparison exits 1."""
    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, str(COMPARE), "compare.strategies=[single]", f"compare.out_dir={out}",
                           "compare.wandb=false", "logger=none", "train.steps=3"],
                          cwd=ROOT, env=env(DIST_TRAIN_FAULT="raise@2"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    assert rows["single"]["status"] == "failed", rows["single"]
    assert rows["single"]["reason"].startswith("[dist_train] rank 0 failed at step 2"), rows["single"]["reason"]
    assert rows["single"]["agrees"] is None
    assert (out / "report.md").is_file() and "1 of 1 row(s) failed: single" in proc.stderr


def test_table_holds_measured_numbers_traceable_to_runs(comparison):
    out, rows, _ = comparison
    for name in ("single", "fsdp"):
        row = rows[name]
        summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        assert Path(row["run_dir"]).parent == out
        assert row["final_loss"] == summary["final_loss"] and row["step_s"] == summary["mean_step_s"]
        assert row["median_step_s"] == summary["median_step_s"] > 0
        assert row["mem_params_max_bytes"] == max(r["memory/params_bytes"] for r in summary["ranks"])
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0
        assert row["compute_s"] + row["comm_s"] >= row["step_s"] - 1e-9
    n = rows["single"]["num_params"]
    assert rows["single"]["comm_bytes_per_step"] == 0
    assert rows["fsdp"]["mem_params_max_bytes"] == pytest.approx(2 * n, rel=0.02)  # half of 4 B/param
    assert rows["fsdp"]["comm_all_gather_bytes"] > 0 and rows["fsdp"]["comm_reduce_scatter_bytes"] == 4 * n
    assert rows["fsdp"]["comm_reduce_scatter_s"] > 0


def test_a_step_time_from_fewer_than_five_timed_steps_is_called_noise(comparison):
    """3 steps, the first left out as warm-up: each row's time comes from 2 steps (or 1 where peak_live's warm-up
    takes 2), so compare says so once on stderr, naming every row, and above the report's table."""
    out, rows, proc = comparison
    for name in ("single", "fsdp"):
        summary = json.loads((Path(rows[name]["run_dir"]) / "summary.json").read_text())
        assert rows[name]["timed_steps"] == 3 - summary["timing_warmup_steps"] < 5
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("[compare] warning: step times from fewer")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    listed = ", ".join(f"{name} {rows[name]['timed_steps']}" for name in ("single", "fsdp"))
    assert f"(noise, not a measurement): {listed};" in warnings[0]
    report = (out / "report.md").read_text()
    assert f"**Warning:** {warnings[0].removeprefix('[compare] warning: ')}." in report


def test_the_timed_steps_warning_decides_by_the_steps_each_row_timed():
    from dist_train.compare.table import few_timed_steps, timed_steps

    assert timed_steps({"steps": 5, "steps_done": 5, "start_step": 0, "timing_warmup_steps": 2}) == 3
    assert timed_steps({"steps": 20, "steps_done": 12, "start_step": 10, "timing_warmup_steps": 1}) == 1  # resumed
    row = {"status": "ok", "steps": 5}
    rows = [{**row, "strategy": "single", "timed_steps": 3}, {**row, "strategy": "ddp", "timed_steps": 5},
            {**row, "strategy": "fsdp", "timed_steps": 4}, {"status": "failed", "strategy": "tp"}]
    line = few_timed_steps(rows)
    assert line.startswith("step times from fewer than 5 timed steps (noise, not a measurement): single 3, fsdp 4;")
    assert "train.steps=7 or more" in line  # single: 2 warm-up steps + 5
    assert "measurement): fsdp 4; train.steps=6 or more" in few_timed_steps(rows[1:])  # 1 warm-up step + 5
    assert few_timed_steps([rows[1], rows[3]]) is None  # 5 timed steps are enough; a failed row has no time


def test_the_report_shows_the_held_out_loss_and_each_rows_setup_peak(comparison):
    out, rows, _ = comparison
    for name in ("single", "fsdp"):
        row = rows[name]
        summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        assert row["final_eval_loss"] == summary["final_eval_loss"] == summary["eval_losses"][-1][1]
        assert row["final_eval_loss"] == pytest.approx(rows["single"]["final_eval_loss"], rel=1e-5)
        assert row["mem_setup_peak_rss_max_bytes"] == max(r["memory/setup_peak_rss_bytes"] for r in summary["ranks"])
    report = (out / "report.md").read_text()
    assert "| eval loss |" in report and "| set-up peak RSS |" in report
    # train.global_batch_size is null here: the header names the batch every row was pinned to
    assert re.search(r"global batch \d+ \(each row's micro-batch x 2 processes\) x \d+ tokens", report), report[:800]
    assert f"{rows['fsdp']['final_eval_loss']:.6f}" in report


def test_verdicts_agree_with_single(comparison):
    _, rows, _ = comparison
    assert rows["single"]["agrees"] is True
    fsdp = rows["fsdp"]
    assert fsdp["agrees"] is True, fsdp["verdict"]
    assert fsdp["verdict"].startswith("agrees with single")
    assert fsdp["loss_max_rel_dev"] < 1e-4


def test_predicted_model_state_within_ten_percent(comparison):
    _, rows, _ = comparison
    for name in ("single", "fsdp"):
        row = rows[name]
        for cat in ("params", "grads", "optimizer"):
            assert row[f"err_{cat}"] is not None and abs(row[f"err_{cat}"]) < 0.10, (name, cat, row[f"err_{cat}"])
        assert row["model_state_ok"] is True
        assert abs(row["err_comm_bytes"] or 0) < 0.01  # collective bytes per step, predicted exactly


def test_report_and_pictures(comparison):
    out, rows, _ = comparison
    report = (out / "report.md").read_text()
    for png in ("memory_per_rank", "step_time", "comm_bytes", "loss_curves", "predicted_vs_measured"):
        path = out / f"{png}.png"
        assert path.is_file() and path.stat().st_size > 5000, png
        assert f"]({png}.png)" in report
    assert "## Verdicts" in report and "## Predicted vs measured" in report and "## Would it fit?" in report
    assert "llama2-70b" in report
    for row in rows.values():
        assert Path(row["run_dir"]).name in report  # every row names its run directory


def test_dry_run_rows_at_a_world_size_the_comparison_did_not_run(comparison):
    """compare.dryrun_world_sizes=[8]: fsdp as ranks 0 and 7 of 8 under the fake process group, beside the
    estimator; single, which the dry run does not cover, says why in one line; the report marks them as not
    measured."""
    out, rows, _ = comparison
    dry = {r["strategy"]: r for r in json.loads((out / "dryruns.json").read_text())}
    assert list(dry) == ["single", "fsdp"] and all(r["world_size"] == 8 for r in dry.values())
    assert "strategy=single" in dry["single"]["skipped"] and "skipped" not in dry["fsdp"]
    ranks = dry["fsdp"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 7]
    measured_at_2 = rows["fsdp"]["mem_params_max_bytes"]
    for r in ranks:
        params = r["measured"]["memory/params_bytes"]
        assert params * 8 == pytest.approx(measured_at_2 * 2, rel=0.02)  # the same model state, over 8 ranks, not 2
        assert abs(r["diff"]["memory/params_bytes"]) < 0.02 and r["measured"]["comm/all_gather/bytes"] > 0
    report = (out / "report.md").read_text()
    assert "## Dry runs at other world sizes (not measured)" in report and "no dry run: strategy=single" in report


def test_wandb_comparison_run_written_offline(comparison):
    out, _, proc = comparison
    stdout = proc.stdout
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert "W&B comparison run" in stdout
    assert f"W&B runs logged offline: 3; upload with: wandb sync {out}/*/wandb/offline-run-*" in stdout  # 2 + its own


def test_the_dashboard_names_only_keys_the_runs_logged(comparison):
    """The dashboard of the comparison's group, built against the keys its runs' offline W&B files hold."""
    from dist_train.dashboard import build_spec, logged_keys, spec_keys
    from dist_train.telemetry.wandb_sink import wandb_payload

    out, rows, _ = comparison
    dirs = [Path(rows[s]["run_dir"]) for s in ("single", "fsdp")]
    logged = logged_keys(dirs)
    # what the files hold is what the sink logged: the payload of the runs' own records
    from_records = {k for d in dirs for recs in _windows(d) for k in wandb_payload(recs)}
    assert logged.history == from_records - {"step"}
    sections = build_spec(logged.history, logged.summary)
    named = spec_keys(sections)
    assert named and all(key in (logged.history if kind == "line" else logged.summary) for kind, key in named)
    titles = [s.title for s in sections]
    assert titles == ["Loss", "Memory per rank by category (bytes)", "Collectives by op",
                      "Step time: compute vs communication (s)", "Throughput and MFU",
                      "Predicted vs measured memory (bytes, worst rank)"]
    lines = {key for kind, key in named if kind == "line"}
    assert {"comm/all_reduce/bytes/max", "comm/all_gather/bytes/max", "comm/reduce_scatter/bytes/max"} <= lines
    assert not any(k.startswith(("comm/broadcast", "comm/send", "comm/recv")) for k in logged.history)  # never issued
    assert {"memory/params_bytes/rank0", "memory/params_bytes/rank1"} <= lines  # per-rank series
    assert ("bar", "predicted/memory/params_bytes") in named and ("bar", "peak/memory/params_bytes/spread") in named
    assert logged.groups == {out.name}  # compare put every run in its group

    proc = subprocess.run([sys.executable, "launch/dashboard.py", str(out)], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote the dashboard's specification to" in proc.stdout and "wandb sync" in proc.stdout
    spec = json.loads((out / "dashboard.json").read_text())
    assert spec["group"] == out.name and [s["title"] for s in spec["sections"]] == titles
    assert spec["workspace"]["spec"] and spec["report"]  # W&B's own JSON of the view and the report


def test_compare_from_a_wandb_group_rebuilds_the_rows_from_the_files_each_run_saved(comparison, tmp_path,
                                                                                    monkeypatch):
    """compare.from=ENTITY/PROJECT/groups/NAME: the W&B API is stood in for (no network here) by one that serves
    the files each training run saved into its own offline W&B run; the rows rebuilt from them are the rows."""
    import shutil

    import wandb

    from dist_train.compare.collect import collect

    out, rows, _ = comparison

    class File:
        def __init__(self, source: Path) -> None:
            self.source = source

        def download(self, root: str, replace: bool) -> None:
            Path(root).mkdir(parents=True, exist_ok=True)
            shutil.copy(self.source, Path(root) / self.source.name)

    class Run:
        def __init__(self, files: Path) -> None:
            self.id, self.job_type, self._files = files.parent.name.rsplit("-", 1)[-1], "train", files

        def file(self, name: str) -> File:
            return File(self._files / name)

    served = [Run(f) for name in ("single", "fsdp")
              for f in (Path(rows[name]["run_dir"]) / "wandb").glob("offline-run-*/files")]

    class Api:
        def __init__(self, timeout: int) -> None:
            pass

        def runs(self, path: str, filters: dict[str, str]) -> list[Run]:
            assert path == "me/dist_train" and filters == {"group": out.name}
            return served

    monkeypatch.setattr(wandb, "Api", Api)
    monkeypatch.setenv("WANDB_MODE", "online")
    results, _ = collect([f"me/dist_train/groups/{out.name}"], cache=tmp_path)
    from dist_train.compare.table import build_row

    rebuilt = {r["strategy"]: r for r in map(build_row, results)}
    assert set(rebuilt) == {"single", "fsdp"}
    for name, row in rebuilt.items():
        for key in ("final_loss", "losses", "mem_params_max_bytes", "comm_bytes_per_step", "step_s", "config_hash"):
            assert row[key] == rows[name][key], (name, key)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ValueError, match="needs an API key"):
        collect(["me/dist_train/groups/x"], cache=tmp_path)


def _windows(run_dir: Path) -> list[list[dict[str, Any]]]:
    """metrics.jsonl's records, grouped by step: what the sink logged each window."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step.setdefault(rec["step"], []).append(rec)
    return list(by_step.values())


# -------------------------------------------------------------------- pure parts
def test_strategy_specs_and_argv_split():
    spec = StrategySpec.parse("fsdp+strategy.reshard_after_forward=false")
    assert (spec.name, spec.overrides) == ("fsdp", ("strategy.reshard_after_forward=false",))
    assert "=" not in spec.dirname and "+" not in spec.dirname
    own, training = split_argv(["compare.nproc=4", "model=tiny", "hydra.run.dir=/x"])
    assert own == ["nproc=4", "out_dir=/x"] and training == ["model=tiny"]
    with pytest.raises(ValueError, match="compare.strategies"):
        split_argv(["strategy=ddp"])


def test_bad_dry_run_world_sizes_are_one_line():
    from omegaconf.errors import ValidationError

    from dist_train.compare.settings import parse

    assert parse(["dryrun_world_sizes=[64,1024]"]).dryrun_world_sizes == [64, 1024]
    with pytest.raises(ValueError, match=r"compare.dryrun_world_sizes=\[8, 0\]: 0 is not a world size; each must be >= 1"):
        parse(["dryrun_world_sizes=[8,0]"])
    with pytest.raises(ValueError, match="compare.from has none"):
        parse(["dryrun_world_sizes=[8]", "from_=[x]"])
    with pytest.raises(ValidationError):
        parse(["dryrun_world_sizes=[big]"])


def test_failure_reason_prefers_the_child_error_over_torchrun():
    log = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File \"x.py\", line 1, in <module>",
        "[rank1]: RuntimeError: shapes do not match",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "launch/train.py FAILED",
    ])
    assert failure_reason(log, 1) == "RuntimeError: shapes do not match at x.py:1 (exit 1)"


def test_one_process_strategies_come_from_the_registry_and_unknown_names_still_launch(tmp_path):
    """single/dp run as one plain process; an unknown name is launched like the others, so that its row
    carries train.py's own config error instead of the comparison failing."""
    from dist_train.compare.runner import command_for

    def launched(name: str, nproc: int = 2) -> list[str]:
        return command_for(StrategySpec.parse(name), training=[], nproc=nproc, run_dir=tmp_path, group="g")

    assert "torch.distributed.run" not in launched("single") and "torch.distributed.run" not in launched("dp")
    assert "torch.distributed.run" in launched("ddp") and "torch.distributed.run" in launched("bogus")
    assert "torch.distributed.run" in launched("ddp", nproc=1)  # 1 process per node is still a group


# -------------------------------------------------------------------- a sweep of knobs
SWEEP = "{train.activation_checkpointing:[false,true]}"


def test_a_sweep_runs_every_strategy_per_knob_value_and_reports_each_knobs_effect(tmp_path):
    """Activation checkpointing as a knob: each strategy at both values, judged against single at the same
    value; the report pairs the runs and shows the activation bytes fall as predicted, losses unchanged.
    A report rebuilt from the run directories finds the same knob and the same effects."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(COMPARE), "compare.strategies=[single,ddp]", f"compare.sweep={SWEEP}",
           f"compare.out_dir={out}", "compare.wandb=false", "logger=none", "model=tiny", "train.steps=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    knob = "train.activation_checkpointing"
    assert list(rows) == [f"{s}+{knob}={v}" for v in ("false", "true") for s in ("single", "ddp")]
    for label, row in rows.items():
        # the runs record the value normalised: true is full, false none
        assert row["status"] == "ok" and row["knobs"] == {knob: "full" if label.endswith("true") else "none"}, row
        assert row["prediction_ok"] is True, (label, {k: v for k, v in row.items() if k.startswith("err_")})
        assert row["pred_regime"] == "fp32 weights, grads and state"
    assert rows[f"ddp+{knob}=true"]["verdict"].startswith("agrees with single")
    # recomputation changes no number of the training
    assert rows[f"single+{knob}=true"]["losses"] == pytest.approx(rows[f"single+{knob}=false"]["losses"], rel=1e-6)
    effects = json.loads((out / "effects.json").read_text())
    assert [(e["knob"], e["strategy"], e["from"], e["to"]) for e in effects] == [
        (knob, "single", "none", "full"), (knob, "ddp", "none", "full")]
    for e in effects:
        act = e["activations"]
        assert act["measured"] < -0.5 and act["predicted"] < -0.5  # layer inputs + one layer, not every layer
        assert act["measured"] == pytest.approx(act["predicted"], abs=0.05)
        assert e["optimizer"]["measured"] == 0 and e["params"]["measured"] == 0
    assert "## What each knob changes" in (out / "report.md").read_text()

    again = tmp_path / "again"
    proc = forked_python([str(COMPARE), f"compare.from=[{out}]", f"compare.out_dir={again}", "compare.wandb=false"],
                         timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((again / "effects.json").read_text()) == effects
    # the same table and verdicts: the report reads the same from its title and command on
    assert (again / "table.csv").read_text() == (out / "table.csv").read_text()
    first, rebuilt = ((d / "report.md").read_text().split("## Verdicts", 1)[1] for d in (out, again))
    # ... to its list of run directories, which the new report names by absolute paths
    assert rebuilt.split("## Runs", 1)[0] == first.split("## Runs", 1)[0]


def test_sweep_specs_and_bad_sweeps():
    from dist_train.compare.settings import parse
    from dist_train.compare.sweep import expand

    cfg = parse(["sweep={precision:[fp32,bf16]}", "strategies=[single,fsdp+strategy.reshard_after_forward=false]"])
    specs = expand(cfg.strategies, cfg.sweep)
    assert [s.label for s in specs] == ["single+precision=fp32", "fsdp+strategy.reshard_after_forward=false+precision=fp32",
                                       "single+precision=bf16", "fsdp+strategy.reshard_after_forward=false+precision=bf16"]
    assert specs[1].overrides == ("strategy.reshard_after_forward=false", "precision=fp32")
    assert parse(["sweep.train.activation_checkpointing=[false,true]"]).sweep == {
        "train.activation_checkpointing": [False, True]}  # the dotted form nests; it is flattened
    for bad, message in (("sweep={precision:fp32}", "needs a non-empty list"),
                         ("sweep={strategy:[ddp,fsdp]}", "not a training knob"),
                         ("sweep={train.lr:[]}", "needs a non-empty list")):
        with pytest.raises(ValueError, match=message):
            parse([bad])


def test_knobs_are_the_settings_that_differ_and_a_group_by_its_name(tmp_path):
    """Read back from the runs' configs: a named group whose name differs is one knob; a field swept under one
    name (optimizer.weight_decay) is a knob of its own."""
    import yaml

    from dist_train.compare.sweep import add_knobs

    def run(name: str, **config: Any) -> dict[str, Any]:
        (tmp_path / name).mkdir()
        base = {"strategy": {"name": "ddp"}, "logger": {"group": name}, "train": {"seq_len": 64},
                "optimizer": {"name": "adamw", "weight_decay": 0.0, "betas": [0.9, 0.95]}, "precision": {"name": "fp32"}}
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump({**base, **config}))
        return {"run_dir": str(tmp_path / name), "world_size": 2}

    rows = [run("a"), run("b", optimizer={"name": "lion", "weight_decay": 0.0, "betas": [0.9, 0.99]}),
            run("c", optimizer={"name": "adamw", "weight_decay": 0.1, "betas": [0.9, 0.95]})]
    assert add_knobs(rows) == ["optimizer", "optimizer.weight_decay"]
    assert [r["knobs"] for r in rows] == [{"optimizer": "adamw", "optimizer.weight_decay": 0.0},
                                          {"optimizer": "lion", "optimizer.weight_decay": 0.0},
                                          {"optimizer": "adamw", "optimizer.weight_decay": 0.1}]


def test_every_row_gets_one_global_batch_where_the_config_leaves_it_null():
    from dist_train.compare.settings import pinned_global_batch

    base = {"global_batch_size": None, "micro_batch_size": 2}
    for label in ("single", "ddp", "fsdp+strategy.reshard_after_forward=false"):  # single runs 1 process, ddp 4
        assert pinned_global_batch(base, StrategySpec.parse(label), world_size=4) == ["train.global_batch_size=8"]
    swept = StrategySpec.parse("ddp+train.micro_batch_size=3")
    assert pinned_global_batch(base, swept, world_size=4) == ["train.global_batch_size=12"]
    assert pinned_global_batch({**base, "global_batch_size": 16}, StrategySpec.parse("ddp"), world_size=4) == []
    assert pinned_global_batch(base, StrategySpec.parse("ddp+train.global_batch_size=4"), world_size=4) == []


@pytest.mark.beside
def test_ctrl_c_keeps_the_finished_rows_and_says_how_to_finish(tmp_path):
    """SIGINT while the second row runs (sent once compare says it started): its launch is stopped, the first
    row's report is written, and one line names the rows left and the commands that finish the comparison."""
    import signal

    out = tmp_path / "compare"
    # Ctrl-C as a terminal delivers it, whatever the suite was started from: a shell without job control starts a
    # background job (`make test &`) with SIGINT ignored, and Python then keeps it ignored in the process it runs.
    proc = subprocess.Popen([sys.executable, str(COMPARE), "compare.strategies=[single,ddp]", f"compare.out_dir={out}",
                             "compare.wandb=false", "logger=none", "train.steps=20"],
                            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:  # compare's own progress lines: the second row has started when this one shows
        seen.append(line)
        if line.startswith("[compare] ddp (2/2): running"):
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    assert list(rows) == ["single"] and rows["single"]["status"] == "ok"
    assert "Traceback" not in stderr
    assert (f"interrupted: 1 row(s) ran, not ddp. To finish: the same command with compare.strategies=[ddp] "
            f"compare.out_dir=OUT2, then one report of both: python launch/compare.py compare.from=[{out},OUT2]") in stderr
