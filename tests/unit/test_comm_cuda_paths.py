"""The tracker's CUDA and pipeline paths, on CPU: fake CUDA streams, events and works stand in for NCCL's.

The fake CUDA API keeps what the real one guarantees and the tracker relies on: the current device and the
current stream are per thread (a thread that never called `set_device` is on cuda:0), `work.wait()` makes the
current stream of the work's device wait for the collective without blocking the host, and an event's GPU time
is when its stream reaches it. GPU time only moves when a test moves it, so every assertion is exact.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dist_train.telemetry.comm import CommTracker
from dist_train.telemetry.comm_analysis import peer_wait

RANK_DEVICE = 1  # this rank's GPU: not cuda:0, where a thread that never chose a device records


class FakeStream:
    def __init__(self, device: int, name: str) -> None:
        self.device, self.name, self.ready_ms = device, name, 0.0  # ready_ms: what it waits for ends then

    def __repr__(self) -> str:
        return f"<stream {self.name} cuda:{self.device}>"


class FakeCuda:
    """torch.cuda's streams, events and devices, as far as the tracker uses them."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.main = threading.get_ident()
        self.defaults = {d: FakeStream(d, "default") for d in range(4)}
        self._device: dict[int, int] = {self.main: RANK_DEVICE}  # the rank called set_device(1) on its thread
        self._current: dict[tuple[int, int], FakeStream] = {}
        self.events: list = []
        cuda = self

        class Event:  # torch.cuda.Event
            def __init__(self, enable_timing: bool = False) -> None:
                self.stream: FakeStream | None = None
                self.ms = None
                self.thread = None
                cuda.events.append(self)

            def record(self, stream: FakeStream | None = None) -> None:
                self.stream = stream if stream is not None else cuda.current_stream()
                self.thread = threading.get_ident()
                self.ms = max(cuda.now_ms, self.stream.ready_ms)

            def synchronize(self) -> None:
                pass

            def query(self) -> bool:
                return True

            def elapsed_time(self, end: "Event") -> float:
                assert self.stream.device == end.stream.device, "events of two devices have no common clock"
                return end.ms - self.ms

        self.Event = Event

    def current_device(self) -> int:
        return self._device.get(threading.get_ident(), 0)

    def current_stream(self, device=None) -> FakeStream:  # noqa: ANN001
        index = self.current_device() if device is None else _index(device)
        return self._current.get((threading.get_ident(), index), self.defaults[index])

    def Stream(self, device=None) -> FakeStream:  # noqa: ANN001, N802
        return FakeStream(self.current_device() if device is None else _index(device), "side")

    @contextlib.contextmanager
    def device(self, device):  # noqa: ANN001
        me, previous = threading.get_ident(), self.current_device()
        self._device[me] = _index(device)
        try:
            yield
        finally:
            self._device[me] = previous

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        key = (threading.get_ident(), stream.device)
        previous = self._current.get(key)
        self._current[key] = stream
        try:
            with self.device(stream.device):
                yield
        finally:
            if previous is None:
                del self._current[key]
            else:
                self._current[key] = previous


def _index(device) -> int:  # noqa: ANN001
    return device.index if isinstance(device, torch.device) else int(device)


class CudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on the rank's GPU, and remembers the streams it was recorded on."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", RANK_DEVICE)

    def record_stream(self, stream) -> None:  # noqa: ANN001
        self.__dict__.setdefault("recorded_on", []).append(stream)


def cuda_tensor(numel: int) -> CudaTensor:
    return torch.zeros(numel).as_subclass(CudaTensor)


class FakeWork:
    """NCCL's work: `wait()` makes the current stream of its device wait until it ends at `end_ms`.

    `get_future` is absent, as on NCCL's coalesced work; `future_raises` gives one that raises."""

    def __init__(self, cuda: FakeCuda, end_ms: float) -> None:
        self.cuda, self.end_ms, self.waits = cuda, end_ms, []

    def wait(self, timeout=None) -> bool:  # noqa: ANN001
        stream = self.cuda.current_stream(RANK_DEVICE)
        stream.ready_ms = max(stream.ready_ms, self.end_ms)
        self.waits.append((threading.get_ident(), stream))
        return True

    def is_completed(self) -> bool:
        return True


