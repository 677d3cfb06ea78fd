"""Pure parts: bus-bandwidth maths, LR schedule, data determinism and slicing, byte counting, FLOPs."""

from __future__ import annotations

import pytest
import torch

from dist_train.config import DataConfig, TrainConfig
from dist_train.data import GlobalBatches, SyntheticDataset, TextFileDataset, build_dataset
from dist_train.optim import LRSchedule
from dist_train.telemetry.activations import ActivationMeter
from dist_train.telemetry.bandwidth import busbw_factor, busbw_gbps
from dist_train.telemetry.comm_analysis import peer_wait
from dist_train.telemetry.flops import flops_per_token, peak_flops
from dist_train.contracts import ModelState, tensor_bytes
from dist_train.telemetry.wandb_sink import wandb_payload


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [("all_reduce", 8, 2 * 7 / 8), ("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4),
     ("broadcast", 8, 1.0), ("send", 2, 1.0), ("recv", 2, 1.0), ("all_reduce", 2, 1.0)],
)
def test_busbw_factor_follows_nccl_tests(op, n, factor):
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_busbw_gbps_is_size_over_time_times_factor():
    # 1 GB all-reduced in 0.1 s on 4 ranks: algbw 10 GB/s, busbw 10 * 2 * 3/4 = 15 GB/s
    assert busbw_gbps("all_reduce", 1e9, 0.1, 4) == pytest.approx(15.0)
    assert busbw_gbps("all_gather", 1e9, 0.0, 4) == 0.0


def test_peer_wait_takes_out_the_time_before_the_last_member_issued():
    g = (0, 1)
    calls = {
        # rank 0 issues seq 0 at 1.0, rank 1 at 1.3; both finish at 1.5: 0.3 s of rank 0's 0.5 s is waiting
        0: {"all_reduce": [(g, 0, 100, 1.0, 1.5), (g, 1, 100, 2.0, 2.2)]},
        # seq 1: rank 1 is early (1.9) and waits 0.1 for rank 0
        1: {"all_reduce": [(g, 0, 100, 1.3, 1.5), (g, 1, 100, 1.9, 2.2)]},
    }
    split = peer_wait(calls, {0: "a", 1: "a"})
    assert split[0]["all_reduce"].wait_s == pytest.approx(0.3)
    assert split[0]["all_reduce"].transfer_s == pytest.approx(0.4)
    assert split[1]["all_reduce"].wait_s == pytest.approx(0.1)
    assert split[1]["all_reduce"].transfer_s == pytest.approx(0.4)
    assert split[1]["all_reduce"].timed_bytes == 200
    # Clocks on different hosts are not compared, and a call some member has not completed is not matched:
    # the whole time is then the transfer.
    apart = peer_wait(calls, {0: "a", 1: "b"})
    assert apart[0]["all_reduce"].wait_s == 0.0 and apart[0]["all_reduce"].transfer_s == pytest.approx(0.7)
    partial = peer_wait({0: calls[0], 1: {"all_reduce": calls[1]["all_reduce"][:1]}}, {0: "a", 1: "a"})
    assert partial[0]["all_reduce"].wait_s == pytest.approx(0.3)
    # A rank's next collective on the group cannot start before its previous one ended (FSDP's prefetch
    # issues early): issued at 1.2 on both ranks, behind seq 0 until 1.5, it transfers for 0.3.
    queued = {r: {"all_gather": [(g, 0, 100, 1.0, 1.5), (g, 1, 100, 1.2, 1.8)]} for r in (0, 1)}
    q = peer_wait(queued, {0: "a", 1: "a"})[0]["all_gather"]
    assert q.wait_s == pytest.approx(0.3) and q.transfer_s == pytest.approx(0.5 + 0.3)
    # point-to-point ops carry no group: never matched
    assert peer_wait({0: {"send": [(None, 0, 8, 0.0, 1.0)]}}, {0: "a"})[0]["send"].transfer_s == 1.0


def test_lr_schedule_warmup_then_cosine_to_floor():
    t = TrainConfig(steps=10, lr_warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    f = LRSchedule(t)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(2, 10))
    assert LRSchedule(TrainConfig(lr_schedule="constant"))(7) == 1.0


