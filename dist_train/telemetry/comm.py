"""Count, size and time every collective a rank issues, without adding synchronisation.

How collectives are seen:
- FSDP2, DeepSpeed (`deepspeed.comm`'s torch backend), pipelining and our own code call the public
  functions of `torch.distributed`; :meth:`CommTracker.install` wraps them (in both `torch.distributed`
  and `torch.distributed.distributed_c10d`, whose deprecated aliases call the new names; a per-thread
  depth counter makes the outermost call the only one recorded).
- DDP's reducer all-reduces from C++; :meth:`CommTracker.ddp_comm_hook` is a comm hook that issues the
  same bucket all-reduce through the wrapped `dist.all_reduce` (what torch's default `allreduce_hook` does).

How they are timed: from issue to completion of the `Work`, never by making the training thread wait
longer than it would. Collectives on CUDA tensors are timed with CUDA events on the rank's own device, each
call issued as the caller asked (`telemetry/cuda_timing.py`). Gloo's CPU collectives are timed on the wall
clock, and every one of them is issued with `async_op=True`. A caller that asked for a blocking call still
gets one: we wait on its behalf exactly as torch would, and the call ended when that wait returned. For
asynchronous callers completion is taken from the work's future callback (wall clock on gloo's thread).
Gloo gives no future for reduce-scatter and point-to-point work: for an asynchronous caller a small pool of
watcher threads blocks in `work.wait()` (which releases the GIL) and stamps the time it returns. Gloo's
send/recv `wait()` may run only once (a second waiter hangs), so for those the caller gets a stand-in Work
that waits for the watcher instead.
Times include waiting for the slowest peer. nccl-tests time after a barrier, so bus bandwidth is computed
from the rest: when a logging window closes the ranks compare when each issued the same collective
(`peer_wait`), and the time before the group's last member issued it, or before this rank's previous
collective on the group finished, is reported as `wait_s`.

DTensor's functional collectives (`torch.distributed._functional_collectives`: tensor parallelism's
all-reduces, sequence parallelism's all-gathers and reduce-scatters, a DTensor gradient norm) are issued by a C++
op that keeps its Work from Python. Eager calls that record no autograd are issued from Python instead, as that
op does (`telemetry/funcol_issue.py`), and timed like any asynchronous collective: on the CPU only, where it is
tested (on CUDA, until a GPU has run it, they stay torch's own, untimed). The others (traced, recording
autograd, or a functional collective not handled there) are counted and sized but not timed: `OpTotals.untimed`
counts them, and the window's record then gives no time for that op (`comm_keys`), never a 0.

Sizes follow nccl-tests: the full buffer (all_gather: the gathered output; reduce_scatter: the input).

Bus bandwidth's arithmetic is telemetry/bandwidth.py; what a window's calls come to (the record's keys, the waits
for peers) is telemetry/comm_analysis.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from dist_train.telemetry.bandwidth import COMM_OPS, busbw_gbps
from dist_train.telemetry.cuda_timing import CudaTimer, cuda_device
from dist_train.telemetry.funcol_issue import ISSUERS, served_from_cache

def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sum_nbytes(ts: Any) -> int:
    return sum(_nbytes(t) for t in ts or ())


def _tensors(arguments: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a call was given, in lists too (all_gather's outputs, all_gather_coalesced's lists of them)."""
    found: list[torch.Tensor] = []
    for value in arguments.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            found.extend(t for t in (item if isinstance(item, (list, tuple)) else [item]) if isinstance(t, torch.Tensor))
    return found


