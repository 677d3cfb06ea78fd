"""Bus bandwidth as nccl-tests computes it, and the collectives telemetry knows by name (pure arithmetic)."""

from __future__ import annotations

COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv")


def busbw_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: what each link carries relative to the buffer size."""
    n = group_size
    if n <= 1:
        return 0.0 if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") else 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):  # all_to_all: a rank keeps 1/n of its buffer
        return (n - 1) / n
    return 1.0


def busbw_gbps(op: str, size_bytes: float, time_s: float, group_size: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes/s, as nccl-tests prints)."""
    if time_s <= 0:
        return 0.0
    return size_bytes / time_s * busbw_factor(op, group_size) / 1e9