class FutureRaises(FakeWork):
    def get_future(self):  # noqa: ANN201
        raise RuntimeError("this work has no future")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("Event", "Stream", "current_stream", "current_device", "device", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A 2-rank world seen from rank 0, with no process group started."""
    w = SimpleNamespace(rank=0, size=2, ranks={None: [0, 1]})
    monkeypatch.setattr(dist, "get_rank", lambda group=None: w.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(w.ranks.get(group, w.ranks[None])))
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: w.ranks.get(group, w.ranks[None]))
    return w


@pytest.fixture
def patch_original(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Put a fake in place of a torch.distributed function, before a tracker wraps it."""

    def put(name: str, fn) -> None:  # noqa: ANN001
        fn.__name__ = name
        monkeypatch.setattr(c10d, name, fn)
        monkeypatch.setattr(dist, name, fn)

    return put


@contextlib.contextmanager
def installed(tracker: CommTracker):  # noqa: ANN201
    tracker.install()
    try:
        yield tracker
    finally:
        tracker.uninstall()


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):  # noqa: ANN001, ANN201
    raise AssertionError("never called: a P2POp only names it")


def irecv(tensor, src=None, group=None, tag=0, group_src=None):  # noqa: ANN001, ANN201
    raise AssertionError("never called: a P2POp only names it")


# ---------------------------------------------------------------- 1. 1F1B's coalesced work under NCCL
def test_a_coalesced_batch_is_timed_by_events_on_the_ranks_device_without_futures_or_threads(
    cuda, world, patch_original
):
    send, recv = cuda_tensor(8), cuda_tensor(8)
    ops = [SimpleNamespace(op=isend, tensor=send, group=None, peer=1),
           SimpleNamespace(op=irecv, tensor=recv, group=None, peer=1)]
    cuda.now_ms = 10.0
    work = FutureRaises(cuda, end_ms=25.0)  # NCCL: one work for the whole batch, and no future
    patch_original("batch_isend_irecv", lambda p2p_op_list: [work])

    with installed(CommTracker(cuda_events=True)) as tracker:
        works = dist.batch_isend_irecv(ops)
        assert works == [work]  # the caller's own work, not a stand-in a watcher thread finishes
        assert tracker._watchers is None and tracker._p2p_watchers is None
        # a side stream on the rank's device waited for the work, on the caller's thread; the caller's
        # stream did not
        [(thread, side)] = work.waits
        assert thread == cuda.main and side.device == RANK_DEVICE and side is not cuda.defaults[RANK_DEVICE]
        assert cuda.defaults[RANK_DEVICE].ready_ms == 0.0
        # tensors recorded on the side stream: NCCL's wait() there releases what it kept for the allocator
        assert send.recorded_on == [side] and recv.recorded_on == [side]
        starts, ends = [r.start_event for r in tracker._records], [r.end_event for r in tracker._records]
        assert all(e.stream is cuda.defaults[RANK_DEVICE] for e in starts)  # the caller's stream, at issue
        assert all(e.stream is side and e.thread == cuda.main for e in ends)
        cuda.now_ms = 40.0
        totals = tracker.drain()
    for op in ("send", "recv"):
        assert totals[op].count == 1 and totals[op].timed_bytes == 32
        assert totals[op].time_s == pytest.approx(0.015)  # 10 ms -> 25 ms on the GPU


def test_an_asynchronous_cuda_collective_is_ended_by_an_event_not_by_its_future(cuda, world, patch_original):
    calls = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        calls.append(async_op)
        return work

    class NoFuture(FakeWork):
        def get_future(self):  # noqa: ANN202
            raise AssertionError("a CUDA work is timed by events: its future (or its absence) is not used")

    work = NoFuture(cuda, end_ms=7.0)
    patch_original("all_reduce", all_reduce)
    with installed(CommTracker(cuda_events=True)) as tracker:
        assert dist.all_reduce(cuda_tensor(4), async_op=True) is work
        [rec] = tracker._records
        assert rec.end_event.stream.device == RANK_DEVICE and rec.end_event.thread == cuda.main
        assert tracker.drain()["all_reduce"].time_s == pytest.approx(0.007)
    assert calls == [True]


