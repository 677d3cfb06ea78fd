"""The documentation: the site builds, README's links resolve, README's commands run or are checked.

README.md is the front page and docs/ the manual (mkdocs.yml). The site is built with --strict: mkdocs.yml's
`validation` makes a broken link or anchor, or a page left out of the navigation, fail the build. Every command in
README's ```bash blocks is either run by a named test (RUN_BY) or checked the way its entry point checks it before it
starts anything: launch/train.py's --check-config (for the command's world size), launch/compare.py's row checks, the
estimator itself (it only computes). The checks run in this process, one after another: the suite's time is nearly
all spent, and a fresh interpreter per command would cost seconds each.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"

# A command that a test runs as it stands (its prefix) -> that test. The test must exist (checked below).
RUN_BY = {
    "make test": ".ci/run",  # CI runs exactly this on a fresh clone
    "python launch/plan.py model=70b precision=bf16 train.seq_len=4096 train.global_batch_size=512 cluster.gpu=h100 "
    "cluster.nodes=16": "tests/unit/test_plan.py::test_json_answer_for_70b_on_16_nodes",
    "python launch/prepare_tokens.py corpus.txt data/corpus.bin --model ":
        "tests/unit/test_own_model.py::test_prepare_tokens_uses_the_model_directorys_tokenizer",
}
# Paths the README's examples name, which the checks make here (a model directory, a token file).
MODEL_DIR, TOKENS = "~/models/my-llama", "data/corpus.bin"


# ------------------------------------------------------------------------------------------------ the site
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_site_builds_strictly(site):
    for page in ("index", "strategies/index", "BENCHMARKS/index", "GPU/index", "comparison/index"):
        assert (site / f"{page}.html").is_file(), page


# ------------------------------------------------------------------------------------------------ README's links
def _links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # links inside code blocks are not links
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def _page_ids(site: Path, page: Path) -> set[str]:
    """The ids of a built page: its headings as mkdocs (Python-Markdown's toc) slugified them."""
    rel = page.relative_to(ROOT / "docs").with_suffix("")
    html = site / ("index.html" if rel.name == "index" else f"{rel}/index.html")
    return set(re.findall(r'id="([^"]+)"', html.read_text()))


def test_every_relative_link_in_the_readme_resolves(site):
    links = [link for link in _links(README.read_text()) if not re.match(r"[a-z]+:", link)]
    assert len(links) >= 10, links  # the README links into the site
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (README.parent / path).resolve()
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and anchor not in _page_ids(site, target):
            broken.append(f"{link}: no heading with this anchor in {path}")
    assert not broken, broken


# ------------------------------------------------------------------------------------------------ README's commands
def readme_commands() -> list[str]:
    """Each command of README's ```bash blocks, continuation lines joined, comments dropped."""
    return doc_commands(README)


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    source = (ROOT / path).read_text()
    return not name or re.search(rf"^def {name}\(", source, flags=re.M) is not None


def test_the_tests_named_for_readme_commands_exist():
    for command, test in RUN_BY.items():
        assert _test_exists(test), f"{command!r} is said to be run by {test}, which does not exist"
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def example_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the README's own-model example names: a Llama directory (config only: random weights) and a token file."""
    import numpy as np
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("readme-example")
    AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320).save_pretrained(root / "my-llama")
    (np.arange(4096) % 256).astype(np.uint16).tofile(root / "corpus.bin")  # byte-sized ids
    return {MODEL_DIR: str(root / "my-llama"), TOKENS: str(root / "corpus.bin")}


def test_every_readme_command_is_run_by_a_test_or_checked(example_paths):
    commands = readme_commands()
    launches = [c for c in commands if "launch/train.py" in c and "--check-config" not in c]
    assert launches and all(c.startswith("python -m dist_train.torchrun ") for c in launches)  # it checks first
    assert any("launch/compare.py" in c for c in commands)
    unchecked = unchecked_commands(commands, run_by=RUN_BY, paths=example_paths)
    assert not unchecked, "\n".join(unchecked)


