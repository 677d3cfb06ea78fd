"""Under `torchrun --nproc_per_node=2`: tensor parallelism from each architecture's own plan computes what the whole
model computes. For every model directory given: the loss, and every parameter's gradient gathered whole, under TP
(with and without sequence parallelism) against the same model unsplit on this rank. Prints one JSON line on rank 0:
{arch: {"tp": [loss diff, worst gradient diff], "tp_sp": [...]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

from dist_train.model import forward_loss  # noqa: E402
from dist_train.parallel.tensor_parallel import parallelize  # noqa: E402
from dist_train.runtime import exit_now  # noqa: E402


def load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # eval: no dropout (GPT-2 configs set 0.1), so both runs compute the same function
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ids = torch.randint(256, (2, 32))
    labels = torch.randint(256, (2, 32))
    out: dict[str, dict[str, list[float]]] = {}
    for path in sys.argv[1:]:
        whole = load(path)
        expected = forward_loss(whole, ids, labels)
        expected.backward()
        arch = whole.config.model_type
        out[arch] = {}
        for name, sp in (("tp", False), ("tp_sp", True)):
            try:
                model = parallelize(load(path), mesh, sequence_parallel=sp)
            except ValueError as exc:  # a plan the mode refuses: its one line, for the test to read
                out[arch][name] = str(exc)
                continue
            with loss_parallel():  # the head's logits are split by vocabulary (as in TPStrategy's steps)
                loss = forward_loss(model, ids, labels)
                loss.backward()
            grads = dict(model.named_parameters())
            worst = max(float((grads[n].grad.full_tensor() - p.grad).abs().max()) for n, p in whole.named_parameters())
            out[arch][name] = [abs(float(loss) - float(expected)), worst]
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    exit_now(0)  # gloo's threads can abort interpreter teardown (see dist_train.runtime.leave)


if __name__ == "__main__":
    main()