# name in torch.distributed -> (op, size of the full buffer from the bound arguments)
_SIZERS: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _sum_nbytes(a["tensors"])),
    "all_gather": ("all_gather", lambda a: _sum_nbytes(a["tensor_list"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "_all_gather_base": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather_coalesced": ("all_gather", lambda a: sum(_sum_nbytes(x) for x in a["output_tensor_lists"])),
    "reduce_scatter": ("reduce_scatter", lambda a: _sum_nbytes(a["input_list"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    # expert parallelism's dispatch and combine (parallel/experts.py): the rows a rank sends, uneven splits included
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a["input"])),
    "broadcast": ("broadcast", lambda a: _nbytes(a["tensor"])),
    # DeepSpeed ZeRO-1/2 reduce each gradient slice to its owner with `reduce` when
    # zero_optimization.use_multi_rank_bucket_allreduce is false.
    "reduce": ("reduce", lambda a: _nbytes(a["tensor"])),
    "send": ("send", lambda a: _nbytes(a["tensor"])),
    "isend": ("send", lambda a: _nbytes(a["tensor"])),
    "recv": ("recv", lambda a: _nbytes(a["tensor"])),
    "irecv": ("recv", lambda a: _nbytes(a["tensor"])),
}

# functional collectives (DTensor): name -> (op, size of the full buffer from the bound arguments)
_FUNCOL_SIZERS: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["self"])),
    "all_gather_tensor": ("all_gather", lambda a: _nbytes(a["self"]) * _funcol_size(a["group"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["self"]) * _funcol_size(a["group"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["self"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["self"])),
    "broadcast": ("broadcast", lambda a: _nbytes(a["self"])),
}
# deprecated functional names that call the newer one (wrapped only where that one is missing: an older torch)
_FUNCOL_ALIASES = {"all_gather_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def _funcol_size(group: Any) -> int:
    return funcol._expand_group(group)[2]


@dataclass
class _Record:
    op: str
    nbytes: int
    group_size: int
    start_s: float
    inter_node: bool = False  # its process group (or, for send/recv, its peer) spans nodes
    dim: str | None = None  # the device-mesh dimension its group is (tp, dp), where the strategy named them
    # the ranks of its group and its place in that group's sequence of collectives: the same collective on
    # every member has the same (group, seq), which is how `peer_wait` matches them across ranks
    group: tuple[int, ...] | None = None
    seq: int = 0
    end_s: float | None = None
    device: Any = None  # a CUDA collective's device: timed by `start_event` / `end_event` (cuda_timing)
    start_event: Any = None
    end_event: Any = None
    done: bool = False
    # it ran but its completion cannot be known (a functional collective issued by torch's C++ op, a CUDA work
    # whose wait failed): counted and sized, never given a time (a record with no time and not untimed: nothing
    # ran, e.g. this rank is not in the group)
    untimed: bool = False

    def duration_s(self) -> float | None:
        if self.start_event is not None:
            if self.end_event is None:
                return None
            self.end_event.synchronize()  # only at window close, never in the step
            return self.start_event.elapsed_time(self.end_event) / 1e3
        return None if self.end_s is None else self.end_s - self.start_s


def _stamp(recs: list[_Record]) -> None:
    """Mark `recs` complete now, on the wall clock (CPU collectives; CUDA ones end with an event instead)."""
    end = time.perf_counter()
    for rec in recs:
        rec.end_s, rec.done = end, True


@dataclass
class OpTotals:
    count: int = 0
    bytes: int = 0
    time_s: float = 0.0
    timed_bytes: int = 0  # bytes of the ops whose completion time is known
    untimed: int = 0  # ops that ran with no completion time (`_Record.untimed`): time_s is then only a part
    group_size: int = 1
    inter_node_bytes: int = 0  # bytes of the ops whose group spans nodes
    # each timed op on the wall clock: (group ranks or None, seq, bytes, start_s, end_s), for `peer_wait`
    calls: list[tuple[tuple[int, ...] | None, int, int, float, float]] = field(default_factory=list)
    # per named mesh dimension: [count, bytes, time_s, untimed] of the ops over that dimension's group
    by_dim: dict[str, list[float]] = field(default_factory=dict)

    def add(self, rec: _Record, duration: float | None) -> None:
        self.count += 1
        self.bytes += rec.nbytes
        self.untimed += rec.untimed
        if rec.dim is not None:
            per = self.by_dim.setdefault(rec.dim, [0, 0, 0.0, 0])
            per[0] += 1
            per[1] += rec.nbytes
            per[2] += duration or 0.0
            per[3] += rec.untimed
        self.inter_node_bytes += rec.nbytes if rec.inter_node else 0
        self.group_size = max(self.group_size, rec.group_size)
        if duration is not None:
            self.time_s += duration
            self.timed_bytes += rec.nbytes
            # CUDA calls too: `drain` has put their GPU start on the host clock
            self.calls.append((rec.group, rec.seq, rec.nbytes, rec.start_s, rec.start_s + duration))

    def busbw_gbps(self, op: str) -> float:
        """Bus bandwidth of the timed ops of this window, nccl-tests conventions."""
        return busbw_gbps(op, self.timed_bytes, self.time_s, self.group_size)


@dataclass
class CommTracker:
    """Patches torch.distributed while installed; `drain()` hands back what completed since the last drain."""

    cuda_events: bool = False
    _records: list[_Record] = field(default_factory=list)
    _originals: dict[tuple[Any, str], Any] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)
    _paused: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watchers: ThreadPoolExecutor | None = None
    _p2p_watchers: ThreadPoolExecutor | None = None
    _ignored_groups: list[Any] = field(default_factory=list)
    # Every rank's node, by global rank; with more than one node, each collective is classified as intra- or
    # inter-node from the ranks its process group holds (for send/recv: from its peer).
    nodes: tuple[str, ...] = ()
    # ranks of a group -> the mesh dimension it is (see `name_groups`)
    _dims: dict[frozenset[int], str] = field(default_factory=dict)
    _ep: frozenset[int] | None = None  # the expert-parallel group's ranks (its all-to-alls are comm/ep/...)
    _group_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # group id -> its ranks, cached
    _seq: dict[tuple[int, ...], int] = field(default_factory=dict)  # group ranks -> collectives issued on it
    _cuda: CudaTimer = field(default_factory=CudaTimer)

    def name_groups(self, groups: dict[str, list[int]]) -> None:
        """Name this rank's process groups by mesh dimension ({"tp": [0, 1], "dp_shard": [0, 2]}): their collectives
        are then also counted under `comm/<name>/<op>/...`."""
        self._dims.update({frozenset(ranks): name for name, ranks in groups.items() if name != "ep"})
        # expert parallelism's group may hold the same ranks as a data-parallel one (fsdp_ep with ep = world): its
        # all-to-alls are named by it, the rest by the other
        self._ep = frozenset(groups["ep"]) if "ep" in groups else None
        if self._ep is not None:
            self._dims.setdefault(self._ep, "ep")

    def _dim(self, group: Any = None, *, ranks: Any = None, op: str = "") -> str | None:
        if not self._dims:
            return None
        members = frozenset(self._members(group, ranks=ranks))
        if op == "all_to_all" and members == self._ep:
            return "ep"
        return self._dims.get(members)

    @property
    def multi_node(self) -> bool:
        return len(set(self.nodes)) > 1

    def _spans_nodes(self, group: Any = None, *, ranks: Any = None, peer: Any = None) -> bool:
        if not self.multi_node:
            return False
        if peer is not None:
            return self.nodes[int(peer)] != self.nodes[dist.get_rank()]
        return len({self.nodes[r] for r in self._members(group, ranks=ranks)}) > 1

    def _peer(self, arguments: dict[str, Any]) -> int | None:
        """The global rank a send/recv talks to: `dst` / `src`, or `group_dst` / `group_src` (what pipelining
        passes) translated through its group. None when it is not needed (one node) or not known (any source)."""
        if not self.multi_node:
            return None
        for key in ("dst", "src"):
            if arguments.get(key) is not None:
                return int(arguments[key])
        for key in ("group_dst", "group_src"):
            if arguments.get(key) is not None:
                group = arguments.get("group")
                return dist.get_global_rank(group if group is not None else dist.group.WORLD, arguments[key])
        return None

    # ---------------------------------------------------------------- install / uninstall
    def install(self) -> "CommTracker":
        for name, (op, sizer) in _SIZERS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue  # an older torch without this name
            wrapped = self._wrap(original, op, sizer)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._originals[(module, name)] = original
                    setattr(module, name, wrapped)
        original_batch = c10d.batch_isend_irecv
        wrapped_batch = self._wrap_batch_p2p(original_batch)
        for module in (dist, c10d):
            if getattr(module, "batch_isend_irecv", None) is original_batch:
                self._originals[(module, "batch_isend_irecv")] = original_batch
                setattr(module, "batch_isend_irecv", wrapped_batch)
        for name, (op, sizer) in _FUNCOL_SIZERS.items():
            original = getattr(funcol, name, None)
            if original is not None and not hasattr(funcol, _FUNCOL_ALIASES.get(name, "")):
                self._originals[(funcol, name)] = original
                setattr(funcol, name, self._wrap_funcol(original, op, sizer, ISSUERS.get(name)))
        return self

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """torch.distributed as it was, for a while (code that is not the training's: a benchmark's reference
        loop in the same process); the wrappers come back afterwards."""
        wrapped = {key: getattr(key[0], key[1]) for key in self._originals}
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        try:
            yield
        finally:
            for (module, name), wrapper in wrapped.items():
                setattr(module, name, wrapper)

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()
        if self._watchers is not None:
            self._watchers.shutdown(wait=True)
            self._watchers = None
        if self._p2p_watchers is not None:
            self._p2p_watchers.shutdown(wait=True)
            self._p2p_watchers = None

    def ignore_group(self, group: Any) -> None:
        """Collectives on `group` are never recorded (a checkpoint writer's, from its own thread)."""
        self._ignored_groups.append(group)

    def _ignored(self, group: Any) -> bool:
        return group is not None and any(group is g for g in self._ignored_groups)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Telemetry's own collectives (gathering metrics to rank 0) are not the training's."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    # ---------------------------------------------------------------- DDP
    def ddp_comm_hook(self, process_group, bucket):  # type: ignore[no-untyped-def]
        """torch's default all-reduce hook, issued through the wrapped `dist.all_reduce` so it is seen.

        (No annotations: DDP compares them with dist.GradBucket / Future, and this module's are strings.)
        The all-reduce is in place, so the future resolves to the bucket's own buffer (torch's hook returns the
        work's result, which the dry run's fake process group leaves empty); reading the result still raises
        when the all-reduce failed (a timed-out or aborted peer), so the step fails with it.
        """
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size(group))
        work = dist.all_reduce(tensor, group=group, async_op=True)

        def reduced(fut: Any) -> Any:
            fut.value()  # raises the collective's error
            return tensor

        return work.get_future().then(reduced)

    # ---------------------------------------------------------------- recording
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        self._local.depth = self._depth() + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _should_record(self) -> bool:
        return not self._paused and self._depth() == 0

    def _new_record(
        self, op: str, nbytes: int, group: Any, size: int | None = None, *, ranks: Any = None, peer: Any = None,
        device: Any = None,
    ) -> _Record:
        if size is None:
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        inter = self._spans_nodes(group, ranks=ranks, peer=peer)
        # send/recv too: over a pipeline's group (pp_dp) they are its traffic
        dim = self._dim(group, ranks=ranks, op=op)
        # send/recv pair two ranks, not a group: they take no place in the group's sequence of collectives
        members = self._members(group, ranks=ranks) if op not in ("send", "recv") else None
        rec = _Record(op=op, nbytes=nbytes, group_size=size, start_s=time.perf_counter(), inter_node=inter, dim=dim,
                      group=members)
        if device is not None:  # before the call is issued: its stream waits for this point
            rec.device, rec.start_event = device, self._cuda.start(device)
        with self._lock:
            if members is not None:
                rec.seq = self._seq.get(members, 0)
                self._seq[members] = rec.seq + 1
            self._records.append(rec)
        return rec

    def _members(self, group: Any = None, *, ranks: Any = None) -> tuple[int, ...]:
        """The global ranks of `group` (None: the world), or of `ranks` (a functional collective's), sorted."""
        if ranks is not None:
            return tuple(sorted(int(r) for r in ranks))
        key = id(group)
        if key not in self._group_ranks:
            members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self._group_ranks[key] = tuple(sorted(members))
        return self._group_ranks[key]

    def _device(self, tensors: list[Any]) -> Any:
        """The CUDA device a call's tensors live on, when CUDA events time it; None: timed the gloo way."""
        return cuda_device(tensors) if self.cuda_events else None

    def _issue_on_cuda(self, rec: _Record, call: Callable[[], Any], *, blocking: bool, tensors: list[Any]) -> Any:
        """Issue a CUDA collective as the caller asked (no `async_op` forced) and bracket it with events."""
        with self._nested():
            result = call()
        if blocking:  # its stream already waits for it (NCCL); the host did not
            rec.end_event = self._cuda.end_now(rec.device)
        elif result is not None:  # None: this rank is not in the group, nothing ran
            rec.end_event = self._cuda.end_after(result, rec.device, tensors)
            rec.untimed = rec.end_event is None
        rec.done = True
        return result

    def _on_complete(self, recs: list[_Record], work: Any) -> Any:
        """Stamp completion from the work's future; never waits. Returns the work to hand to the caller."""
        if work is None:  # e.g. this rank is not in the group: nothing ran, nothing to time
            for rec in recs:
                rec.done = True
            return work
        try:
            fut = work.get_future()
        except (RuntimeError, AttributeError):
            fut = None
        if fut is None:  # gloo's reduce-scatter and p2p: a watcher thread waits instead of us
            if all(rec.op in ("send", "recv") for rec in recs):
                return self._watch_p2p(recs, work)
            self._watch(recs, work)
            return work

        fut.then(lambda _fut: _stamp(recs))
        return work

    def _watch(self, recs: list[_Record], work: Any) -> None:
        if self._watchers is None:
            self._watchers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dist_train-comm-watch")

        def wait_and_stamp() -> None:
            try:
                work.wait()  # releases the GIL; the training thread is not held
            except Exception:  # the training thread sees the failure itself when it waits
                pass
            _stamp(recs)

        self._watchers.submit(wait_and_stamp)

    def _watch_p2p(self, recs: list[_Record], work: Any) -> "_WatchedWork":
        """Gloo send/recv: the watcher is the only thread that waits on the work; the caller gets a stand-in.

        Gloo's point-to-point `wait()` consumes the completion (its buffer counts completions down), so a
        second waiter blocks forever. Each of these waits gets its own pool thread (the pool grows instead
        of queueing: a queued watch would hold up the caller waiting on its stand-in).
        """
        if self._p2p_watchers is None:
            self._p2p_watchers = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="dist_train-p2p-watch")
        proxy = _WatchedWork(work)

        def wait_and_stamp() -> None:
            error = None
            try:
                work.wait()  # releases the GIL; the training thread is not held
            except Exception as exc:  # handed to the caller when it waits on the stand-in
                error = exc
            _stamp(recs)
            proxy._finish(error)

        self._p2p_watchers.submit(wait_and_stamp)
        return proxy

    def _wrap_funcol(self, original: Callable, op: str, sizer: Callable[[dict[str, Any]], int],
                     issuer: Callable | None) -> Callable:
        """A functional collective: issued from Python by `issuer` (funcol_issue.py) and timed where it can be,
        else by torch's own op, counted and sized but untimed (its completion is a `wait_tensor` we cannot see).
        Not counted where selective checkpointing's recomputation hands back the output it kept: nothing is sent."""
        sig = inspect.signature(original)
        name = original.__name__

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._should_record() or served_from_cache(name):
                return original(*args, **kwargs)
            arguments = sig.bind(*args, **kwargs).arguments
            _, ranks, size = funcol._expand_group(arguments["group"])
            nbytes = sizer(arguments)
            if issuer is not None and _on_cpu(arguments.get("self")):
                issued = self._issue_funcol(issuer, arguments, op=op, nbytes=nbytes, size=size, ranks=ranks)
                if issued is not None:
                    return issued
            rec = self._new_record(op, nbytes, None, size=size, ranks=ranks)
            rec.done = rec.untimed = True
            with self._nested():
                return original(*args, **kwargs)

        return wrapper

    def _issue_funcol(self, issuer: Callable, arguments: dict[str, Any], *, op: str, nbytes: int, size: int,
                      ranks: Any) -> Any:
        """Run `issuer`; the record starts when it issues the collective (after any copy it makes first) and ends
        as any asynchronous collective's does. None: the issuer declined (nothing issued)."""
        started: list[_Record] = []

        def issue(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            started.append(self._new_record(op, nbytes, None, size=size, ranks=ranks, device=self._device(tensors)))
            with self._nested():
                return fn(*args, **kwargs)

        try:
            issued = issuer(issue, arguments)
        except BaseException:
            for rec in started:
                rec.done = rec.untimed = True
            raise
        if issued is None:
            return None
        result, work, buffers = issued
        rec = started[0]
        if work is None:  # this rank is not in the group: nothing ran
            rec.done = True
        elif rec.device is not None:
            rec.end_event = self._cuda.end_after(work, rec.device, buffers)
            rec.done, rec.untimed = True, rec.end_event is None
        else:
            self._on_complete([rec], work)
        return result

    def _wrap(self, original: Callable, op: str, sizer: Callable[[dict[str, Any]], int]) -> Callable:
        sig = inspect.signature(original)
        takes_async = "async_op" in sig.parameters

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._should_record():
                return original(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            arguments = bound.arguments
            if self._ignored(arguments.get("group")):
                return original(*args, **kwargs)
            peer = self._peer(arguments) if op in ("send", "recv") else None
            tensors = _tensors(arguments) if self.cuda_events else []
            device = self._device(tensors)
            rec = self._new_record(op, sizer(arguments), arguments.get("group"), peer=peer, device=device)
            if device is not None:
                blocking = name_blocks(original) if not takes_async else not arguments.get("async_op", False)
                return self._issue_on_cuda(rec, lambda: original(*args, **kwargs), blocking=blocking,
                                           tensors=tensors)
            if not takes_async:  # send / recv block; isend / irecv return work
                with self._nested():
                    result = original(*args, **kwargs)
                if name_blocks(original):
                    _stamp([rec])
                else:
                    result = self._on_complete([rec], result)
                return result
            wanted_async = arguments.get("async_op", False)
            arguments["async_op"] = True
            with self._nested():
                work = original(*bound.args, **bound.kwargs)
            if not wanted_async:
                # A blocking call: we wait on the caller's behalf, as torch would, and it ended when the wait
                # returned (on CUDA: an event after the stream waits for it). No watcher thread, whose stamp
                # would wait for the GIL behind the training thread (measured: +30% on gloo reduce-scatter).
                if work is not None:
                    work.wait()
                _stamp([rec])
                return None
            return self._on_complete([rec], work)  # may be a stand-in the caller must wait on instead

        return wrapper

    def _wrap_batch_p2p(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(p2p_op_list: list) -> list:
            if not self._should_record():
                return original(p2p_op_list)
            tensors = [p2p.tensor for p2p in p2p_op_list]
            device = self._device(tensors)
            recs = []
            for p2p in p2p_op_list:  # `P2POp.peer` is a global rank
                op = "send" if getattr(p2p.op, "__name__", "") in ("isend", "send") else "recv"
                recs.append(self._new_record(op, _nbytes(p2p.tensor), p2p.group, peer=p2p.peer, device=device))
            with self._nested():
                works = original(p2p_op_list)
            if device is not None:
                return self._batch_on_cuda(recs, works, tensors)
            if works and len(works) == len(recs):
                works = [self._on_complete([rec], work) for rec, work in zip(recs, works)]
            elif works:
                works[-1] = self._on_complete(recs, works[-1])
            else:
                for rec in recs:
                    rec.done = True
            return works

        return wrapper

    def _batch_on_cuda(self, recs: list[_Record], works: list, tensors: list[Any]) -> list:
        """One work per op, or NCCL's one coalesced work for the whole batch (no future): ended by events."""
        if works and len(works) == len(recs):
            for rec, work, tensor in zip(recs, works, tensors):
                rec.end_event = self._cuda.end_after(work, rec.device, [tensor])
                rec.untimed = rec.end_event is None
        elif works:
            end = self._cuda.end_after(works[-1], recs[0].device, tensors)
            for rec in recs:
                rec.end_event, rec.untimed = end, end is None
        for rec in recs:
            rec.done = True
        return works

    # ---------------------------------------------------------------- reading
    def drain(self) -> dict[str, OpTotals]:
        """Totals per op of the records completed since the last drain; pending ones stay for the next."""
        with self._lock:
            records, self._records = self._records, []
        totals = {op: OpTotals() for op in COMM_OPS}
        pending, done = [], []
        for rec in records:
            if not rec.done:
                pending.append(rec)
                continue
            done.append(rec)
        on_gpu = [rec for rec in done if rec.end_event is not None]
        if on_gpu:  # their GPU start on the host clock, comparable across the ranks of a host (`peer_wait`)
            starts = self._cuda.host_starts([(rec.device, rec.start_event, rec.end_event) for rec in on_gpu])
            for rec, start_s in zip(on_gpu, starts):
                rec.start_s = start_s
        for rec in done:
            totals[rec.op].add(rec, rec.duration_s())
        with self._lock:
            self._records[:0] = pending
        return totals


def _on_cpu(tensor: Any) -> bool:
    """Whether a functional collective's input lives on the CPU: only there is it issued from Python (gloo, where
    tensor parallelism's losses are tested equal to one process's). On CUDA torch's own op runs it, untimed, until a
    GPU has shown the Python issue on NCCL gives the same training (docs/GPU.md)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"


class _WatchedWork:
    """Stands in for a gloo send/recv Work that a watcher thread waits on (see `CommTracker._watch_p2p`)."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._done.wait(seconds or None):  # None / 0: no limit of our own (gloo's applies)
            raise RuntimeError(f"point-to-point work did not complete within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def __getattr__(self, name: str) -> Any:  # source_rank(), result(), ... of the real work
        return getattr(self._work, name)


def name_blocks(fn: Callable) -> bool:
    return getattr(fn, "__name__", "") in ("send", "recv")
