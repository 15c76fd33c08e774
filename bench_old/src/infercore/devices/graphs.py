"""CUDA graphs captured in segments around host work.

A forward that must stop for the host part way (``offload.offload_experts_``: each MoE layer's routed experts
are computed on the host) cannot be one CUDA graph, and running it eagerly costs a launch per kernel: a
Qwen3-30B-A3B-shaped layer's attention, norms and router take ~1.7 ms eagerly on an H200's host against ~0.15 ms
replayed. :func:`capture_segmented` captures such a forward as a chain of graphs: model code that needs the host
calls :func:`host_break` with the host work, which ends the graph being captured there and starts the next. A
:class:`SegmentedGraph` replays the chain in order and runs each break's host work between its two graphs.

The device-host exchange is the caller's: inputs go to page-locked buffers by copies captured before the break
(with an event recorded after them, :func:`capture_event`, that the host work waits for), the host writes its
result into a page-locked buffer, and a copy captured after the break brings it back. The buffers are fixed at
capture, like every graph input; they must be allocated before the capture (page-locked allocation is not a
capturable call).

Every segment allocates from one memory pool, as graphs sharing a pool must be replayed in the order they were
captured, which :meth:`SegmentedGraph.replay` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_captures: list[_SegmentedCapture] = []  # the segmented captures in progress (innermost last)


class SegmentedGraph:
    """A chain of CUDA graphs with host work between them; the interface of ``torch.cuda.CUDAGraph`` that a
    graph runner uses (``replay``, ``pool``)."""

    def __init__(self) -> None:
        self.segments: list[tuple[torch.cuda.CUDAGraph, Callable[[], None] | None]] = []
        self._pool = None

    def pool(self):
        """The memory pool handle of every segment (pass it to another capture to share the pool)."""
        return self._pool

    @property
    def num_host_breaks(self) -> int:
        return sum(host is not None for _, host in self.segments)

    def replay(self) -> None:
        """Replay every segment in capture order, each break's host work after the graph before it is launched
        (the host work waits for what it needs itself) and before the graph after it is launched."""
        if not self.segments:
            raise RuntimeError("SegmentedGraph.replay: nothing was captured")
        for graph, host in self.segments:
            graph.replay()
            if host is not None:
                host()


class _SegmentedCapture:
    def __init__(self, graph: SegmentedGraph, pool, stream, capture_error_mode: str) -> None:
        if not isinstance(graph, SegmentedGraph):
            raise TypeError(f"graph must be a SegmentedGraph, got {type(graph).__name__}")
        self.graph = graph
        self.pool = pool
        self.stream = stream
        self.mode = capture_error_mode
        self.current: torch.cuda.CUDAGraph | None = None
        self._stream_ctx = None

    def _begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.graph._pool, capture_error_mode=self.mode)

    def _end(self, host: Callable[[], None] | None) -> None:
        graph, self.current = self.current, None
        graph.capture_end()
        self.graph.segments.append((graph, host))

    def __enter__(self) -> SegmentedGraph:
        if self.graph.segments:
            raise ValueError("graph: this SegmentedGraph was captured already")
        torch.cuda.synchronize()
        self.graph._pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        self._stream_ctx = torch.cuda.stream(self.stream if self.stream is not None else torch.cuda.Stream())
        self._stream_ctx.__enter__()
        try:
            self._begin()
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise
        _captures.append(self)
        return self.graph

    def host_break(self, host: Callable[[], None]) -> None:
        self._end(host)
        self._begin()

    def __exit__(self, exc_type, exc, tb) -> None:
        _captures.remove(self)
        try:
            if self.current is not None:
                if exc_type is None:
                    self._end(None)
                else:  # end the capture so the stream is usable again; the partial chain is dropped
                    try:
                        self.current.capture_end()
                    finally:
                        self.graph.segments.clear()
        finally:
            self._stream_ctx.__exit__(exc_type, exc, tb)


def capture_segmented(graph: SegmentedGraph, pool=None, stream: torch.cuda.Stream | None = None,
                      capture_error_mode: str = "global") -> _SegmentedCapture:  # fmt: skip
    """Context manager capturing the CUDA work of its body into ``graph``, split at every :func:`host_break` the
    body reaches (``torch.cuda.graph``'s arguments: ``pool`` a pool handle to share, ``stream`` the capture
    stream, default a new one)."""
    return _SegmentedCapture(graph, pool, stream, capture_error_mode)


def segmented_capture_active() -> bool:
    """Whether a :func:`capture_segmented` body is running (model code then calls :func:`host_break` instead of
    waiting for the device)."""
    return bool(_captures)


def host_break(host: Callable[[], None]) -> None:
    """End the segment being captured here: at each replay ``host()`` runs after the segment is launched and
    before the next one is (it waits for the device work it reads, e.g. on an event from
    :func:`capture_event`). Only inside :func:`capture_segmented`."""
    if not _captures:
        raise RuntimeError("host_break: no segmented capture is running (see capture_segmented)")
    if not callable(host):
        raise TypeError(f"host must be callable, got {type(host).__name__}")
    _captures[-1].host_break(host)


def capture_event() -> torch.cuda.Event:
    """An event recorded at this point of the graph being captured, each time it is replayed (an external
    event record node): the host work of a later :func:`host_break` waits on it rather than on the whole
    segment, so device work captured after it (e.g. a shared expert) overlaps the host."""
    ev = torch.cuda.Event(external=True)
    ev.record()
    return ev
