"""What every entry point does with bad input: one line naming what is wrong, shown once per launch, exit 2.

Under torchrun every rank validates the same config and finds the same error. If only rank 0 printed it,
a rank that exits first lets torchrun kill rank 0 before it writes (seen in 2 launches of 6). So every
failing rank takes part in a small handshake on the launcher's key-value store (the one torchrun's agent
already hosts, or rank 0's under other launchers): the first rank to claim the line prints it, then marks
it shown; the others wait for that mark before they exit. Whoever fails first, the line is printed exactly
once, before any failing rank exits. If the store cannot be reached, a rank prints the line itself: twice
is better than never.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

CONFIG_ERROR_EXIT = 2
PREFIX = "config error: "
_KEY = "dist_train/config_error"
# Waiting for the rank that claimed the line: it is printing one line, so this bound is only reached when that
# rank died in between; then this rank prints the line itself.
_WAIT_S = 30.0

# Lines of Hydra/OmegaConf messages that locate the error for a developer but say nothing to a user.
_NOISE = ("full_key:", "object_type=", "reference_type=", "Config search path", "provider=", "See https://",
          "Set the environment variable HYDRA_FULL_ERROR",
          # Appending a key that no schema declares fails as well: the hint would send the user round in circles.
          "To append to your config use")


def one_line(exc: BaseException, options: Optional[dict[str, type]] = None) -> str:
    """A Hydra, OmegaConf or dist_train error as one line: the lines that say what is wrong, joined by '; '.

    Hydra wraps the OmegaConf error that says why an override failed (`Error merging override train.lr=abc`
    caused by `Value 'abc' ... could not be converted to Float`): both are kept. A list of available options
    (`Available options in 'optimizer':` then one per line) becomes `available: adamw, sgd`. `options`: the entry
    point's own option groups ({"plan": PlanOptions}), which `did you mean` looks in beside the training groups.
    """
    missing = _missing_option(exc)
    if missing:
        return missing
    line = _joined(exc)
    flag = re.match(r"LexerNoViableAltException: (--?[\w.-]+)", line)
    if flag:  # `--world_size 8`: Hydra's lexer cannot read a flag, and says so in its own terms
        return f"{flag.group(1)}: options are key=value overrides, not --flags; --help lists them"
    hint = _did_you_mean(line, options or {})
    return f"{line}; {hint}" if hint else line


def _did_you_mean(line: str, options: dict[str, type]) -> str:
    """`did you mean train.lr?` for an override of a key its group does not have (`optimizer.lr=...`), when the
    key's last name is another group's (or one close to it in the same group: `train.step`): RunConfig's groups and
    the entry point's own (`options`: `train.timeout_s` to launch/plan.py also suggests plan.timeout_s)."""
    import difflib

    from dist_train.config import RunConfig

    match = (re.search(r"Could not override '([\w.]+)'.*not in '", line)  # a training override, through Hydra
             or re.match(r"([\w.]+): Key '\w+' not in '", line))  # an entry point's own option, through OmegaConf
    if match is None or "." not in match.group(1):
        return ""
    group, _, leaf = match.group(1).partition(".")
    schemas = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
               if f.default_factory is not dataclasses.MISSING}
    keys = {name: {g.name for g in dataclasses.fields(schema)}
            for name, schema in {**schemas, **options}.items()}
    elsewhere = sorted(f"{g}.{leaf}" for g, names in keys.items() if g != group and leaf in names)
    close = difflib.get_close_matches(leaf, sorted(keys.get(group, ())), n=1, cutoff=0.75)
    found = elsewhere or [f"{group}.{close[0]}" for _ in close[:1]]
    return f"did you mean {' or '.join(found)}?" if found else ""


def _joined(exc: BaseException) -> str:
    """The lines of `exc` and its causes that say what is wrong, joined by '; '."""
    parts: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = _squash(str(exc))
        key = getattr(exc, "full_key", None)  # OmegaConf names the key only in a line dropped above
        if text and key and not any(key in p for p in (*parts, text)):
            text = f"{key}: {text}"
        if text and text not in parts:
            parts.append(text)
        exc = exc.__cause__  # type: ignore[assignment]
    return "; ".join(parts) or "invalid configuration"


