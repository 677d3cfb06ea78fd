"""Run by tests/launched/test_moe.py on 2 ranks: expert parallelism's dispatch (dist_train/parallel/experts.py) on one
MoE layer's experts, against transformers' own module with every expert, when every token of both ranks is routed to
rank 0's experts. Writes what it found to <hydra.run.dir>/ep_dispatch.json (the argument the test launcher adds)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    out_dir = Path(next(a for a in sys.argv[1:] if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from dist_train.parallel.experts import shard_experts

    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    reference = Qwen3MoeExperts(config)
    for p in reference.parameters():
        nn.init.normal_(p, std=0.2)
    holder = nn.Module()
    holder.experts = copy.deepcopy(reference)
    shard_experts(holder, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))

    # Each rank's own tokens, every one routed to two distinct experts among 0-3: rank 0's.
    torch.manual_seed(1 + rank)
    tokens = 24
    hidden = torch.randn(tokens, 16)
    first = torch.randint(0, 4, (tokens,))
    top_k_index = torch.stack([first, (first + 1) % 4], dim=1)
    top_k_weights = torch.softmax(torch.randn(tokens, 2), dim=-1)

    from dist_train.telemetry.activations import ActivationMeter

    ours_in = hidden.clone().requires_grad_(True)
    meter = ActivationMeter()
    with meter.measuring():  # what this rank's dispatch and experts keep for backward
        ours = holder.experts(ours_in, top_k_index, top_k_weights)
        saved = meter.live_bytes
        (ours * torch.arange(16.0)).sum().backward()  # a contiguous gradient, different per column
    theirs_in = hidden.clone().requires_grad_(True)
    theirs = reference(theirs_in, top_k_index, top_k_weights)
    (theirs * torch.arange(16.0)).sum().backward()

    # The reference's expert gradients summed over both ranks' tokens: what this rank's experts must hold.
    local = slice(4 * rank, 4 * rank + 4)
    found = {"rank": rank, "saved_bytes": saved, "output": float((ours - theirs).detach().abs().max()),
             "input_grad": float((ours_in.grad - theirs_in.grad).abs().max())}
    for name in ("gate_up_proj", "down_proj"):
        summed = getattr(reference, name).grad.clone()
        dist.all_reduce(summed)
        mine = getattr(holder.experts, name).grad.to_local()
        # relative to the largest gradient element: the sums of two ranks' tokens round differently
        found[f"{name}_grad"] = float((mine - summed[local]).abs().max() / summed.abs().max())
        found[f"{name}_grad_all_zero"] = bool((mine == 0).all())
    (out_dir / f"ep_dispatch.rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