def test_synthetic_data_is_a_function_of_seed_and_step():
    a = SyntheticDataset(vocab_size=256, seq_len=16, seed=1, noise=0.1)
    b = SyntheticDataset(vocab_size=256, seq_len=16, seed=1, noise=0.1)
    c = SyntheticDataset(vocab_size=256, seq_len=16, seed=2, noise=0.1)
    assert torch.equal(a.batch(5, 8), b.batch(5, 8))
    assert not torch.equal(a.batch(5, 8), c.batch(5, 8)) and not torch.equal(a.batch(5, 8), a.batch(6, 8))
    assert a.batch(0, 4).shape == (4, 17) and int(a.batch(0, 4).max()) < 256


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_data_parallel_slices_reassemble_the_global_batch(dp_size):
    ds = SyntheticDataset(vocab_size=64, seq_len=8, seed=3, noise=0.2)
    whole = GlobalBatches(ds, global_batch_size=8, dp_rank=0, dp_size=1).local_batch(step=2)
    parts = [GlobalBatches(ds, global_batch_size=8, dp_rank=r, dp_size=dp_size).local_batch(step=2) for r in range(dp_size)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), whole.input_ids)
    assert torch.equal(whole.labels[:, :-1], whole.input_ids[:, 1:])  # labels are next tokens


def test_textfile_windows_are_byte_tokens_and_cover_an_epoch(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(200)) * 3)  # 600 bytes
    ds = build_dataset(DataConfig(name="textfile", path=str(path)), vocab_size=256, seq_len=9, seed=0)
    assert isinstance(ds, TextFileDataset)
    windows = {tuple(ds.sample(i).tolist()) for i in range(ds.num_windows)}
    assert len(windows) == ds.num_windows == (600 - 1) // 9
    assert all(len(w) == 10 for w in windows)
    second_epoch = {tuple(ds.sample(ds.num_windows + i).tolist()) for i in range(ds.num_windows)}
    assert second_epoch == windows  # the next epoch reshuffles the same windows
    assert [ds.sample(i).tolist() for i in range(3)] != [ds.sample(ds.num_windows + i).tolist() for i in range(3)]


def test_tensor_bytes_counts_shared_storage_once():
    a = torch.zeros(10, dtype=torch.float32)
    view = a[:5]
    b = torch.zeros(3, dtype=torch.bfloat16)
    assert tensor_bytes([a, a, b, None]) == 40 + 6
    state = ModelState(params=[a], grads=[b, None], optimizer=[torch.zeros(4, dtype=torch.float64)])
    assert state.bytes() == {"memory/params_bytes": 40, "memory/grads_bytes": 6, "memory/optimizer_bytes": 32}
    assert tensor_bytes([view]) == 20  # a view at offset 0 counts its own bytes


def test_activation_meter_counts_saved_tensors_and_frees_them_after_backward():
    lin = torch.nn.Linear(256, 256, bias=False)
    meter = ActivationMeter()
    x = torch.randn(32, 256, requires_grad=True)
    with meter.measuring():
        y = torch.relu(lin(x)).sum()  # saves x (32*256*4) and the relu output (32*256*4); not the weight
    assert meter.live_bytes == 2 * 32 * 256 * 4
    y.backward()
    del y
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * 32 * 256 * 4


@pytest.mark.parametrize("container", [dict, list])
def test_selective_checkpointing_cache_is_counted_in_either_form_torch_keeps_it(container):
    """Selective checkpointing's kept outputs sit in a cache shared by torch's two dispatch modes: per op, a dict
    of call index -> entry (torch 2.13: an entry is replaced by a marker when backward consumes it) or a list
    appended to and popped from the front (torch 2.11, the GPU machines' image: training with
    train.activation_checkpointing=selective failed there, the list form having no `append` under the meter).
    Either way the meter counts an entry's tensor while the cache holds it."""
    import collections
    import types

    from dist_train.telemetry.activations import _metered_contexts

    def context_fn():
        forward, recompute = types.SimpleNamespace(), types.SimpleNamespace()
        forward.storage = recompute.storage = collections.defaultdict(container)
        return forward, recompute

    meter = ActivationMeter()
    kept = types.SimpleNamespace(val=torch.randn(64, 64))  # as torch's _VersionWrapper holds an output
    with meter.measuring():
        forward, recompute = _metered_contexts(context_fn)()
        assert forward.storage is recompute.storage
        cache = forward.storage["aten.mm.default"]
        if container is dict:
            cache[0] = kept
        else:
            cache.append(kept)
        assert meter.live_bytes == 64 * 64 * 4
        if container is dict:
            cache[0] = object()  # torch's _CONSUMED
        else:
            assert recompute.storage["aten.mm.default"].pop(0) is kept
        assert meter.live_bytes == 0 and meter.peak_bytes == 64 * 64 * 4


