"""Bringing a request's full KV from the host tier to the device tier, layer by layer.

``Transfer`` exposes one event per layer, so verification of layer i can start while layer
i+1 is still in flight (``StreamedKV`` waits per layer). Two links:
- ``EmulatedLink`` (CPU, here and in CI): a copier thread moves the real bytes and paces itself
  to a configured bandwidth and latency, so overlap is real and measurable. Figures obtained
  with it are *emulated*.
- ``CudaLink``: pinned host memory, a copy stream and one CUDA event per layer.
Both count bytes moved and busy seconds (for utilisation and metrics).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart
from vericache.kv.protocol import KVCache


@dataclass
class Transfer:
    """Layers ``first_layer``.. of ``src`` moving into layers 0.. of ``dst``; events count dst layers."""
    src: FullKVCache
    length: int                      # positions to move
    dst: FullKVCache                 # the device-side buffer
    first_layer: int = 0             # layers before it stay on the device (resident) and do not move
    layer_ready: list[threading.Event] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cuda_events: list[torch.cuda.Event] | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    cancelled: bool = False
    error: str | None = None        # the copy failed: every event is set so no one waits forever

    def cancel(self) -> None:
        """The request is gone: the copier skips this transfer if it has not started it (a CUDA
        buffer is kept alive by ``record_stream`` until its copies finish)."""
        self.cancelled = True

    def wait_layer(self, layer: int) -> None:
        if self.cuda_events is not None:
            torch.cuda.current_stream().wait_event(self.cuda_events[layer])
        else:
            self.layer_ready[layer].wait()

    def wait_all(self) -> None:
        if self.cuda_events is not None:
            if self.cuda_events:
                self.cuda_events[-1].synchronize()
        else:
            self.done.wait()

    def ready(self) -> bool:
        if self.cuda_events is not None:
            return not self.cuda_events or self.cuda_events[-1].query()
        return self.done.is_set()

    def layers_done(self) -> int:
        """How many leading layers have landed (layers land in order)."""
        flags = ([e.query() for e in self.cuda_events] if self.cuda_events is not None
                 else [e.is_set() for e in self.layer_ready])
        return flags.index(False) if False in flags else len(flags)


class LinkStats:
    def __init__(self) -> None:
        self.bytes_moved = 0
        self.busy_s = 0.0
        self.intervals: list[tuple[float, float]] = []  # (start, end) of busy periods, for timelines
        self._lock = threading.Lock()

    def add(self, nbytes: int, start: float, end: float) -> None:
        with self._lock:
            self.bytes_moved += nbytes
            self.busy_s += end - start
            self.intervals.append((start, end))


class Link(Protocol):
    """What carries a host-tier full KV to the device: ``EmulatedLink`` or ``CudaLink``."""
    kind: str

    @property
    def stats(self) -> LinkStats: ...

    def submit(self, src: FullKVCache, length: int, dst: FullKVCache, first_layer: int = 0) -> Transfer: ...

    def close(self) -> None: ...


class EmulatedLink:
    """A copier thread at ``gbps`` Gbit/s with ``latency_s`` per transfer."""

    kind = "emulated"

    def __init__(self, gbps: float, latency_s: float = 20e-6) -> None:
        if gbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 Gbit/s, got {gbps}")
        self.bytes_per_s = gbps * 1e9 / 8
        self.latency_s = latency_s
        self.stats = LinkStats()
        self._queue: queue.Queue[Transfer | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="vericache-link", daemon=True)
        self._thread.start()

    def submit(self, src: FullKVCache, length: int, dst: FullKVCache, first_layer: int = 0) -> Transfer:
        t = Transfer(src, length, dst, first_layer, [threading.Event() for _ in range(dst.k.shape[0])])
        self._queue.put(t)
        return t

    def _run(self) -> None:
        while (t := self._queue.get()) is not None:
            try:
                if not t.cancelled:
                    with torch.inference_mode():  # the buffers are inference tensors
                        self._move(t)
            except Exception as exc:  # noqa: BLE001 - the engine fails this request; the link goes on
                t.error = f"{type(exc).__name__}: {exc}"
            finally:
                for ev in t.layer_ready:
                    ev.set()
                t.finished_at = t.finished_at or time.perf_counter()
                t.done.set()

    def _move(self, t: Transfer) -> None:
        t.started_at = time.perf_counter()
        deadline = t.started_at + self.latency_s
        for layer in range(t.dst.k.shape[0]):
            if t.cancelled:
                return
            start, src = time.perf_counter(), t.first_layer + layer
            t.dst.k[layer, :, : t.length] = t.src.k[src, :, : t.length]  # the real bytes move
            t.dst.v[layer, :, : t.length] = t.src.v[src, :, : t.length]
            nbytes = 2 * t.src.k[src, :, : t.length].numel() * t.src.k.element_size()
            deadline += nbytes / self.bytes_per_s
            if (pause := deadline - time.perf_counter()) > 0:
                time.sleep(pause)
            self.stats.add(nbytes, start, time.perf_counter())
            t.layer_ready[layer].set()
        t.finished_at = time.perf_counter()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class CudaLink:
    """Host-to-device copies on a dedicated stream, one event per layer (needs pinned host memory).

    Busy time comes from CUDA timing events (start of a transfer's copies to its last layer), read
    when the transfer has completed: ``stats`` counts finished transfers. The timeline places each
    busy interval at the transfer's submit time on the host clock (an approximation).
    """

    kind = "pcie"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._stats = LinkStats()
        self._pending: list[tuple[Transfer, torch.cuda.Event, int]] = []
        self._lock = threading.Lock()  # the engine thread submits while a metrics scrape reads

    @property
    def stats(self) -> LinkStats:
        with self._lock:
            still = []
            for t, start, nbytes in self._pending:
                if t.ready():
                    busy = start.elapsed_time(t.cuda_events[-1]) / 1e3 if t.cuda_events else 0.0
                    self._stats.add(nbytes, t.started_at, t.started_at + busy)
                else:
                    still.append((t, start, nbytes))
            self._pending = still
        return self._stats

    def submit(self, src: FullKVCache, length: int, dst: FullKVCache, first_layer: int = 0) -> Transfer:
        events: list[torch.cuda.Event] = []
        t = Transfer(src, length, dst, first_layer, cuda_events=events)
        t.started_at = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        # the buffer was zero-filled on the compute stream: the copies must come after that
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for layer in range(dst.k.shape[0]):
                dst.k[layer, :, :length].copy_(src.k[first_layer + layer, :, :length], non_blocking=True)
                dst.v[layer, :, :length].copy_(src.v[first_layer + layer, :, :length], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.stream)
                events.append(ev)
        # the caching allocator must not hand the buffer out again before these copies finish
        dst.k.record_stream(self.stream)
        dst.v.record_stream(self.stream)
        with self._lock:
            self._pending.append((t, start, 2 * dst.k[:, :, :length].numel() * src.k.element_size()))
        return t

    def close(self) -> None:
        self.stream.synchronize()


class StreamedKV(KVCache):
    """A verification cache over a device buffer that is still arriving: waits per layer. Layers
    before ``transfer.first_layer`` are read from ``resident``, a device-resident slice of the full KV."""

    def __init__(self, transfer: Transfer, resident: FullKVCache | None = None) -> None:
        if transfer.first_layer and (resident is None or resident.k.shape[0] != transfer.first_layer):
            raise ValueError(f"layers 0..{transfer.first_layer - 1} do not move, so a resident cache "
                             f"holding exactly them is needed")
        # the resident layers are read only where some stay on the device (first_layer > 0)
        self.t, self.buf, self.resident = transfer, transfer.dst, resident if transfer.first_layer else None

    def begin(self, start: int, count: int) -> None:
        self.buf.length = self.t.length  # the arriving positions count as written
        self.buf.begin(start, count)
        if self.resident is not None:
            self.resident.begin(start, count)

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        nbytes, pairs = self.buf.attention_cost(start, t)
        return nbytes + (self.resident.attention_cost(start, t)[0] if self.resident is not None else 0), pairs

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        first = self.t.first_layer
        if layer < first:
            assert self.resident is not None   # checked when made: first_layer > 0 needs the resident layers
            return self.resident.parts(layer, q, k, v)
        self.t.wait_layer(layer - first)
        return self.buf.parts(layer - first, q, k, v)
