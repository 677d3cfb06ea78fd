"""A W&B dashboard for one experiment group, built from what its runs really logged.

    python launch/dashboard.py RUN_OR_COMPARISON_DIR... [logger.project=P] [logger.entity=E] [group=G]

The keys come from the runs' own W&B files (`<run dir>/wandb/offline-run-*/run-*.wandb`, or `run-*` once
online): their history and summary records are read back, so a panel can never name a key that no run logs.
The specification is a list of sections of panels, in plain data (`Section`, `Panel`), turned into a
`wandb-workspaces` saved workspace view and a W&B Report for the group. Where W&B is reachable with an API key
both are saved; otherwise the specification is written to a file, with the way to create it later.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from dist_train.compare.table import MEMORY_FIGURES
from dist_train.telemetry.bandwidth import COMM_OPS

# W&B's run file: a 7-byte header, then LevelDB's log format (32 KiB blocks of checksummed chunks) of protobuf
# Records. The Go core that writes it has no Python reader, hence these few lines.
_HEADER = b":W&B"
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class Panel:
    kind: str  # "line": series over steps (history keys); "bar": one value per run (summary keys)
    title: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Section:
    title: str
    panels: tuple[Panel, ...]


# ------------------------------------------------------------------ what the runs logged
def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending = len(_HEADER) + 3, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        if kind == 0:  # zeroed: the rest of the block is unused
            pos += left
            continue
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


@dataclass
class Logged:
    """What W&B holds of a set of runs: their history and summary keys, and the groups and projects they are in."""

    history: set[str]
    summary: set[str]
    groups: set[str]
    projects: set[str]


def read_run_file(path: Path) -> Logged:
    from wandb.proto import wandb_internal_pb2 as pb

    logged = Logged(set(), set(), set(), set())
    for raw in _records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            logged.history.update(item.key or "/".join(item.nested_key) for item in record.history.item)
        elif kind == "summary":
            logged.summary.update(item.key or "/".join(item.nested_key) for item in record.summary.update)
        elif kind == "run":
            logged.groups.add(record.run.run_group)
            logged.projects.add(record.run.project)
    logged.history = {k for k in logged.history if not k.startswith("_")}
    logged.summary = {k for k in logged.summary if not k.startswith("_")}
    return logged


def run_files(run_dir: Path) -> list[Path]:
    """The W&B run file of a training run directory (the latest, if a resume started a new one)."""
    files = sorted((run_dir / "wandb").glob("*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    return files[-1:]


def logged_keys(run_dirs: list[Path]) -> Logged:
    """Everything the runs' W&B files hold; ValueError if no run logged to W&B."""
    files = [f for d in run_dirs for f in run_files(d)]
    if not files:
        raise ValueError("no W&B run in these run directories (train with logger=wandb; offline is enough)")
    total = Logged(set(), set(), set(), set())
    for f in files:
        one = read_run_file(f)
        total.history |= one.history
        total.summary |= one.summary
        total.groups |= one.groups
        total.projects |= one.projects
    return total


# ------------------------------------------------------------------ the specification
def build_spec(history: set[str], summary: set[str]) -> list[Section]:
    """The sections the user needs, each panel naming only keys in `history` (line) or `summary` (bar)."""

    def line(title: str, *keys: str) -> Panel:
        return Panel("line", title, tuple(k for k in keys if k in history))

    def bar(title: str, *keys: str) -> Panel:
        return Panel("bar", title, tuple(k for k in keys if k in summary))

    def per_rank(key: str) -> list[str]:
        ranks = sorted((k for k in history if k.startswith(f"{key}/rank")), key=lambda k: int(k.rsplit("rank", 1)[1]))
        return [f"{key}/max", *ranks]

    memory = [c for c in MEMORY_FIGURES if f"memory/{c}_bytes/max" in history]
    ops = [op for op in COMM_OPS if f"comm/{op}/bytes/max" in history]
    sections = [
        Section("Loss", (line("loss (global batch)", "loss"), line("gradient norm", "grad_norm"),
                         line("learning rate", "lr"))),
        Section("Memory per rank by category (bytes)", (
            *(bar(f"{c}: worst rank and spread over ranks", f"peak/memory/{c}_bytes/max",
                  f"peak/memory/{c}_bytes/spread") for c in memory),
            *(line(f"{c} per rank", *per_rank(f"memory/{c}_bytes")) for c in memory),
        )),
        Section("Collectives by op", tuple(
            p for op in ops for p in (line(f"{op}: bytes per step (worst rank)", f"comm/{op}/bytes/max"),
                                      line(f"{op}: seconds per step (worst rank)", f"comm/{op}/time_s/max",
                                           f"comm/{op}/wait_s/max"),
                                      line(f"{op}: bus bandwidth GB/s (worst rank)", f"comm/{op}/busbw_gbps/max")))),
        Section("Step time: compute vs communication (s)", (
            bar("mean step split (worst rank)", "time/compute_s/max", "time/comm_s/max"),
            line("per step (worst rank)", "time/step_s/max", "time/compute_s/max", "time/comm_s/max"),
        )),
        Section("Throughput and MFU", (line("tokens per second", "throughput/tokens_per_s"),
                                       line("samples per second", "throughput/samples_per_s"),
                                       line("model FLOPs utilisation", "mfu"))),
        Section("Predicted vs measured memory (bytes, worst rank)", tuple(
            bar(c, f"predicted/memory/{c}_bytes", f"peak/memory/{c}_bytes/max")
            for c in memory if f"predicted/memory/{c}_bytes" in summary)),
    ]
    kept = [Section(s.title, tuple(p for p in s.panels if p.keys)) for s in sections]
    return [s for s in kept if s.panels]


