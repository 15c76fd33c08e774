"""Collectives of CPU ranks on one host through shared memory.

gloo's all-reduce of a decode step's few kilobytes costs about a millisecond between two processes of the 2-core
test machine (loopback sockets and its own threads), twice a layer: a 30-layer model's tensor-parallel batch-1
decode ran at 9.4 tok/s through gloo and at 29.7 through this module (``benchmarks/bench_adaptive_parallel.py``,
``results/cpu/adaptive_parallel.json``). Ranks that share a host exchange the values through one shared-memory file,
as vLLM's CPU backend and DeepSpeed's shm communicator do:

- each rank writes its tensor into its own slot, then publishes the call's sequence number in its flag;
- it waits until every other rank's flag reaches that number, then reads all slots: the sum in rank order (every
  rank adds the same values in the same order, so all get the same bits, as tensor parallelism needs), or the
  slots side by side (all-gather);
- two sets of slots alternate by call parity. A rank can be at most one call ahead of another (it waits for the
  other's flag of each call), so the set it writes next was read by everyone before.

The flag is stored after the slot's data, and a reader loads the flag before the data: on x86-64 (total store
order) that is enough; elsewhere the group falls back to ``torch.distributed``. Sums are taken in fp32 and cast back.
Tensors larger than a slot go through ``torch.distributed`` as well.
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import socket
import tempfile
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

_FLAG_STRIDE = 8  # int64 per flag: 64 bytes apart, each on its own cache line
SLOT_BYTES = 4 << 20  # per rank and parity: 1 Mi fp32 values


def _is_tso() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmGroup:
    """Shared-memory all-reduce / all-gather for the CPU ranks of ``group`` (all on this host). Create it
    collectively (every rank of the group, same order as other collectives): :func:`shm_group` does, and returns
    None where it cannot serve (ranks on several hosts, not x86-64)."""

    def __init__(self, group, path: str, world: int, rank: int, slot_bytes: int = SLOT_BYTES) -> None:
        self.group, self.world, self.rank = group, world, rank
        self.slot_elems = slot_bytes // 4
        flags_bytes = world * _FLAG_STRIDE * 8
        size = flags_bytes + 2 * world * slot_bytes
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), size)
        self.flags = np.frombuffer(self._mm, dtype=np.int64, count=world * _FLAG_STRIDE)[::_FLAG_STRIDE]
        slots = torch.frombuffer(self._mm, dtype=torch.float32, offset=flags_bytes, count=2 * world * self.slot_elems)
        self.slots = slots.view(2, world, self.slot_elems)
        self.seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can go through the slots: a CPU fp32 / bf16 / fp16 tensor of at most a slot's values."""
        return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and t.numel() <= self.slot_elems)

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Publish ``t`` and wait for every rank's tensor of this call; returns the ``[world, n]`` fp32 slots."""
        if not self.fits(t):
            raise ValueError(f"t: expected a CPU float32 / bfloat16 / float16 tensor of at most {self.slot_elems} "
                             f"values (ShmGroup.fits), got {t.dtype} {tuple(t.shape)} on {t.device}")
        self.seq += 1
        seq = self.seq
        n = t.numel()
        slots = self.slots[seq & 1, :, :n]
        slots[self.rank].copy_(t.reshape(-1))
        self._publish_and_wait(seq)
        return slots

    def _publish_and_wait(self, seq: int) -> None:
        """Publish this rank's slot of call ``seq`` and wait for every rank's."""
        flags = self.flags
        flags[self.rank] = seq
        for r in range(self.world):
            spins = 0
            while flags[r] < seq:
                spins += 1
                if spins > 8192:  # an idle follower (a server without requests): ~1 ms to wake
                    time.sleep(0.001)
                elif spins > 4096:  # a long wait: stop burning the core
                    time.sleep(0.0002)
                elif spins > 64:  # another process may hold this core: give it the time slice
                    time.sleep(0)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, the same on every rank; :meth:`fits`) over the ranks in place, in fp32 in rank order
        (the same bits on every rank), and return it."""
        slots = self._exchange(t)
        acc = slots[0].clone()
        for r in range(1, self.world):
            acc += slots[r]
        t.copy_(acc.view(t.shape))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (:meth:`fits`; the same shape and dtype on every rank), as new tensors in rank order."""
        slots = self._exchange(t)
        return [slots[r].view(t.shape).to(t.dtype, copy=True) for r in range(self.world)]

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order. A pickle larger than a slot (on any rank) sends them all
        through ``torch.distributed`` instead (each rank sees every rank's size first, so all take the same way)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) + 8 <= self.slot_elems * 4
        self.seq += 1
        seq = self.seq
        raw = self.slots[seq & 1].view(torch.uint8)  # [world, slot bytes]
        mine = raw[self.rank]
        mine[:8].view(torch.int64)[0] = len(data) if fits else -1
        if fits:
            mine[8 : 8 + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._publish_and_wait(seq)
        sizes = [int(raw[r, :8].view(torch.int64)[0]) for r in range(self.world)]
        if min(sizes) < 0:
            out = [None] * self.world
            dist.all_gather_object(out, obj, group=self.group)
            return out
        return [pickle.loads(raw[r, 8 : 8 + n].numpy().tobytes()) for r, n in enumerate(sizes)]

    def close(self) -> None:
        self.flags = self.slots = None
        self._mm.close()


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_group(group=None, slot_bytes: int = SLOT_BYTES) -> ShmGroup | None:
    """Collectively (every rank of ``group``, default the world) set up a :class:`ShmGroup`; None when the ranks
    are not all on this host, the machine is not x86-64, or ``INFERCORE_SHM_COLLECTIVES=0``. Same answer on
    every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    hosts = [None] * world
    dist.all_gather_object(hosts, _host_id(), group=group)
    ok = len(set(hosts)) == 1 and _is_tso() and os.environ.get("INFERCORE_SHM_COLLECTIVES", "1") != "0"
    votes = [None] * world
    dist.all_gather_object(votes, ok, group=group)
    if not all(votes):
        return None
    size = world * _FLAG_STRIDE * 8 + 2 * world * slot_bytes
    box = [None]
    if rank == 0:
        base = "/dev/shm"  # tmpfs; a small one (containers' 64 MB) would SIGBUS a rank that touches a page past it
        if not os.path.isdir(base) or _free_bytes(base) < 4 * size:
            base = tempfile.gettempdir()  # a file in the page cache serves alike
        path = os.path.join(base, f"infercore_shm_{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(size)
        box[0] = path
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    shm = ShmGroup(group, box[0], world, rank, slot_bytes)
    dist.barrier(group=group)  # every rank has mapped it: the name can go (the mappings stay)
    if rank == 0:
        os.unlink(box[0])
    return shm
