"""The shape of the house: no import cycles, one place per strategy name, contracts that depend on nothing.

The import graph is read from the source (every `import`, those inside functions included), so a lazy
import cannot hide a cycle. Two levels are checked: modules, and the top-level parts of dist_train
(config, strategies, telemetry, checkpoint, compare, ...), where `strategies -> telemetry -> strategies`
would be a cycle even if no two modules imported each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dist_train.estimate.setup import MODELLED_AS, NOT_MODELLED, setup_from_config
from dist_train.strategies.registry import available, families, register_configs
from tests.helpers import ROOT

PACKAGE = ROOT / "dist_train"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _owner(name: str) -> str:
    """The module of MODULES that `import name` runs last (a.b.c -> a.b if c is a name, not a module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set[str]:
    """The project modules `module` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dist_train"):
            found.add(_owner(node.module))
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(_owner(a.name) for a in node.names if a.name.startswith("dist_train"))
    found.discard(module)
    found.discard("dist_train")  # the package's __init__ is empty
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_module_import_graph_has_no_cycle():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_the_parts_of_dist_train_import_each_other_without_a_cycle():
    parts: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        parts.setdefault(_part(module), set()).update(_part(d) for d in deps if _part(d) != _part(module))
    assert _cycle(parts) is None, " -> ".join(_cycle(parts) or [])


def test_the_shared_contracts_import_nothing_of_the_project():
    assert GRAPH["dist_train.contracts"] == set()


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


FAMILY_MODULES = sorted({f.build.__module__ for f in families().values()})


def test_every_strategy_family_lives_in_one_module_of_the_strategies_package():
    assert FAMILY_MODULES and all(m.startswith("dist_train.strategies.") for m in FAMILY_MODULES)
    for family in families().values():
        assert family.schema.__module__ == family.build.__module__, family.family


@pytest.mark.parametrize("module", FAMILY_MODULES)
def test_a_strategy_module_imports_no_other_strategy_module(module):
    """Shared pieces (base, torch_strategy, pipeline_stages) are fine; another family's module is not."""
    others = set(FAMILY_MODULES) - {module}
    assert not GRAPH[module] & others


def test_finding_the_strategies_imports_none_of_their_heavy_machinery():
    """The registry imports every family module (for its schema) in every run, config errors included: DTensor,
    pipelining, DCP, FSDP and DeepSpeed must wait until a strategy that needs them is built (start-up time)."""
    heavy = ("torch.distributed.tensor", "torch.distributed.pipelining", "torch.distributed.checkpoint",
             "torch.distributed.fsdp", "deepspeed", "torch._dynamo")
    code = ("from dist_train.strategies.registry import families; families(); import sys; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def _yaml_names() -> set[str]:
    return {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}


def test_the_registry_and_the_strategy_yaml_files_name_the_same_strategies():
    assert set(available()) == _yaml_names()


@pytest.mark.parametrize("name", sorted(_yaml_names()))
def test_each_strategy_yaml_composes_to_what_its_module_registers(name):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"strategy={name}"])
    family = families()[name]
    composed = OmegaConf.to_object(cfg.strategy)
    assert type(composed) is family.schema
    assert asdict(composed) == asdict(family.config(name))
    # the estimator tells the same family from the composed config (what compare's predictions use), or says in one
    # line that it does not model the strategy
    if name in NOT_MODELLED:
        with pytest.raises(ValueError, match=f"strategy={name}: the estimator does not model"):
            setup_from_config(OmegaConf.to_container(cfg, resolve=True), world_size=2)
        return
    setup = setup_from_config(OmegaConf.to_container(cfg, resolve=True), world_size=2)
    assert setup.family == MODELLED_AS.get(name, family.family)


def test_no_strategy_parallelism_or_estimator_module_names_an_architecture():
    """Architectures are described once (dist_train/architectures.py: features, and GPT-2's plans as data;
    transformers' own plans; dist_train/model.py's layouts): a module under strategies/, parallel/ or estimate/ that
    compared a model's type with a name (`== "gpt2"`) would make every new architecture touch it. Any string in their
    code that is one of transformers' model types fails."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_types = set(CONFIG_MAPPING_NAMES)
    named = []
    for room in ("strategies", "parallel", "estimate"):
        for path in sorted((PACKAGE / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in model_types:
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not named, named
    assert "gpt2" in model_types and "llama" in model_types  # the check itself sees the names it looks for