def spec_keys(sections: list[Section]) -> set[tuple[str, str]]:
    """(kind, key) of every key a panel names."""
    return {(p.kind, k) for s in sections for p in s.panels for k in p.keys}


# ------------------------------------------------------------------ W&B objects
def workspace(sections: list[Section], *, entity: str, project: str, group: str) -> Any:
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    return ws.Workspace(
        entity=entity, project=project, name=f"dist_train: {group}",
        sections=[ws.Section(name=s.title, panels=[_panel(wr, p) for p in s.panels], is_open=True) for s in sections],
        runset_settings=ws.RunsetSettings(filters=[ws.Metric("Group") == group]),
    )


def report(sections: list[Section], *, entity: str, project: str, group: str, online: bool = True) -> Any:
    """online=False: its run set names no project (resolving one asks the W&B API); the report's own does."""
    import wandb_workspaces.reports.v2 as wr

    where = {"entity": entity, "project": project} if online else {}
    runset = wr.Runset(**where, name=group, filters=f"Group == '{group}'")
    blocks: list[Any] = [
        wr.H1(f"Strategy comparison: {group}"),
        wr.P("Every run of the group is one strategy (or one strategy at one setting of a swept knob). Memory is per "
             "rank; the worst rank is what a GPU must hold. Collective time is an upper bound of the communication a "
             "step waits for. Built by launch/dashboard.py from the keys these runs logged."),
    ]
    for s in sections:
        blocks += [wr.H2(s.title), wr.PanelGrid(runsets=[runset], panels=[_panel(wr, p) for p in s.panels])]
    return wr.Report(entity=entity, project=project, title=f"dist_train: {group}", blocks=blocks)


def _panel(wr: Any, panel: Panel) -> Any:
    if panel.kind == "bar":
        return wr.BarPlot(title=panel.title, metrics=[wr.SummaryMetric(k) for k in panel.keys], orientation="v")
    return wr.LinePlot(title=panel.title, x="Step", y=list(panel.keys))


def specification(sections: list[Section], *, entity: str, project: str, group: str) -> dict[str, Any]:
    """Everything needed to create the dashboard later: the sections, and W&B's own JSON of both views."""
    return {
        "entity": entity, "project": project, "group": group,
        "sections": [asdict(s) for s in sections],
        "workspace": json.loads(workspace(sections, entity=entity, project=project, group=group)
                                ._to_model().model_dump_json()),
        "report": json.loads(report(sections, entity=entity, project=project, group=group, online=False)
                             ._to_model().model_dump_json()),
    }


# ------------------------------------------------------------------ the command
USAGE = "python launch/dashboard.py RUN_OR_COMPARISON_DIR... [logger.project=P] [logger.entity=E] [group=G] [out=FILE]"
_OPTIONS = ("logger.project", "logger.entity", "group", "out")


def parse_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    paths, options = [], {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            paths.append(arg)
        elif key in _OPTIONS:
            options[key] = value
        else:
            raise ValueError(f"{arg!r}: unknown option; allowed: {', '.join(_OPTIONS)} (usage: {USAGE})")
    if not paths:
        raise ValueError(f"name the run directories, or a comparison's output directory (usage: {USAGE})")
    return paths, options


def _one(values: set[str], what: str) -> str:
    values = {v for v in values if v}
    if len(values) != 1:
        raise ValueError(f"the runs were logged to {len(values)} W&B {what}s ({', '.join(sorted(values))}); "
                         f"name one with {'group=G' if what == 'group' else 'logger.project=P'}")
    return values.pop()


def main(argv: list[str]) -> int:
    from dist_train.compare.collect import run_dirs
    from dist_train.entry import report_config_error
    try:
        paths, options = parse_args(argv)
        logged = logged_keys(run_dirs(paths))
        group = options.get("group") or _one(logged.groups, "group")
        project = options.get("logger.project") or _one(logged.projects, "project")
    except ValueError as exc:
        return report_config_error(str(exc))
    entity = options.get("logger.entity")
    sections = build_spec(logged.history, logged.summary)
    panels = sum(len(s.panels) for s in sections)
    out = Path(options.get("out") or Path(paths[0]) / "dashboard.json")
    why = _why_offline()
    if why is None:
        try:
            import wandb

            entity = entity or wandb.Api().default_entity
            view = workspace(sections, entity=entity, project=project, group=group)
            view.save()
            doc = report(sections, entity=entity, project=project, group=group)
            doc.save()
            print(f"W&B workspace view: {view.url}\nW&B report: {doc.url}\n({len(sections)} sections, {panels} panels)")
            return 0
        except Exception as exc:  # noqa: BLE001 - a rejected key, a network error: the file instead
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    spec = specification(sections, entity=entity or "<your entity>", project=project, group=group)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(spec, indent=2) + "\n")
    print(f"W&B cannot be reached ({why}): wrote the dashboard's specification to {out} ({len(sections)} sections, "
          f"{panels} panels, every key logged by the runs).\nTo create it: upload the runs (`wandb sync "
          f"<run dir>/wandb/offline-run-*` for each), then run this same command where W&B is reachable with an "
          f"API key (`wandb login`).")
    return 0


def _why_offline() -> str | None:
    """Why the dashboard cannot be saved to W&B from here (None: it can try)."""
    from dist_train.telemetry.wandb_sink import resolve_mode, unreachable

    mode = resolve_mode("auto")
    if mode != "online":
        return "no API key: offline" if mode == "offline" else f"WANDB_MODE={mode}"
    import wandb

    return unreachable(wandb.setup().settings.base_url)