def _missing_option(exc: BaseException) -> str:
    """`optimizer=adam is not an option; available: adamw, sgd` for a config group option with no YAML file."""
    from hydra.errors import MissingConfigException

    for err in (exc, exc.__cause__):
        if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
            group, _, name = err.missing_cfg_file.rpartition("/")
            options = ", ".join(sorted(err.options or ())) or "none"
            return f"{group}={name} is not an option (no conf/{group}/{name}.yaml); available: {options}"
    return ""


def _squash(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines()]
    out: list[str] = []
    options: list[str] | None = None
    for line in lines:
        if not line or line.startswith(_NOISE):
            continue
        if line.startswith("Available options in"):
            options = []
            continue
        if options is not None and " " not in line and "=" not in line:
            options.append(line)
            continue
        options_done(out, options)
        options = None
        out.append(line.rstrip("."))
    options_done(out, options)
    return "; ".join(out)


def options_done(out: list[str], options: list[str] | None) -> None:
    if options:
        out.append("available: " + ", ".join(options))


def report_config_error(message: str) -> int:
    """Show `config error: <message>` once per launch, whichever rank gets here first; return the exit code."""
    line = PREFIX + " ".join(message.split())
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size in ("", "0", "1") or not os.environ.get("MASTER_ADDR"):
        _show(line)
        return CONFIG_ERROR_EXIT
    try:
        store = _launch_store()
        first = store.add(f"{_KEY}/claimed", 1) == 1
    except Exception:  # noqa: BLE001 - no store, no handshake: this rank speaks for itself
        _show(line)
        return CONFIG_ERROR_EXIT
    if first:
        _show(line)
        try:
            store.set(f"{_KEY}/shown", "1")
        except Exception:  # noqa: BLE001 - the others will time out and print it too
            pass
        return CONFIG_ERROR_EXIT
    try:
        store.wait([f"{_KEY}/shown"], timedelta(seconds=_WAIT_S))
    except Exception:  # noqa: BLE001 - the rank that claimed it died before printing
        _show(line)
    return CONFIG_ERROR_EXIT


def _show(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _launch_store() -> Any:
    """A client of the store this launch's ranks share (torchrun's agent store, or rank 0's), namespaced by
    restart so that a restarted launch starts clean."""
    import torch.distributed as dist

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=_WAIT_S)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return dist.PrefixStore(f"{run_id}/{attempt}/", store)


