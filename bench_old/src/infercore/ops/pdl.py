"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~300 short kernels in a row (norm, GEMV, RoPE, attention, GEMV, ...), each a
few microseconds, each paying its launch and ramp-up. With PDL a kernel may be scheduled while its
predecessor still runs: its programs get resident and compute their addresses, then wait in
``griddepcontrol.wait`` until the predecessor grid has finished and its writes are visible.
Measured on the H200, batch-1 decode of the 8B shape (results/h200/sweeps/decode_step_pdl.json vs
decode_step_nopdl.json, two runs of one session): 216.8 vs 213.2 tok/s, +1.7%; at batch >= 16 it
cost 1-10%, so it is limited to small launches (:data:`PDL_MAX_ROWS`). Leaving the GEMVs out of PDL
measured slower. The GEMVs load their first two weight tiles into registers before the wait and
consume them ahead of their K loop (:data:`GEMV_PREWAIT`). Batch-1 step of the 8B shape, one tile vs
none: bf16 4.279 -> 4.191 ms, FP8 weight-only 2.737 -> 2.607, W4A16 2.744 -> 2.674
(results/h200/sweeps/probe_bs1_gemv_prewait_peel.json); two tiles vs one: bf16 4.228 -> 4.103, FP8
2.622 -> 2.562, W4A16 unchanged (MODE 6 prefetches its first DEPTH iterations either way;
sweeps/probe_bs1_gemv_prewait_tiles.json). Two earlier forms measured slower: a prefetch of the tile
into L2 only (-2%), and a MODE 4 that kept the tile in registers through its K loop behind a branch
(FP8 -2.2%, sweeps/probe_bs1_gemv_prewait.json).

The contract every kernel here keeps when launched with PDL (``USE_PDL``):

* ``pdl_release()`` early: lets the *next* kernel be scheduled (it waits anyway before reading);
* ``pdl_wait()`` on every path before the first read of data a previous kernel may have written,
  and before the program exits (so completion stays transitive down the chain: a kernel's
  successors may read what its predecessors wrote);
* only what no kernel of the step writes may be read before ``pdl_wait()``: weights, the step's
  input buffers (sequence lengths, block tables: filled before its first kernel), and KV-cache rows
  of earlier steps (the decode attention reads its first tile's older rows early; the newest row,
  written by this step's RoPE / KV-write kernel, after the wait).

Kernels launched without PDL (torch's, cuBLAS) are ordinary stream dependencies, so mixing is safe.
``INFERCORE_PDL=0`` turns it off; the Triton interpreter and GPUs before sm90 never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from infercore.devices import triton_interpreter


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# PDL only for launches over at most this many rows (tokens / sequences: dim 0 of the tensor given to
# ``pdl_enabled``). Batch 1 gained; batches 16-256 measured slower with it (results/h200/e2e.json
# and sweeps/e2e_pdl_all_batches.json): waiting programs hold multiprocessor slots that the
# predecessor's larger grid still needs.
PDL_MAX_ROWS = 4

# With PDL, the GEMV kernels (the bf16 one in ops.linear, the weight-only MODE 4 and MODE 6) load their
# first GEMV_PREWAIT weight tiles (0, 1 or 2; MODE 6: its first DEPTH iterations when this is >= 1)
# before waiting for the previous kernel and consume them ahead of their K loop.
_PREWAIT_ENV = os.environ.get("INFERCORE_GEMV_PREWAIT", "2")
if _PREWAIT_ENV not in ("0", "1", "2"):
    raise ValueError(f"INFERCORE_GEMV_PREWAIT: expected 0, 1 or 2, got {_PREWAIT_ENV!r}")
GEMV_PREWAIT = int(_PREWAIT_ENV)


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launches with PDL: CUDA sm90+, at most :data:`PDL_MAX_ROWS` rows
    (``t.shape[0]``), not the interpreter, not disabled by ``INFERCORE_PDL=0``."""
    if not t.is_cuda or triton_interpreter() or os.environ.get("INFERCORE_PDL", "1") == "0":
        return False
    if t.dim() == 0 or t.shape[0] > PDL_MAX_ROWS:
        return False
    return _device_ok(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(use: bool) -> dict:
    """Launch keyword arguments for a kernel with a ``USE_PDL`` constexpr (empty when off, so the
    interpreter and older Tritons never see the option)."""
    return {"USE_PDL": True, "launch_pdl": True} if use else {}


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Allow the next kernel in the stream to be scheduled (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
