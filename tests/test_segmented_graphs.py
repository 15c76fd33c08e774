"""devices.graphs: a CUDA graph captured in segments around host work. On the CPU, the refusals; on CUDA
(``gpu``), a captured chain replayed with new inputs against the same computation run eagerly, the host work
waiting on a captured event while the device work after it runs, and two chains sharing one memory pool."""

import pytest
import torch

from infercore.devices.graphs import (
    SegmentedGraph,
    capture_event,
    capture_segmented,
    host_break,
    segmented_capture_active,
)


def test_refusals_outside_a_capture():
    assert not segmented_capture_active()
    with pytest.raises(RuntimeError, match="no segmented capture"):
        host_break(lambda: None)
    with pytest.raises(RuntimeError, match="nothing was captured"):
        SegmentedGraph().replay()
    with pytest.raises(TypeError, match="graph must be a SegmentedGraph"):
        capture_segmented(object())
    g = SegmentedGraph()
    assert g.pool() is None and g.num_host_breaks == 0


def _chain(x: torch.Tensor, pin: torch.Tensor, back: torch.Tensor, calls: list) -> torch.Tensor:
    """``(2x + 1) * 3 + (2x + 100)``, the ``+ 1`` on the host between two device parts."""
    y = x * 2
    pin.copy_(y, non_blocking=True)
    ev = capture_event() if segmented_capture_active() else None
    side = y + 100  # device work the host does not wait for

    def host() -> None:
        if ev is not None:
            ev.synchronize()
        else:
            torch.cuda.synchronize()
        calls.append(1)
        back.copy_(pin + 1)

    if segmented_capture_active():
        host_break(host)
    else:
        host()
    z = torch.empty_like(y)
    z.copy_(back, non_blocking=True)
    return z * 3 + side


@pytest.mark.gpu
def test_segmented_chain_replays_with_new_inputs():
    x = torch.zeros(64, device="cuda")
    pin, back = (torch.empty(64, pin_memory=True) for _ in range(2))
    calls: list = []
    _chain(x, pin, back, calls)  # warm-up, eagerly
    g = SegmentedGraph()
    with capture_segmented(g):
        assert segmented_capture_active()
        out = _chain(x, pin, back, calls)
    assert not segmented_capture_active()
    assert len(g.segments) == 2 and g.num_host_breaks == 1 and g.pool() is not None
    calls.clear()
    for v in (1.0, 5.0, -3.0):
        x.copy_(torch.arange(64, device="cuda") * v)
        g.replay()
        torch.cuda.synchronize()
        want = (2 * x + 1) * 3 + (2 * x + 100)
        assert torch.equal(out, want), v
    assert len(calls) == 3

    # A second chain in the same pool, replayed in turn with the first (the graph runner's buckets).
    x2 = torch.zeros(8, device="cuda")
    pin2, back2 = (torch.empty(8, pin_memory=True) for _ in range(2))
    _chain(x2, pin2, back2, calls)
    g2 = SegmentedGraph()
    with capture_segmented(g2, pool=g.pool()):
        out2 = _chain(x2, pin2, back2, calls)
    for v in (2.0, 7.0):
        x.fill_(v)
        x2.fill_(-v)
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, (2 * x + 1) * 3 + (2 * x + 100))
        assert torch.equal(out2, (2 * x2 + 1) * 3 + (2 * x2 + 100))

    with pytest.raises(ValueError, match="captured already"):
        with capture_segmented(g):
            pass


@pytest.mark.gpu
def test_a_failing_capture_leaves_the_stream_usable():
    g = SegmentedGraph()
    with pytest.raises(ZeroDivisionError):
        with capture_segmented(g):
            torch.ones(4, device="cuda") * 2
            host_break(lambda: None)
            raise ZeroDivisionError
    assert g.segments == [] and not segmented_capture_active()
    assert torch.ones(4, device="cuda").sum().item() == 4
