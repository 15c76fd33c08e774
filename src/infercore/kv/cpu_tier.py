"""A host-memory tier under the prefix cache: evicted pages are copied out, matched ones copied back.

:class:`CPUKVTier` holds ``num_pages`` slots in host memory (pinned when the caches are on CUDA), each
the bytes of one page id across every layer (in chunks of at most 1 GiB, ``host_chunks``), in the device
caches' own formats: for every layer, the
K then V page (``[page_size, Hk, D]``) and, for quantized caches (:class:`~infercore.kv.QuantizedKVCache`),
the fp32 ``k_scale`` / ``v_scale`` rows of the page (``[page_size, Hk]``). A slot is one contiguous byte
row, so moving a page is one host<->device copy whatever the number of layers; the device side gathers
/ scatters the page's pieces with one indexing kernel per cache tensor, batched over pages.

The :class:`~infercore.kv.BlockManager` owns the decisions (plain Python, deterministic: tensor-parallel
ranks make the same ones): it calls :meth:`CPUKVTier.demote` when it is about to reuse an evictable
cached page (the tier keeps it under its chain key, evicting its own least recently used slot when
full) and :meth:`CPUKVTier.load` when a prefix match continues into the tier (the slot's bytes go to a
fresh device page). Both only queue; :meth:`CPUKVTier.flush` issues the queued copies (copies out moved
ahead of loads they do not depend on, so each direction goes in large batches).

Ordering on CUDA (no host synchronization anywhere):

* every copy runs on one side stream (``stream``), so copies among themselves run in issue order: a
  page's copy out precedes a load into it, and a slot's load precedes a later copy into it;
* the compute stream is fenced by events recorded after each forward launch (:meth:`record_launch`,
  numbered by ``launch_seq``). A page's ``stamp`` is the last launch number enqueued when it lost its
  last reference: every kernel that ever wrote or read it under its old owner was launched before.
  A copy out of a page, and a load into a page, first wait for that launch's event; an older launch
  whose event is no longer kept is covered by the oldest kept one (a later point of the same stream);
* before each forward the compute stream waits for the copies issued so far (:meth:`before_forward`), so
  a load lands before any kernel reads the page and a copy out reads the page before a kernel
  overwrites it.

With async scheduling step n+1's admissions (and their loads) are issued while step n runs; their
copies wait only for the launches that touched their pages, so they overlap step n unless a page was
released after step n's launch. On the CPU every copy completes when it is issued.

Loads start at admission (``BlockManager.allocate``, called by the scheduler), not when a request is
added: a load needs device pages, and pages held by queued requests would be taken from the running
ones (more preemptions) in an order the scheduler does not control; admission is also the point where
every tensor-parallel rank makes the same decision.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

_KEPT_EVENTS = 8  # launch events kept for fences; older launches are covered by the oldest kept


@dataclass
class CPUTierStats:
    """Pages copied out to the tier (``demoted``), copied back (``loaded``), dropped from the tier to make
    room (``evicted``), and evictions whose content the tier already held (``deduplicated``: no copy) or
    could not take (``dropped``: every slot was pinned by a pending load)."""

    demoted: int = 0
    loaded: int = 0
    evicted: int = 0
    deduplicated: int = 0
    dropped: int = 0


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[num_pages, ...]`` contiguous as a ``[num_pages, bytes_per_page]`` uint8 view."""
    if not t.is_contiguous():
        raise ValueError(f"kv_caches: the CPU tier copies whole pages and needs contiguous caches, got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1).view(torch.uint8)


class CPUKVTier:
    """Host slots for evicted prefix-cache pages of ``kv_caches`` (see the module docstring).

    Args:
        kv_caches: the device caches, one ``(k_cache, v_cache)`` pair (or
            :class:`~infercore.kv.QuantizedKVCache`) per layer, each ``[num_pages, page_size, Hk, D]``
            contiguous (as :func:`~infercore.kv.allocate_kv_caches` returns them).
        num_pages: slots in the tier (>= 1).
        staging_pages: pages moved per batch through the device staging buffer (bounds its memory).
    """

    def __init__(self, kv_caches: Sequence, num_pages: int, *, staging_pages: int = 32) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        if isinstance(staging_pages, bool) or not isinstance(staging_pages, int) or staging_pages < 1:
            raise ValueError(f"staging_pages must be an int >= 1, got {staging_pages!r}")
        tensors: list[torch.Tensor] = []
        for layer in kv_caches:
            tensors += [layer[0]] if layer[1] is layer[0] else [layer[0], layer[1]]  # a shared_kv layer: one tensor
            if hasattr(layer, "k_scale"):
                tensors += [layer.k_scale, layer.v_scale]
        if not tensors:
            raise ValueError("kv_caches must hold at least one layer")
        device_pages = tensors[0].shape[0]
        if any(t.shape[0] != device_pages for t in tensors):
            raise ValueError("kv_caches: every cache tensor must have the same number of pages (dim 0)")
        self.device = tensors[0].device
        rows = [_byte_rows(t) for t in tensors]
        widths = [r.shape[1] for r in rows]
        self.page_bytes = sum(widths)
        # The page gathers/scatters (index_select / index_copy_) move the widest element dividing every
        # tensor's page bytes: one byte per element would cost the copy kernels most of their bandwidth.
        elem = next(e for e in (8, 4, 2, 1) if all(w % e == 0 for w in widths))
        wide = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem]
        self._rows = [r.view(wide) for r in rows]
        self._widths = [w // elem for w in widths]
        self._offsets = [sum(self._widths[:i]) for i in range(len(widths))]
        self._wide = wide
        self.num_pages = num_pages
        cuda = self.device.type == "cuda"
        # Host slots in chunks of at most 1 GiB: torch's pinned allocator rounds each allocation up to a
        # power of two, which would nearly double a large tier in one piece.
        self._per_chunk = max(1, (1 << 30) // self.page_bytes)
        self.host_chunks = [
            torch.empty((min(self._per_chunk, num_pages - a), self.page_bytes), dtype=torch.uint8, pin_memory=cuda)
            for a in range(0, num_pages, self._per_chunk)
        ]
        self._staging_pages = min(staging_pages, num_pages)
        self._staging = torch.empty((self._staging_pages, self.page_bytes), dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:  # freed with the engine: the allocator then waits for this stream's queued copies
            for t in (self._staging, *tensors):
                t.record_stream(self.stream)

        # Chain key -> slot, least recently used first; each slot's key and token ids.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._slot_key: list[bytes | None] = [None] * num_pages
        self._slot_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._pinned: dict[int, int] = {}
        # Queued copies, in issue order: ("out", page, slot, stamp) / ("in", slot, page, stamp).
        self._queue: list[tuple[str, int, int, int]] = []
        self.launch_seq = -1
        self._launch_events: deque[tuple[int, torch.cuda.Event]] = deque(maxlen=_KEPT_EVENTS)
        self._unfenced = False  # copies issued since the compute stream last waited for them
        self.stats = CPUTierStats()

    # ------------------------------------------------------------------ bookkeeping

    def __len__(self) -> int:
        """Slots holding a page."""
        return len(self._index)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    def lookup(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot holding the page of chain key ``key`` whose token ids are ``tokens``, or None.
        No side effects (LRU order changes only on :meth:`load`)."""
        slot = self._index.get(key)
        if slot is None or self._slot_tokens[slot] != tokens:
            return None
        return slot

    def pin(self, slots: Sequence[int]) -> None:
        """Keep ``slots`` from being reused by :meth:`demote` until :meth:`unpin`. They also become the most
        recently used (they are pinned to be loaded, which makes them so): the demotions' search for the least
        recently used unpinned slot then does not walk past them."""
        for s in slots:
            self._pinned[s] = self._pinned.get(s, 0) + 1
            key = self._slot_key[s]
            if key is not None:
                self._index.move_to_end(key)

    def unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            n = self._pinned[s] - 1
            if n:
                self._pinned[s] = n
            else:
                del self._pinned[s]

    def demote(self, page: int, key: bytes, tokens: tuple[int, ...], stamp: int) -> int | None:
        """Queue a copy of device ``page`` (cached under ``key``, holding ``tokens``) into a slot before
        the page is reused; ``stamp``: the last launch that may have touched it. Returns the slot, or None
        when the tier already holds ``key`` (no copy) or every slot is pinned (the page is dropped)."""
        if key in self._index:
            self._index.move_to_end(key)
            self.stats.deduplicated += 1
            return None
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped += 1
            return None
        self._index[key] = slot
        self._slot_key[slot] = key
        self._slot_tokens[slot] = tokens
        self._queue.append(("out", page, slot, stamp))
        self.stats.demoted += 1
        return slot

    def load(self, slot: int, page: int, stamp: int) -> None:
        """Queue a copy of ``slot`` into device ``page`` (``stamp``: the last launch that may have touched
        the page under its previous owner); the slot becomes the most recently used."""
        key = self._slot_key[slot]
        if key is None:
            raise ValueError(f"slot {slot} of the CPU tier holds no page")
        self._index.move_to_end(key)
        self._queue.append(("in", slot, page, stamp))
        self.stats.loaded += 1

    def reset(self) -> None:
        """Forget every page (queued copies are still issued: their bytes are simply never used)."""
        self.flush()
        self._index.clear()
        self._slot_key = [None] * self.num_pages
        self._slot_tokens = [None] * self.num_pages
        self._free = deque(range(self.num_pages))

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for key, slot in self._index.items():  # least recently used first; pinned slots are few
            if slot not in self._pinned:
                del self._index[key]
                self.stats.evicted += 1
                return slot
        return None

    # ------------------------------------------------------------------ copies

    def flush(self) -> None:
        """Issue the queued copies (batched by direction, ``staging_pages`` at a time).

        Taking a page queues its copy out and then the load into it, so the queue alternates; issued in
        that order every batch would move one page. Copies out are therefore moved ahead of earlier loads
        where nothing orders them (the load neither writes the page the copy out reads nor reads the slot
        it writes): the issue order stays a valid order for every pair that touches the same page or slot.
        """
        q = self._queue
        if not q:
            return
        self._queue = []
        for kind, ops in _grouped(q):
            for i in range(0, len(ops), self._staging_pages):
                if self.stream is None:
                    self._copy(kind, ops[i : i + self._staging_pages])
                else:
                    with torch.cuda.stream(self.stream):
                        self._copy(kind, ops[i : i + self._staging_pages])
        self._unfenced = self.stream is not None

    @torch.inference_mode()
    def _copy(self, kind: str, ops: list[tuple[str, int, int, int]]) -> None:
        n = len(ops)
        fence = self._fence(max(op[3] for op in ops))
        if fence is not None:
            self.stream.wait_event(fence)
        staging = self._staging[:n]
        wide = staging.view(self._wide)
        if kind == "out":
            pages, slots = [op[1] for op in ops], [op[2] for op in ops]
            idx = self._index_tensor(pages)
            for rows, off, w in zip(self._rows, self._offsets, self._widths):
                wide[:, off : off + w] = rows.index_select(0, idx)
            for a, b, s in _runs(slots, self._per_chunk):
                self._host_rows(s, b - a).copy_(staging[a:b], non_blocking=True)
        else:
            slots, pages = [op[1] for op in ops], [op[2] for op in ops]
            for a, b, s in _runs(slots, self._per_chunk):
                staging[a:b].copy_(self._host_rows(s, b - a), non_blocking=True)
            idx = self._index_tensor(pages)
            for rows, off, w in zip(self._rows, self._offsets, self._widths):
                rows.index_copy_(0, idx, wide[:, off : off + w])

    def _host_rows(self, slot: int, n: int) -> torch.Tensor:
        """Slots ``slot .. slot + n - 1`` (one chunk) as a ``[n, page_bytes]`` view."""
        c, r = divmod(slot, self._per_chunk)
        return self.host_chunks[c][r : r + n]

    def _index_tensor(self, pages: list[int]) -> torch.Tensor:
        t = torch.tensor(pages, dtype=torch.long)
        if self.stream is None:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _fence(self, stamp: int):
        """The event after launch ``stamp`` (or a later kept one); None when nothing needs waiting."""
        if stamp < 0 or self.stream is None or not self._launch_events:
            return None
        for seq, ev in self._launch_events:
            if seq >= stamp:
                return ev
        return self._launch_events[-1][1]

    def record_launch(self) -> None:
        """Call right after a forward is enqueued on the compute stream: numbers it (``launch_seq``) and,
        on CUDA, records the event copies touching its pages wait for."""
        self.launch_seq += 1
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._launch_events.append((self.launch_seq, ev))

    def before_forward(self) -> None:
        """Call right before a forward is enqueued: issues queued copies and makes the compute stream wait
        for every copy issued so far (a device-side wait; the host does not block)."""
        self.flush()
        if self._unfenced:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._unfenced = False


def _grouped(q: list[tuple[str, int, int, int]]) -> list[tuple[str, list[tuple[str, int, int, int]]]]:
    """``q`` as runs of one direction (see :meth:`CPUKVTier.flush`): a copy out joins the current outs,
    ahead of the loads queued since, unless one of those loads writes its page or reads its slot; then
    the current outs and loads are closed (in that order) and it starts the next group."""
    out: list[tuple[str, list]] = []
    outs: list = []
    ins: list = []
    in_pages: set[int] = set()
    in_slots: set[int] = set()
    for op in q:
        if op[0] == "in":
            ins.append(op)
            in_slots.add(op[1])
            in_pages.add(op[2])
        elif op[1] in in_pages or op[2] in in_slots:
            out += [(k, g) for k, g in (("out", outs), ("in", ins)) if g]
            outs, ins, in_pages, in_slots = [op], [], set(), set()
        else:
            outs.append(op)
    return out + [(k, g) for k, g in (("out", outs), ("in", ins)) if g]


def _runs(slots: list[int], chunk: int) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots within one chunk of ``chunk`` slots: ``(start, end, first slot)``
    over positions of ``slots``."""
    out = []
    a = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or slots[i] % chunk == 0:
            out.append((a, i, slots[a]))
            a = i
    return out