def unchecked_commands(commands: list[str], *, run_by: dict[str, str], paths: dict[str, str]) -> list[str]:
    """`command: why` for each command neither named in `run_by` (by its prefix) nor accepted by `check_command`,
    once the example paths are put in for their placeholders."""
    unchecked = []
    for command in commands:
        if any(command.startswith(prefix) for prefix in run_by):
            continue
        for placeholder, path in paths.items():
            command = command.replace(placeholder, path)
        try:
            check_command(shlex.split(command))
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its command
            unchecked.append(f"{command}: {type(exc).__name__}: {exc}")
    return unchecked


# ------------------------------------------------------------------------------------------------ the docs' commands
DOCS = sorted((ROOT / "docs").glob("*.md"))
# A docs command (its prefix) that no check here can judge -> the test that runs it, or why nothing here can.
DOCS_RUN_BY = {
    **RUN_BY,
    ". .venv/bin/activate": "the shell's own",
    "pip install -c constraints.txt torch==2.13.0 -e .[dev]": "tests/unit/test_install.py",
    "python3 -m pip install --no-index --no-deps --target /tmp/site .whl/": "a lent GPU machine (docs/bench.md)",
    "python bench/gpu_check.py": "a GPU machine (docs/GPU.md)",
    "python bench/gpu_calibrate.py": "a GPU machine (docs/GPU.md); its kept output: tests/unit/test_gpu_calibrate.py",
    "pytest -q tests/launched/test_cuda.py": "a GPU machine (docs/GPU.md)",
    "bash bench/gpu_followup.sh": "a GPU machine (docs/GPU.md); without one it runs nothing",
    "python launch/train.py --help": "tests/launched/test_help.py::test_every_entry_point_has_help",
    "python launch/train.py --cfg job": "Hydra's own (prints the composed config)",
    "python launch/train.py strategy=single checkpoint.resume=outputs/fsdp-long/":
        "tests/launched/test_checkpoint.py::test_fsdp_checkpoint_reshards_into_other_strategies_and_world_sizes",
    "python launch/export.py outputs/fsdp-long/": "tests/launched/test_checkpoint.py::test_export_loads_in_transformers_and_reproduces_the_next_loss",
    "python launch/export.py outputs/lora-run/": "tests/launched/test_export_lora.py::test_lora_export_merges_reproduces_the_next_loss_and_trains_on",
    "python launch/plan.py model=tiny train.global_batch_size=8 cluster.gpu=cpu plan.verify=4":
        "tests/launched/test_plan.py::test_verify_on_this_machine",
    "python launch/train.py -m hydra/launcher=submitit_slurm": "tests/launched/test_slurm.py::test_a_sweep_of_jobs_is_collected_into_one_report",
    "python launch/compare.py compare.from=[sweeps/demo/": "tests/launched/test_slurm.py::test_a_sweep_of_jobs_is_collected_into_one_report",
    "sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sbatch compare ": "tests/launched/test_slurm.py::test_compare_runs_every_strategy_as_a_job_step",
    "python launch/dashboard.py outputs/compare-": "tests/launched/test_compare.py::test_the_dashboard_names_only_keys_the_runs_logged",
    "accelerate launch ": "tests/launched/test_accelerate.py::test_accelerate_launch_runs_the_same_training",  # your my_fsdp.yaml
}