# ---------------------------------------------------------------- 2. blocking calls, and wait_s on CUDA
def test_a_blocking_cuda_collective_stays_blocking_and_is_bracketed_on_the_current_stream(
    cuda, world, patch_original
):
    asked = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        asked.append(async_op)
        if async_op:
            return FakeWork(cuda, end_ms=12.0)
        FakeWork(cuda, end_ms=12.0).wait()  # NCCL: the current stream waits, the host goes on
        return None

    patch_original("all_reduce", all_reduce)
    cuda.now_ms = 2.0
    with installed(CommTracker(cuda_events=True)) as tracker:
        assert dist.all_reduce(cuda_tensor(4)) is None
        [rec] = tracker._records
        assert rec.start_event.stream is rec.end_event.stream is cuda.defaults[RANK_DEVICE]
        assert tracker.drain()["all_reduce"].time_s == pytest.approx(0.010)
    assert asked == [False]  # issued as the caller asked, not forced asynchronous


def test_gloo_collectives_are_still_issued_asynchronously_and_waited_for(world, patch_original):
    """CPU tensors keep today's gloo path, cuda_events or not: forced async_op, waited on the caller's behalf."""
    asked, waited = [], []

    class GlooWork:
        def wait(self) -> bool:
            waited.append(True)
            return True

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        asked.append(async_op)
        return GlooWork()

    patch_original("all_reduce", all_reduce)
    for cuda_events in (False, True):
        with installed(CommTracker(cuda_events=cuda_events)) as tracker:
            assert dist.all_reduce(torch.zeros(4)) is None
            assert tracker._records[0].start_event is None and tracker._records[0].end_s is not None
    assert asked == [True, True] and waited == [True, True]


def test_cuda_calls_reach_peer_wait_on_the_host_clock(cuda, world, patch_original, monkeypatch):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001, ANN202
        FakeWork(cuda, end_ms=25.0).wait()
        return None

    patch_original("all_reduce", all_reduce)
    cuda.now_ms = 10.0  # the caller's stream reaches the all-reduce at 10 ms; it ends at 25 ms
    with installed(CommTracker(cuda_events=True)) as tracker:
        dist.all_reduce(cuda_tensor(4))
        cuda.now_ms = 40.0  # the window closes at GPU time 40 ms, host time 100 s
        with monkeypatch.context() as clock:
            clock.setattr(time, "perf_counter", lambda: 100.0)
            totals = tracker.drain()["all_reduce"]
    [(group, seq, nbytes, start, end)] = totals.calls
    assert (group, seq, nbytes) == ((0, 1), 0, 16)
    assert start == pytest.approx(100.0 - 0.030) and end == pytest.approx(100.0 - 0.015)
    # rank 1 (same host) reached it 5 ms later: 5 of rank 0's 15 ms were waiting, not transfer
    other = {"all_reduce": [((0, 1), 0, 16, start + 0.005, end)]}
    split = peer_wait({0: {"all_reduce": totals.calls}, 1: other}, {0: "a", 1: "a"})
    assert split[0]["all_reduce"].wait_s == pytest.approx(0.005)
    assert split[0]["all_reduce"].transfer_s == pytest.approx(0.010)


# ---------------------------------------------------------------- 3. pipelining's group_dst / group_src
@pytest.mark.parametrize("name", ["isend", "irecv", "send", "recv"])
def test_a_pipeline_peer_given_as_a_group_rank_is_classified_by_its_global_rank(
    name, world, patch_original, monkeypatch
):
    """Two nodes of 4 ranks; this rank (1) is in a pipeline group of global ranks [0, 1, 4, 5]."""
    group = object()
    world.rank, world.ranks = 1, {None: list(range(8)), group: [0, 1, 4, 5]}
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: world.ranks[g][r])
    key = "group_dst" if "send" in name else "group_src"

    def p2p(tensor, dst=None, group=None, tag=0, group_dst=None, src=None, group_src=None):  # noqa: ANN001, ANN202
        return None  # no work: nothing to time, only to classify

    patch_original(name, p2p)
    tracker = CommTracker(nodes=("a",) * 4 + ("b",) * 4)
    with installed(tracker):
        fn = getattr(dist, name)
        fn(torch.zeros(2), group=group, **{key: 0})  # global 0: node a, as this rank
        fn(torch.zeros(2), group=group, **{key: 2})  # global 4: node b (read as a global rank, 2 is on node a)
    assert [r.inter_node for r in tracker._records] == [False, True]
    assert tracker.drain()[name.lstrip("i")].inter_node_bytes == 8
