"""The strategy registry: every `strategy=<name>`, found in the strategy modules themselves.

Each family module of this package (single, dp, ddp, fsdp, zero, pipeline, ...) ends with
`FAMILY = StrategyFamily(...)`: its config schema (with its checks, whether it needs a process group and how
many processes it runs), the names it answers to with the values each implies, and its builder. Modules
without a `FAMILY` are shared pieces (base, torch_strategy, pipeline_stages). Modules whose name starts with
`_` are never imported here: they hold what only a run of their strategy needs (heavy imports such as DTensor
stay out of every other run's start-up). Adding a strategy therefore touches its own module and its
conf/strategy/<name>.yaml; config, the loop, telemetry and compare ask here.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from dist_train import strategies
from dist_train.config import ConfigError, RunConfig, StrategyConfig, choice
from dist_train.contracts import Strategy, StrategyFamily


@functools.cache
def families() -> dict[str, StrategyFamily]:
    """Every strategy name -> its family, from the FAMILY of each module of this package."""
    found: dict[str, StrategyFamily] = {}
    for info in pkgutil.iter_modules(strategies.__path__):
        if info.name == "registry" or info.name.startswith("_"):
            continue
        family = getattr(importlib.import_module(f"{strategies.__name__}.{info.name}"), "FAMILY", None)
        if family is None:
            continue
        for name in family.names:
            assert name not in found, f"strategy name {name!r} is registered by two modules"
            found[name] = family
    return found


def available() -> list[str]:
    return sorted(families())


def default_config(name: str) -> StrategyConfig:
    """The schema instance `strategy=<name>` starts from (the YAML sets the same values)."""
    if name not in families():
        raise ConfigError(f"strategy={name} is not a strategy; available: {', '.join(available())}")
    return families()[name].config(name)


def names_with(trait: str) -> list[str]:
    """The strategy names whose schema has `trait` (a StrategyConfig class trait), one-process ones first."""
    names = [n for n in families() if getattr(default_config(n), trait)]
    return sorted(names, key=lambda n: default_config(n).needs_process_group)  # stable: module order otherwise


def one_process(name: str) -> bool:
    """Whether `strategy=<name>` runs as one plain process (no process group: single, dp), whatever the
    number of processes per node a launch asks for."""
    return not default_config(name).needs_process_group


def register_configs() -> None:
    """Put the run schema and every family's strategy schema in Hydra's ConfigStore.

    The strategy schemas live in their own group (`schema/strategy/<family>`), so `strategy=` lists only real
    strategies; each conf/strategy/*.yaml pulls its schema in with `- /schema/strategy/<family>@_here_`.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for family in {f.family: f for f in families().values()}.values():
        cs.store(group="schema/strategy", name=family.family, node=family.schema)


def check_strategy(run: RunConfig, world_size: int) -> None:
    """The strategy's own checks, for `world_size` processes (ConfigError, one line)."""
    choice("strategy.name", run.strategy.name, tuple(available()))
    run.strategy.check(world_size)
    run.strategy.check_run(run, world_size)


def build_strategy(cfg: StrategyConfig, ctx: Any) -> Strategy:
    return families()[cfg.name].build(cfg, ctx)
