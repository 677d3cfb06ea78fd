"""Which strategies fit in G GiB per GPU, for a model on N GPUs: the worst rank's predicted peak (RankMemory.peak:
the peak of all live tensors where the estimator models it, else model state plus the working set)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from dist_train.estimate.memory import SHAPED_OPTIMIZERS, RankMemory, model_state_bytes, predict_memory
from dist_train.estimate.setup import KNOWN_STRATEGIES, MODELLED_AS, Setup, family_of, named_only
from dist_train.estimate.render import human_count
from dist_train.estimate.shapes import PRESETS, ModelShape, find_preset

GIB = 2**30

DEFAULT_FIT_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "gpipe")
DEFAULT_FIT_GPUS = (8, 64, 1024)


@dataclass(frozen=True)
class FitModel:
    """A model to ask about: a full shape (activations predicted) or only a parameter count (model state only)."""

    name: str
    num_params: float
    shape: Optional[ModelShape] = None
    # strategy -> why training refuses this model under it at any world size (a model directory whose architecture
    # has no pipeline or tensor-parallel plan, an MoE model under tensor parallelism): its cells are n/a with that
    # reason
    refused: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FitCell:
    model: str
    strategy: str
    world_size: int
    peak_bytes: Optional[float]  # worst rank; None: cannot run (note says why)
    fits: bool
    note: str = ""


def worst_rank(ranks: list[RankMemory]) -> RankMemory:
    return max(ranks, key=lambda r: r.peak)


def fit_cell(model: FitModel, *, base: Setup, strategy: str, world_size: int, gpu_bytes: float) -> FitCell:
    """`base` gives precision, optimizer, micro-batch, sequence length; a pipeline runs M = K micro-batches."""
    family, stage, schedule = family_of(strategy)
    own = {} if strategy == base.strategy else named_only(strategy)
    setup = replace(base, strategy=strategy, family=family, zero_stage=stage, schedule=schedule,
                    world_size=world_size, split_points=None,
                    num_microbatches=world_size if family == "pipeline" else None, global_batch_size=None, **own)
    if strategy in model.refused:
        return FitCell(model.name, strategy, world_size, None, False, model.refused[strategy])
    if family == "tp":
        if model.shape is None:
            return FitCell(model.name, strategy, world_size, None, False, "needs a model shape")
        kv = model.shape.num_kv_heads or model.shape.num_heads
        if model.shape.num_heads % world_size or kv % world_size:
            return FitCell(model.name, strategy, world_size, None, False, f"{world_size} does not divide the heads")
    if model.shape is not None:
        if family == "pipeline" and world_size > model.shape.num_layers:
            return FitCell(model.name, strategy, world_size, None, False,
                           f"{world_size} stages > {model.shape.num_layers} layers")
        peak = worst_rank(predict_memory(model.shape, setup)).peak
        note = ""
    else:
        if setup.optimizer in SHAPED_OPTIMIZERS:
            return FitCell(model.name, strategy, world_size, None, False, f"optimizer={setup.optimizer} needs a model shape")
        share = model.num_params / setup.num_stages  # no shape: an even pipeline split
        peak = model_state_bytes(share, setup).model_state
        note = "model state only"
    return FitCell(model.name, strategy, world_size, peak, peak <= gpu_bytes, note)


def fit_table(models: list[FitModel], *, base: Setup, strategies: list[str], gpus: list[int],
              gpu_gib: float, seq_len: Optional[int] = None) -> list[FitCell]:
    """Every model x strategy x GPU count; activations at `seq_len` (None: each model's max_seq_len)."""
    cells = []
    for m in models:
        s_len = seq_len or (m.shape.max_seq_len if m.shape is not None else base.seq_len)
        model_base = replace(base, seq_len=s_len)
        for s in strategies:
            for n in gpus:
                cells.append(fit_cell(m, base=model_base, strategy=s, world_size=n, gpu_bytes=gpu_gib * GIB))
    return cells


def fit_shape(name: str) -> ModelShape:
    """A fit.models name: a preset (`7b`, `llama2-7b`) or a conf/model group with a shape of its own; a ValueError
    naming the allowed names otherwise."""
    from dist_train.estimate.compose import model_config, shaped_model_groups

    preset = find_preset(name)
    if preset is not None:
        return preset
    groups = shaped_model_groups()
    if name in groups:
        return ModelShape.from_config(model_config(name))
    why = "needs a model directory (model=hf model.path=DIR puts it in the table as the run's own model)" \
        if name == "hf" else "is not a model"
    raise ValueError(f"fit.models: {name!r} {why}; allowed: {', '.join(PRESETS)}, "
                     f"{', '.join(s.name for s in PRESETS.values())}, {', '.join(groups)}")


def _named(families: tuple[str, ...]) -> tuple[str, ...]:
    """The strategies of these estimator families, less those only modelled as one (ep as ddp_tp's replicas at
    tp 1 splits no projection)."""
    return tuple(n for n, (family, _, _) in KNOWN_STRATEGIES.items() if family in families and n not in MODELLED_AS)


def model_refusals(run: Any) -> dict[str, str]:
    """Strategies training refuses for the run's own model whatever the world size (a model directory
    whose architecture has no pipeline or no tensor-parallel plan in transformers), with training's reason: the
    same checks the strategies run (pipeline.check_splittable, base.check_tensor_parallel)."""
    from dist_train.config import ConfigError
    from dist_train.strategies.base import check_tensor_parallel
    from dist_train.strategies.pipeline import check_splittable

    if run.model.path is None:  # the presets and conf/model shapes: GPT-2 and Llama, which both split
        return {}
    out: dict[str, str] = {}
    for names, check in ((_named(("pipeline",)), lambda: check_splittable(run, what="pipelines")),
                         (_named(("tp", "fsdp_tp")), lambda: check_tensor_parallel(run, 1, what="tensor parallelism"))):
        try:
            check()
        except ConfigError as exc:
            out.update(dict.fromkeys(names, str(exc)))
    return out


def fit_models(shape: ModelShape, *, names: list[str], params: list[float],
               refused: Optional[dict[str, str]] = None) -> list[FitModel]:
    """The fit table's models: the run's own first (with the strategy families training refuses for it), then
    fit.models (`names`) and fit.params (`params`)."""
    models = [FitModel(shape.name, shape.num_params, shape, refused=refused or {})]
    for name in names:
        other = fit_shape(name)
        if any(other == m.shape for m in models):
            continue  # the run's own model, or a name given twice
        label = other.name
        if any(label == m.name for m in models):  # e.g. model=70b model.num_layers=2 beside the 70b preset
            label = f"{other.name} ({human_count(other.num_params)})"
        models.append(FitModel(label, other.num_params, other))
    models += [FitModel(f"{human_count(p)} params", p) for p in params]
    return models