def test_flops_per_token_and_peak_lookup():
    # 6 * (non-embedding params) + 12 * layers * hidden * seq
    assert flops_per_token(num_params=1000, num_embedding_params=200, num_layers=2, hidden_size=8, seq_len=4) == 6 * 800 + 12 * 2 * 8 * 4
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362e12  # not mistaken for an L4
    assert peak_flops("cpu", "fp32") is None


def test_wandb_payload_keys_per_rank_and_max():
    recs = [
        {"rank": 0, "loss": 2.0, "lr": 0.1, "memory/params_bytes": 10, "comm/all_reduce/bytes": 5.0},
        {"rank": 1, "loss": 2.0, "lr": 0.1, "memory/params_bytes": 30, "comm/all_reduce/bytes": 5.0},
    ]
    p = wandb_payload(recs)
    assert p["loss"] == 2.0 and p["lr"] == 0.1
    assert p["memory/params_bytes/rank0"] == 10 and p["memory/params_bytes/rank1"] == 30
    assert p["memory/params_bytes/max"] == 30


def test_wandb_payload_has_no_series_for_collectives_never_issued():
    recs = [{"rank": r, "comm/all_reduce/count": 1.0, "comm/all_reduce/bytes": 8.0, "comm/all_gather/count": 0.0,
             "comm/all_gather/bytes": 0.0, "comm/send/count": float(r == 0), "comm/send/bytes": 4.0 * (r == 0),
             "comm/tp/all_gather/count": 0.0, "comm/tp/all_gather/time_s": 0.0} for r in range(2)]
    p = wandb_payload(recs)
    assert not any("all_gather" in k for k in p)  # issued by neither rank
    assert p["comm/all_reduce/bytes/max"] == 8.0
    assert p["comm/send/bytes/rank0"] == 4.0 and p["comm/send/bytes/rank1"] == 0.0  # one rank's sends: both kept


@pytest.mark.parametrize("micro", [2, 4])
def test_gradient_accumulation_trains_exactly_as_the_whole_batch(micro):
    """Accumulating global_batch / micro micro-batches (each loss divided by their number) takes the same steps
    as one batch of global_batch: the same losses and parameters within float tolerance."""
    from dist_train.config import ModelConfig, OptimizerConfig, PrecisionConfig
    from dist_train.contracts import Runtime
    from dist_train.model import build_model
    from dist_train.optim import OptimizerFactory
    from dist_train.strategies.base import StrategyContext
    from dist_train.strategies.registry import build_strategy, families

    def run(micro_batch: int) -> tuple[list[float], list[torch.Tensor]]:
        t = TrainConfig(global_batch_size=8, micro_batch_size=micro_batch, seq_len=32, steps=3, lr=0.1, grad_clip=0.0)
        # SGD: unlike Adam, its step is proportional to the gradient, so a mis-scaled accumulation shows
        sgd = OptimizerFactory(OptimizerConfig(name="sgd"), t)
        ctx = StrategyContext(runtime=Runtime(0, 0, 1, 1, torch.device("cpu"), None), train=t,
                              precision=PrecisionConfig("fp32"), optimizer=sgd)
        strategy = build_strategy(families()["single"].config("single"), ctx)
        strategy.setup(build_model(ModelConfig(), seed=0))
        batches = GlobalBatches(SyntheticDataset(vocab_size=256, seq_len=32, seed=0, noise=0.1),
                                global_batch_size=8, dp_rank=0, dp_size=1)
        losses = []
        for step in range(3):
            out = strategy.train_step(batches.local_batch(step))
            losses.append(float(out.loss_sum) / out.num_microbatches)
        return losses, [p.detach().clone() for p in strategy.model_state().params]

    whole, accumulated = run(8), run(micro)
    assert accumulated[0] == pytest.approx(whole[0], rel=1e-6)
    assert whole[0][2] != whole[0][0]  # the steps changed the model
    for a, b in zip(accumulated[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
