"""A simulated CUDA device on the CPU, for ordering tests of the asynchronous offload path.

`FakeCuda` is the ops object of `Platform.simulated("cuda", FakeCuda())`: the platform keeps CUDA's facts
(asynchronous copies, prefetch 1), its tensors live on the CPU, and

* streams and events behave like CUDA's: work on one stream is ordered; between streams (and the host) only by
  `event.record` + `stream.wait_event` / `event.synchronize` / `stream.synchronize`;
* a non-blocking copy on a side stream is *deferred*: its bytes land (and its source is read) only when its stream
  is drained — an event recorded after it is waited on or synchronised, or the stream synchronised. Reading a slot
  before the wait gives stale bytes, and refilling a source before the copy ran changes what it copies. The
  compute stream runs its work (the model's eager ops, its own copies) as it is issued;
* `empty` is a caching allocator: a block nobody references any more is handed out again (with its history);
* a race detector: every access to a tracked buffer (slots and other `empty` blocks, page-locked host buffers) is
  recorded with the agent that made it (a stream, or the host) and that agent's vector clock. Two accesses to one
  buffer, at least one a write, that no chain of record/wait orders are a race (`races`, `assert_no_races`).

Compute-stream accesses are seen by `watch()`, a TorchDispatchMode that attributes every aten op's tensor
arguments (reads; writes where the schema says so; views are not accesses) to the current stream. Host writes of
the staging reader are recorded by `watch_store`. The host is one agent for all its threads: Python's own
synchronisation (futures, locks) orders them, and only device ordering is checked. Issuing work orders it after
what the host did before (as CUDA does).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h3_core.runtime.platform import Platform, _HostOps

HOST = "host"


def _join(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class FakeStream:
    def __init__(self, fake: "FakeCuda", name: str):
        self.fake, self.name = fake, name
        self.clock = {name: 0}
        self.pending: list = []  # deferred copies: (tick, dst, src)

    def wait_event(self, event: "FakeEvent") -> None:
        with self.fake.lock:
            if event.stream is None:
                return  # never recorded: nothing to wait for (as CUDA)
            self.fake.drain(event.stream, event.tick)  # the copies this stream may now see have landed
            self.clock = _join(self.clock, event.clock)

    def synchronize(self) -> None:
        with self.fake.lock:
            self.fake.drain(self, None)
            self.fake.host = _join(self.fake.host, self.clock)

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, fake: "FakeCuda"):
        self.fake = fake
        self.stream: FakeStream | None = None
        self.tick = 0
        self.clock: dict = {}

    def record(self, stream: FakeStream | None = None) -> None:
        with self.fake.lock:
            stream = stream if stream is not None else self.fake.current_stream()
            self.fake.issue(stream)
            self.stream, self.tick, self.clock = stream, stream.clock[stream.name], dict(stream.clock)

    def synchronize(self) -> None:
        with self.fake.lock:
            if self.stream is not None:
                self.fake.drain(self.stream, self.tick)
                self.fake.host = _join(self.fake.host, self.clock)

    def query(self) -> bool:
        with self.fake.lock:
            return self.stream is None or not any(t <= self.tick for t, _, _ in self.stream.pending)


class _Buffer:
    """The access history of one tracked buffer (FastTrack style: the last write, the latest read of each agent)."""

    def __init__(self, name: str):
        self.name = name
        self.last_write: tuple | None = None  # (agent, tick, what)
        self.reads: dict = {}  # agent -> (tick, what), since the last write


class FakePinner:
    """Page-locks nothing; tracks the registered host buffers and checks none is unpinned under a pending copy."""

    def __init__(self, fake: "FakeCuda"):
        self.fake = fake
        self.pinned: set[int] = set()  # storage data_ptr of every buffer registered and not unregistered

    def register(self, buffer: torch.Tensor) -> bool:
        self.fake.track(buffer, "pinned host buffer")
        self.pinned.add(buffer.untyped_storage().data_ptr())
        return True

    def unregister(self, buffer: torch.Tensor) -> bool:
        with self.fake.lock:
            # Unpinning is a host write as far as a DMA reading the pages is concerned.
            self.fake.access(HOST, buffer, write=True, what="unpin")
            # Then the pages are no longer a pinned buffer's: memory allocated later at the same address (an
            # activation, a pageable buffer) must not inherit this buffer's history (a false race).
            self.fake.buffers.pop(buffer.untyped_storage().data_ptr(), None)
            self.pinned.discard(buffer.untyped_storage().data_ptr())
        return True


class FakeCuda(_HostOps):
    """See the module docstring."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.lock = threading.RLock()
        self.host = {HOST: 0}
        self.compute = FakeStream(self, "compute")
        self.streams = [self.compute]
        self._stack = [self.compute]
        self.buffers: dict[int, _Buffer] = {}  # storage data_ptr -> history
        self.pool: list[torch.Tensor] = []  # every block the allocator made (reused once unreferenced)
        self.races: list[str] = []
        self.copies = 0
        self._applying = False
        self.pinner = FakePinner(self)

    def platform(self) -> Platform:
        return Platform.simulated("cuda", self)

    # ---- streams ----------------------------------------------------------------------------------------------

    def new_stream(self):
        stream = FakeStream(self, f"stream{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self):
        return self._stack[-1]

    @contextlib.contextmanager
    def on_stream(self, stream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def new_event(self):
        return FakeEvent(self)

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()

    def host_pinner(self):
        return self.pinner

    def name(self) -> str:
        return "fake CUDA"

    # ---- ordering ---------------------------------------------------------------------------------------------

    def issue(self, stream: FakeStream) -> None:
        """Work issued by the host on `stream` is after what the host did before; the stream ticks."""
        stream.clock = _join(stream.clock, self.host)
        stream.clock[stream.name] += 1

    def drain(self, stream: FakeStream, upto: int | None) -> None:
        """Run `stream`'s deferred copies issued at or before tick `upto` (None: all)."""
        keep = []
        for tick, dst, src in stream.pending:
            if upto is None or tick <= upto:
                self._apply(dst, src)
            else:
                keep.append((tick, dst, src))
        stream.pending = keep

    def _apply(self, dst, src):
        self._applying = True
        try:
            dst.copy_(src)
        finally:
            self._applying = False

    def _ordered(self, clock: dict, agent: str, tick: int) -> bool:
        return clock.get(agent, 0) >= tick

    def track(self, tensor: torch.Tensor, name: str) -> None:
        with self.lock:
            key = tensor.untyped_storage().data_ptr()
            if key not in self.buffers:
                self.buffers[key] = _Buffer(f"{name} #{len(self.buffers)}")

    def access(self, agent, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        """Record one access by `agent` (a FakeStream or HOST) and report any unordered earlier conflicting one."""
        buffer = self.buffers.get(tensor.untyped_storage().data_ptr())
        if buffer is None:
            return
        if agent == HOST:
            self.host[HOST] += 1
            name, clock, tick = HOST, self.host, self.host[HOST]
        else:
            name, clock, tick = agent.name, agent.clock, agent.clock[agent.name]
        earlier = [] if buffer.last_write is None else [("write",) + buffer.last_write]
        if write:
            earlier += [("read", a, t, w) for a, (t, w) in buffer.reads.items()]
        for kind, a, t, w in earlier:
            if a != name and not self._ordered(clock, a, t):
                self.races.append(f"{buffer.name}: {'write' if write else 'read'} by {name} ({what}) is not ordered "
                                  f"after the {kind} by {a} ({w})")
        if write:
            buffer.last_write, buffer.reads = (name, tick, what), {}
        else:
            buffer.reads[name] = (tick, what)

    # ---- memory and copies ------------------------------------------------------------------------------------

    def empty(self, nbytes: int) -> torch.Tensor:
        """A caching allocator: the smallest unreferenced block that fits, else a new one (tracked)."""
        with self.lock:
            free = [b for b in self.pool if b.numel() >= nbytes
                    and torch._C._storage_Use_Count(b.untyped_storage()._cdata) <= 2]  # the pool's and this call's
            if free:
                return min(free, key=torch.Tensor.numel)[:nbytes]
            block = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.pool.append(block)
            self.track(block, "device block")
            return block[:nbytes]

    def copy_to_device(self, dst, src, non_blocking=False) -> None:
        with self.lock:
            stream = self.current_stream()
            self.issue(stream)
            self.copies += 1
            self.access(stream, src, write=False, what="copy source")
            self.access(stream, dst, write=True, what="copy")
            if non_blocking and stream is not self.compute:
                stream.pending.append((stream.clock[stream.name], dst, src))
            elif non_blocking:  # the compute stream runs its work as it is issued: later kernels see the bytes
                self._apply(dst, src)
            else:  # a blocking copy: the stream's earlier work, then this copy, then the host goes on
                self.drain(stream, None)
                self._apply(dst, src)
                self.host = _join(self.host, stream.clock)

    # ---- instrumentation --------------------------------------------------------------------------------------

    def watch(self) -> "_Watch":
        """A context in which every aten op of this thread is an access by the current stream."""
        return _Watch(self)

    def watch_store(self, store) -> None:
        """Record the staging reader's fills of its buffers as host writes."""
        fill = store._fill

        def recorded_fill(unit, buffer):
            with self.lock:
                self.access(HOST, buffer, write=True, what=f"read of unit {unit}")
            fill(unit, buffer)

        store._fill = recorded_fill

    def assert_no_races(self) -> None:
        assert not self.races, f"{len(self.races)} unordered access(es):\n" + "\n".join(self.races[:10])


class _Watch(TorchDispatchMode):
    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake = self.fake
        with fake.lock:  # (a copy being applied, on any thread, holds it: its own copy_ is not an access)
            if not fake._applying:
                stream = fake.current_stream()
                touched = False
                for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                             func._schema.arguments[len(args):]]):
                    alias = arg.alias_info
                    if alias is not None and not alias.is_write:
                        continue  # a view: no bytes are touched
                    for t in value if isinstance(value, (list, tuple)) else (value,):
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in fake.buffers:
                            if not touched:
                                fake.issue(stream)
                                touched = True
                            write = alias is not None and alias.is_write
                            fake.access(stream, t, write=write, what=str(func.overloadpacket.__name__))
        return func(*args, **kwargs)