def doc_commands(path: Path) -> list[str]:
    """Each command of a page's ```bash blocks (the README's or a docs page's), continuation lines joined, comments
    dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(" ".join(words))
    return commands


def test_the_tests_named_for_docs_commands_exist():
    for command, test in DOCS_RUN_BY.items():
        if test.startswith("tests/") or test == ".ci/run":
            assert _test_exists(test), f"{command!r} is said to be run by {test}, which does not exist"


def test_every_docs_command_runs_as_printed_or_is_run_by_a_test(example_paths):
    """The docs' examples as printed: each training, comparison or estimate command is checked the way its entry point
    checks it before it starts (the README's checks), the rest are named with the test that runs them."""
    unchecked = [f"{page.name}: {line}" for page in DOCS
                 for line in unchecked_commands(doc_commands(page), run_by=DOCS_RUN_BY, paths=example_paths)]
    assert not unchecked, "\n".join(unchecked)


def check_command(words: list[str]) -> None:
    """Raise unless the command is one its entry point would accept (nothing is trained)."""
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):  # WORLD_SIZE=8 python ...
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    tool, args = words[0], words[1:]
    if words[:3] == ["python", "-m", "dist_train.torchrun"]:  # torchrun's arguments, the config checked first
        tool, args = "torchrun", words[3:]
    if tool == "deepspeed":  # deepspeed --num_gpus N launch/train.py ...
        assert args[0] == "--num_gpus" and args[2] == "launch/train.py", words
        return check_training(args[3:], world_size=int(args[1]))
    if tool == "make":
        return check_make_target(args[0])
    if tool == "torchrun":
        options, script, rest = _launcher_options(args)
        assert script == "launch/train.py", script
        return check_training(rest, world_size=int(options["nproc_per_node"]) * int(options.get("nnodes", 1)))
    if tool == "sbatch":
        options, script, rest = _launcher_options(args)
        assert script == "launch/slurm.sbatch" and rest[0] != "compare", words
        return check_training(rest, world_size=int(options["nodes"]) * int(options["gpus-per-node"]))
    assert tool == "python", f"no check for {tool}"
    if args[:2] == ["-m", "dist_train.estimate"]:
        return check_estimate(args[2:])
    script, rest = args[0], args[1:]
    if script == "launch/train.py":
        rest = [a for a in rest if a != "--check-config"]
        return check_training(rest, world_size=int(env.get("WORLD_SIZE", 1)))
    if script == "launch/compare.py":
        return check_comparison(rest)
    raise AssertionError(f"no check for {script}: add one, or name the test that runs it in RUN_BY")


def _launcher_options(args: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """torchrun's or sbatch's own --key=value options, the script, and the script's arguments."""
    options = {}
    while args[0].startswith("-"):
        key, _, value = args.pop(0).lstrip("-").partition("=")
        options[key] = value
    return options, args[0], args[1:]


def check_training(overrides: list[str], *, world_size: int) -> None:
    """What `WORLD_SIZE=N python launch/train.py --check-config <overrides>` checks (dist_train.train.main), but the
    device rule: how many GPUs this machine has says nothing of a command written for a GPU node."""
    from dist_train.checks import validate
    from dist_train.estimate.compose import compose_run

    validate(compose_run(overrides), world_size)


def check_comparison(argv: list[str]) -> None:
    """What launch/compare.py checks before the first row runs (dist_train.compare.main.main)."""
    from dist_train.compare.runner import check_rows
    from dist_train.compare.settings import parse, split_argv
    from dist_train.compare.sweep import expand
    from dist_train.estimate.compose import compose_training_config

    own, training = split_argv(argv)
    cfg = parse(own)
    base = compose_training_config(training)
    problems = check_rows(expand(cfg.strategies, cfg.sweep), training, world_size=cfg.nproc, base_train=base["train"])
    assert not problems, problems


def check_estimate(argv: list[str]) -> None:
    """The estimator runs nothing but arithmetic: run it, as `python -m dist_train.estimate` would. A dry run
    (`dryrun.ranks=`) has its options parsed, and the estimate beside it run; the dry run itself, a process per rank
    (a minute for a 70B model), is run through the same command line by tests/unit/test_estimate.py (its --help
    examples) and tests/launched/test_dryrun.py."""
    from dist_train.estimate.args import parse_args, split_args
    from dist_train.estimate.cli import main

    parse_args(split_args(argv)[0])  # every option of the estimator's own, the dry run's included
    argv = [a for a in argv if not a.startswith("dryrun.")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0 and "fit" in out.getvalue().lower(), err.getvalue()[-2000:]


def check_make_target(target: str) -> None:
    """A Makefile target exists; `make demo`'s training command is checked like any other."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^{target}:", makefile, flags=re.M), f"no `{target}` target in the Makefile"
    if target == "demo":
        recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
        nproc = re.search(r"^NPROC \?= (\d+)", makefile, flags=re.M).group(1)
        args = recipe.split("launch/train.py", 1)[1].split()
        check_training(args, world_size=int(nproc))
