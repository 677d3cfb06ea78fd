"""FSDP's way to accumulate gradients over several micro-batches, when the run leaves it to dist_train
(`strategy.reduce_every_microbatch=null`, the default of fsdp, hsdp and fsdp_ep).

Holding every parameter's unsharded fp32 gradient from the first micro-batch's backward to the last one's
reduce-scatter costs 4 B/param on every rank, whatever the number of ranks: 280 GB for a 70B model, which undoes
FSDP's sharding at the sizes it is for. Reduce-scattering after every micro-batch (torchtitan's way) holds 4 B/param
/ N and sends the gradients once per micro-batch. The choice is made once, before the model is built, by the memory
it would take: the gradients are held where the estimator's predicted peak of this very run fits in 90% of the
device's memory (as the advisor's plan.memory_fraction), and reduce-scattered after every micro-batch where it does
not. On a CPU there is no device memory to choose by: they are held, as before. The choice is written into the run's
config (config.yaml, W&B, checkpoints, the comparison's prediction read it) and said in one log line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

MEMORY_FRACTION = 0.9  # the share of the device a held-gradient run may fill at its predicted peak


def choose(config: dict[str, Any], *, world_size: int, device_memory_bytes: Optional[float]) -> tuple[bool, str]:
    """(reduce every micro-batch, the line that says why) for a resolved run config whose strategy leaves the choice
    open. `device_memory_bytes`: one device's memory, None on a CPU."""
    from dist_train.estimate import ModelShape, predict_memory, setup_from_config
    from dist_train.estimate.memory import tp_rank_params
    from dist_train.estimate.render import human_bytes as b

    try:
        shape = ModelShape.from_config(config["model"])
        held = setup_from_config(config, world_size=world_size, reduce_every_microbatch=False)
    except (ValueError, KeyError) as exc:  # LoRA (adapters' gradients only), a model the estimator cannot read
        return False, f"gradients held unsharded until the last micro-batch (not predicted: {exc})"
    m = held.microbatches_per_step
    if m <= 1:
        return False, ""
    grads = 4 * tp_rank_params(shape, held)  # every parameter, or the dense ones and the rank's experts (fsdp_ep)
    if device_memory_bytes is None:
        return False, (f"{m} micro-batches a step: unsharded fp32 gradients held until the last "
                       f"({b(grads)} a rank; on a CPU there is no device memory to choose by)")
    peak = max(r.peak for r in predict_memory(shape, held))
    budget = device_memory_bytes * MEMORY_FRACTION
    if peak <= budget:
        return False, (f"{m} micro-batches a step: unsharded fp32 gradients held until the last, one reduce-scatter "
                       f"a step (predicted peak {b(peak)} <= {b(budget)} usable)")
    return True, (f"{m} micro-batches a step: reduce-scattered after every micro-batch, since holding the unsharded "
                  f"fp32 gradients ({b(grads)} a rank) would take the predicted peak to "
                  f"{b(peak)} > {b(budget)} usable")


def resolve(run: Any, cfg: Any, *, world_size: int, device: Any) -> tuple[Any, str]:
    """`run` with strategy.reduce_every_microbatch decided where it is null (and `cfg` updated in place, so that
    config.yaml records the choice), and the line to log once the run's log is open ("" if nothing was decided)."""
    from omegaconf import OmegaConf

    if getattr(run.strategy, "reduce_every_microbatch", False) is not None:
        return run, ""
    if getattr(run.strategy, "dp_mode", "fsdp") == "replicate":  # ep's whole gradients: nothing to choose
        OmegaConf.update(cfg, "strategy.reduce_every_microbatch", False)
        return replace(run, strategy=replace(run.strategy, reduce_every_microbatch=False)), ""
    import torch
    import torch.distributed as dist

    memory = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    config = OmegaConf.to_container(cfg, resolve=True)
    reduce, line = choose(config, world_size=world_size, device_memory_bytes=memory)
    if memory is not None and world_size > 1 and dist.is_initialized():
        # one choice for every rank, even where their devices differ: reduce if any rank must (a CPU's is the same
        # on every rank)
        flag = torch.tensor([int(reduce)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if bool(flag.item()) != reduce:
            reduce, line = True, "reduce-scattered after every micro-batch: another rank's device cannot hold them"
    OmegaConf.update(cfg, "strategy.reduce_every_microbatch", reduce)
    said = (f"strategy={run.strategy.name}: {line}; strategy.reduce_every_microbatch=true|false decides instead"
            if line else "")
    return replace(run, strategy=replace(run.strategy, reduce_every_microbatch=reduce)), said
