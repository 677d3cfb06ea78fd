"""What a window's collectives come to, read from the CommTracker's totals and calls: the per-step keys of a record
(`comm_keys`), the time spent waiting for peers apart from the transfer itself (`peer_wait`), and the total."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dist_train.telemetry.bandwidth import COMM_OPS

if TYPE_CHECKING:
    from dist_train.telemetry.comm import OpTotals


def comm_keys(totals: dict[str, OpTotals], num_steps: int, *, multi_node: bool = False) -> dict[str, float]:
    """A window's collectives per step, as its record names them: `comm/<op>/{count,bytes,time_s,busbw_gbps}`,
    `comm/<dim>/<op>/...` per named mesh dimension, and on several nodes `comm/<op>/inter_node_bytes`.

    An op with calls whose completion is unknown (`OpTotals.untimed`) gets `comm/<op>/untimed_count` and no
    `time_s` (the timed part alone would read as the whole); its bus bandwidth, of the timed calls, only where
    some were timed. `comm/untimed_count` sums them over ops (absent when every call was timed).
    """
    n = num_steps
    out: dict[str, float] = {}
    untimed = 0
    for op, t in totals.items():
        out[f"comm/{op}/count"] = t.count / n
        out[f"comm/{op}/bytes"] = t.bytes / n
        if t.untimed:
            out[f"comm/{op}/untimed_count"] = t.untimed / n
            untimed += t.untimed
        else:
            out[f"comm/{op}/time_s"] = t.time_s / n
        if t.timed_bytes or not t.untimed:  # until the recorder takes out the waits for peers
            out[f"comm/{op}/busbw_gbps"] = t.busbw_gbps(op)
        if multi_node:  # of those bytes, the ones whose group spans nodes
            out[f"comm/{op}/inter_node_bytes"] = t.inter_node_bytes / n
        for dim, (count, nbytes, time_s, dim_untimed) in t.by_dim.items():  # the same ops, by mesh dimension
            out[f"comm/{dim}/{op}/count"] = count / n
            out[f"comm/{dim}/{op}/bytes"] = nbytes / n
            if dim_untimed:
                out[f"comm/{dim}/{op}/untimed_count"] = dim_untimed / n
            else:
                out[f"comm/{dim}/{op}/time_s"] = time_s / n
    if untimed:
        out["comm/untimed_count"] = untimed / n
    return out


def total_comm_s(rec: dict[str, Any]) -> float | None:
    """Collective time per step over every op of a record; None where some collective was not timed."""
    if rec.get("comm/untimed_count"):
        return None
    return sum(rec.get(f"comm/{op}/time_s", 0.0) for op in COMM_OPS)


Call = tuple[tuple[int, ...] | None, int, int, float, float]  # group ranks, seq, bytes, start_s, end_s


@dataclass
class Transfer:
    """One op's figures on one rank over a window, with the time spent waiting for peers taken out."""

    wait_s: float = 0.0  # from this rank's issue until the last member of the group had issued the same call
    transfer_s: float = 0.0  # the rest: the collective moving data, every member present
    timed_bytes: int = 0


def peer_wait(calls_by_rank: dict[int, dict[str, list[Call]]], node_of: dict[int, Any]) -> dict[int, dict[str, Transfer]]:
    """Split each rank's collective time into waiting and the transfer itself.

    A collective cannot start before every member has issued it, nor, on this rank, before the group's
    previous collective has finished (a backend runs a group's collectives in order; FSDP issues the next
    all-gather early, to prefetch). Time before both is the peers' lateness (uneven compute, a straggler)
    or the queue, not the network. nccl-tests measure after a barrier, one collective at a time, so only
    the transfer compares with them: bus bandwidth is bytes over transfer time.

    The same call is matched on every member by (group ranks, seq). Issue times are compared only where
    all members share a host (`time.perf_counter` is one monotonic clock per machine) and all of them
    completed the call in this window; anywhere else the whole time counts as transfer.
    """
    issued: dict[tuple[tuple[int, ...], int], list[float]] = {}
    for calls in calls_by_rank.values():
        for op_calls in calls.values():
            for group, seq, _, start, _ in op_calls:
                if group is not None:
                    issued.setdefault((group, seq), []).append(start)
    out: dict[int, dict[str, Transfer]] = {}
    for rank, calls in calls_by_rank.items():
        per_op = out.setdefault(rank, {op: Transfer() for op in calls})
        ordered = sorted(
            ((group, seq, op, nbytes, start, end) for op, op_calls in calls.items()
             for group, seq, nbytes, start, end in op_calls),
            key=lambda c: (c[0] is not None, c[0] or (), c[1]),
        )
        previous_end: dict[tuple[int, ...], tuple[int, float]] = {}  # group -> (seq, end) of its last call
        for group, seq, op, nbytes, start, end in ordered:
            ready = start
            if group is not None:
                starts = issued.get((group, seq), [])
                if len({node_of.get(r) for r in group}) == 1 and len(starts) == len(group):
                    ready = max(ready, *starts)
                prev = previous_end.get(group)
                if prev is not None and prev[0] == seq - 1:
                    ready = max(ready, prev[1])
                previous_end[group] = (seq, end)
            t = per_op[op]
            wait = min(max(ready - start, 0.0), end - start)
            t.wait_s += wait
            t.transfer_s += end - start - wait
            t.timed_bytes += nbytes
    return out