def run_hydra_app(app: Callable[[], Any]) -> int:
    """Run a `@hydra.main` app; a bad override or config group option becomes one `config error:` line.

    Hydra reports composition errors itself in several lines (message, `full_key:`, `object_type=`, a hint
    about HYDRA_FULL_ERROR) before our code runs. With HYDRA_FULL_ERROR set they propagate instead, and
    are reported here in one line; errors raised once the app is running are not touched (they are the
    training's, with their traceback). A user who set HYDRA_FULL_ERROR keeps Hydra's full report.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if os.environ.get("HYDRA_FULL_ERROR"):
        app()
        return 0
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except (HydraException, OmegaConfBaseException) as exc:
        if getattr(exc, "_dist_train_running", False):
            raise
        return report_config_error(one_line(exc))
    return 0


def mark_running(exc: BaseException) -> BaseException:
    """Tag an exception raised by the running app, so `run_hydra_app` does not mistake it for bad input."""
    exc._dist_train_running = True  # type: ignore[attr-defined]
    return exc


# ------------------------------------------------------------------ --help, shared by every entry point
HELP_FLAGS = ("-h", "--help")
_WIDTH = 110  # wrap help lines here
_NOTE_COLUMN = 34  # where an option's note starts


# A reader that stopped early (`--help | head`): the exit status of a tool that SIGPIPE ended, 128 + 13, as the
# shell reports it for `yes | head`.
SIGPIPE_EXIT = 141


def exit_on_help(argv: list[str], build: Callable[[], str]) -> None:
    """`-h`/`--help` anywhere on the command line: print `build()` to stdout and exit 0 (before anything else runs)."""
    if any(arg in HELP_FLAGS for arg in argv):
        print_help(build())
        sys.exit(0)


def print_help(text: str) -> None:
    """Print `text` to stdout. Where the reader has gone (`--help | head`), end quietly with SIGPIPE_EXIT: Python
    ignores SIGPIPE, so the write raises BrokenPipeError, which would end in a traceback (the recipe of Python's
    "Note on SIGPIPE" in the signal module's documentation)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes stdout once more at exit; devnull takes what is left, so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(SIGPIPE_EXIT)


def help_text(doc: str, *, usage: str, sections: list[tuple[str, list[str]]], examples: list[str]) -> str:
    """What the entry point does (its docstring without the indented command lines), the usage, titled sections
    of option lines, and the examples, unindented so that they copy as they are."""
    parts = [about(doc), f"usage: {usage}"]
    parts += [title + "\n" + "\n".join(lines) for title, lines in sections]
    parts.append(examples_epilog(examples))
    return "\n\n".join(parts)


def about(doc: str) -> str:
    """A module docstring without its indented command lines (the examples come at the end of the help)."""
    text = "\n".join(ln for ln in doc.strip().splitlines() if not ln.startswith("    "))
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip()


def option_line(name: str, note: str = "") -> list[str]:
    """`  name   note`, the note wrapped in a column of its own (on the next line when the name is long)."""
    left = f"  {name}"
    if not note:
        return [left]
    lines = [] if len(left) < _NOTE_COLUMN - 1 else [left]
    first = left.ljust(_NOTE_COLUMN) if not lines else " " * _NOTE_COLUMN
    return lines + textwrap.wrap(note, _WIDTH, initial_indent=first, subsequent_indent=" " * _NOTE_COLUMN,
                                 break_long_words=False, break_on_hyphens=False)


def default_text(value: Any) -> str:
    """A default as a command-line override writes it: null, true/false, [a,b], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(default_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{default_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def dataclass_options(cls: type, prefix: str) -> list[str]:
    """`  <prefix><field>=<default>   <first sentence of its comment>` for every field of a config dataclass.

    The defaults are the dataclass's own (a default_factory is called); a trailing `_` is dropped from the name
    (`from_` is `compare.from`); the note is the comment above or beside the field in the source."""
    notes = _field_notes(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = "???"
        lines += option_line(f"{prefix}{f.name.rstrip('_')}={default_text(value)}", notes.get(f.name, ""))
    return lines


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bal)(?<!\bvs)\.(\s|$)", text)  # not e.g., i.e., et al.
    return text[:match.start() + 1] if match else text


def _field_notes(cls: type) -> dict[str, str]:
    """{field: first sentence of the `#` comment right above it, or beside it} from the class's source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    notes: dict[str, str] = {}
    comment: list[str] = []
    for line in source.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        field_match = re.match(r"(\w+)\s*:[^#]*(?:#\s*(.*))?$", stripped)
        if field_match and field_match.group(1) not in notes:
            beside = field_match.group(2) or ""
            text = first_sentence(" ".join(comment)) if comment else beside
            if text:  # None as the command line writes it
                notes[field_match.group(1)] = re.sub(r"\bNone\b", "null", text)
        comment = []
    return notes


def config_groups(conf_dir: str | os.PathLike[str]) -> list[tuple[str, list[str], str]]:
    """(group, its options, the default option) for each group directory of `conf_dir`, the default being the
    one conf/config.yaml's defaults list picks ("" when it picks none)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    conf = Path(conf_dir)
    defaults: dict[str, str] = {}
    top = OmegaConf.to_container(OmegaConf.load(conf / "config.yaml"))
    for item in top.get("defaults", []):  # type: ignore[union-attr]
        if isinstance(item, dict):
            defaults.update({str(k): str(v) for k, v in item.items()})
    return [(d.name, sorted(p.stem for p in d.glob("*.yaml")), defaults.get(d.name, ""))
            for d in sorted(conf.iterdir()) if d.is_dir() and any(d.glob("*.yaml"))]


def yaml_note(path: str | os.PathLike[str]) -> str:
    """The first sentence of the comment a YAML file opens with."""
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("#").strip())
    return first_sentence(" ".join(lines))


def examples_epilog(examples: list[str]) -> str:
    """An argparse epilog (with RawDescriptionHelpFormatter) of example commands, unindented."""
    return "examples:\n" + "\n".join(examples)


def argument_parser(*, prog: str, doc: str, usage: str, examples: list[str]) -> Any:
    """An argparse parser for a launch script: its docstring and examples as help, and a bad argument as one
    `config error:` line (with the usage) and exit code 2, not argparse's usage block."""
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            sys.exit(report_config_error(f"{message} (usage: {usage})"))

        def print_help(self, file: Any = None) -> None:
            if file is None or file is sys.stdout:  # -h: quiet into a closed pipe, as every entry point
                print_help(self.format_help().rstrip("\n"))
            else:
                super().print_help(file)

    return OneLineParser(prog=prog, description=about(doc), formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=examples_epilog(examples))

