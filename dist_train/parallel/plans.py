"""What a model says about how it splits, read from transformers' own description of it (pure: no torch.distributed).

Tensor parallelism reads `base_model_tp_plan`; the styles it applies are listed here, and a plan that uses another
is refused by name before any process starts."""

from __future__ import annotations

from typing import Any

from dist_train.architectures import DECODER_SEQUENCE_PARALLEL, fallback_plans


# Styles of transformers' per-block TP plans (`base_model_tp_plan`) that tensor parallelism here applies.
# colwise_gather_output / rowwise_split_input (Phi-3's fused qkv_proj and gate_up_proj, OLMo 2's q/k/v): the
# projection's weight is split as colwise / rowwise, its output gathered whole / its whole input split on entry,
# so what lies between runs unsplit on every rank (a fused [q | k | v] cut in contiguous columns is not whole heads).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
             "colwise_fused_qkv")  # the last: this project's own, for a fused q/k/v (dist_train/architectures.py)
# The styles that keep what lies between two projections whole: sequence parallelism cannot split it.
GATHERING_STYLES = ("colwise_gather_output", "rowwise_split_input")


def block_tp_plan(config: Any, *, experts_by_ep: bool = False) -> dict[str, str]:
    """{path inside a transformer block: style} from transformers' own plan for this architecture
    (`base_model_tp_plan`'s `layers.*.` entries), or the one dist_train/architectures.py writes for an architecture
    transformers gives none. ValueError, saying why, for a model without a plan or with a style not applied here.
    `experts_by_ep`: an MoE model's experts are split by expert parallelism instead, and their entries left out."""
    fallback = fallback_plans(config.model_type)
    if fallback is not None:
        return dict(fallback.tp)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    block = {key.split(".*.", 1)[1]: style for key, style in plan.items() if ".*." in key}
    if experts_by_ep:
        block = {path: style for path, style in block.items() if not _in_experts(path)}
    if not block:
        raise ValueError(f"model.arch={config.model_type} has no tensor-parallel plan in transformers "
                         "(base_model_tp_plan), so its projections cannot be split")
    other = sorted({style for style in block.values() if style not in TP_STYLES})
    if other:
        raise ValueError(f"model.arch={config.model_type}'s tensor-parallel plan uses {', '.join(other)}, which is not "
                         f"applied here (only {', '.join(TP_STYLES)})")
    return block


def block_sequence_parallel_plan(config: Any) -> dict[str, str]:
    """{block child: role} under sequence parallelism (architectures.Plans.sequence_parallel): a decoder block laid
    out as Llama's, or what dist_train/architectures.py writes for the architecture."""
    fallback = fallback_plans(config.model_type)
    return dict(fallback.sequence_parallel if fallback is not None else DECODER_SEQUENCE_PARALLEL)


def per_rank_attributes(config: Any) -> tuple[str, ...]:
    """Block attributes counting what one rank computes, divided by the tensor-parallel degree (GPT-2's heads)."""
    fallback = fallback_plans(config.model_type)
    return fallback.per_rank if fallback is not None else ()


def _in_experts(path: str) -> bool:
    """Whether a block path is a layer of stacked experts or inside one (`mlp.experts`, `mlp.experts.down_proj`)."""
    return "experts" in path.split(".")
