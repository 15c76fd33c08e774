"""Hybrid block manager: per-group pages from a two-level pool, with cross-type prefix caching.

Each layer group (see :mod:`.layout`) has a policy (:mod:`.policies`): full attention holds every
page, sliding window releases pages that fall out of the window, linear state holds one live state
slot. Small-page states, per group:

* **taken, in use** -- ``ref > 0``: in some request's block table (or its live state slot);
* **taken, evictable** -- ``ref == 0`` but registered in the prefix cache (a page, or a linear
  checkpoint); reclaimed in LRU order when the pool is short;
* **free** -- a free slot of a carved large page, or part of a free large page.

Prefix cache. Entries are attached to *nodes*, one per page-aligned prefix, keyed by the hash chain
of :mod:`infercore.kv.prefix_cache`. A node at depth ``i`` (prefix of ``i + 1`` pages) may hold,
per group, the page ``i`` of a token group or a linear checkpoint of the state after those tokens.
A hit is the longest prefix that *every* group can serve (full: all pages; sliding: the pages in
the window of the first recomputed token; linear: a checkpoint exactly there). Evicting a full
group's page drops its node and every descendant node (their KV chains through it), so no
checkpoint or sliding page outlives the prefix it belongs to.

Linear checkpoints are copies of the live state. The manager decides slots; the engine moves
bytes: :meth:`HybridBlockManager.take_state_copies` returns the pending ``(src -> dst)`` slot
copies, to be run in order before the next forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..prefix_cache import PrefixCacheStats, hash_page, root_hash
from .layout import HybridKVLayout
from .policies import FullAttentionPolicy, LinearStatePolicy, SlidingWindowPolicy
from .pool import TwoLevelPool
from .spec import FULL, LINEAR, SLIDING

PAD_PAGE = -1
"""Block-table entry of a page a request released (sliding window) -- never read by attention."""


@dataclass(frozen=True)
class StateCopy:
    """Copy linear state slot ``src`` to slot ``dst`` in every layer of ``group``."""

    group: int
    src: int
    dst: int


class _Node:
    __slots__ = ("key", "parent", "tokens", "depth", "entries", "children")

    def __init__(self, key: bytes, parent: bytes, tokens: tuple[int, ...], depth: int) -> None:
        self.key, self.parent, self.tokens, self.depth = key, parent, tokens, depth
        self.entries: dict[int, int] = {}  # group -> small page id
        self.children: set[bytes] = set()


class _Request:
    __slots__ = ("tables", "hashes", "num_tokens", "num_computed", "released", "root")

    def __init__(self, num_groups: int, root: bytes | None = None) -> None:
        self.root = root if root is not None else root_hash()  # the chain's root (salted by the extra key)
        # Token groups: small page ids by page index (PAD_PAGE once released);
        # linear groups: [live state slot].
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.hashes: list[bytes] = []
        self.num_tokens = 0
        self.num_computed = 0
        self.released = [0] * num_groups  # pages below this index are PAD_PAGE


def _count(name: str, value: object, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class HybridBlockManager:
    """Allocates per-group small pages and state slots to requests; shares cached prefixes.

    Args:
        layout: the model's :class:`HybridKVLayout` (its ``mode`` picks multi-granularity or the
            uniform baseline).
        num_large_pages: large pages in the pool (``layout.num_large_pages(budget_bytes)``).
        enable_prefix_caching: share computed pages / checkpoints between equal prefixes.

    The interface mirrors :class:`infercore.kv.BlockManager` with a ``group`` argument on the
    per-group queries. Running short is not an error: ``allocate`` returns None and ``grow``
    returns False, the request's state unchanged (cached entries may have been evicted).
    """

    def __init__(self, layout: HybridKVLayout, num_large_pages: int, *, enable_prefix_caching: bool = True):
        if not isinstance(layout, HybridKVLayout):
            raise TypeError(f"layout must be a HybridKVLayout, got {type(layout).__name__}")
        _count("num_large_pages", num_large_pages, minimum=1)
        self.layout = layout
        self.page_tokens = P = layout.page_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching)
        G = len(layout.groups)
        self.per_large = [layout.smalls_per_large(g) for g in range(G)]
        self.policies: list = []
        for g in range(G):
            kind = layout.effective_kind(g)
            if kind == FULL:
                self.policies.append(FullAttentionPolicy(P))
            elif kind == SLIDING:
                self.policies.append(SlidingWindowPolicy(P, layout.groups[g].window))
            else:
                self.policies.append(LinearStatePolicy(P, layout.checkpoint_interval))
        dense = [p.kind == LINEAR for p in self.policies]
        self.pool = TwoLevelPool(num_large_pages, self.per_large, dense=dense)
        self._full_groups = [g for g in range(G) if self.policies[g].kind == FULL]
        self._linear_groups = [g for g in range(G) if self.policies[g].kind == LINEAR]
        self._token_groups = [g for g in range(G) if self.policies[g].kind != LINEAR]

        self._ref: list[list[int]] = [[0] * (num_large_pages * n) for n in self.per_large]
        self._entry_node: list[dict[int, _Node]] = [{} for _ in range(G)]
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(G)]
        self._evictable_in: list[int] = [0] * num_large_pages  # per large page
        self._nodes: dict[bytes, _Node] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._copies: list[StateCopy] = []
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def block_table(self, req_id: Hashable, group: int, *, start: int = 0) -> list[int]:
        """Small page ids of an attention group in position order (a copy), from page ``start``. Page
        ``i`` holds positions ``[i * page_tokens, (i + 1) * page_tokens)``; released pages read
        ``PAD_PAGE``. Pages are only ever appended while the request holds them."""
        self._check_group(group, token=True)
        _count("start", start)  # a negative start would slice from the end
        return self._get(req_id).tables[group][start:]

    def state_slot(self, req_id: Hashable, group: int) -> int:
        """The live state slot of a linear group (index into that group's state pools)."""
        self._check_group(group, token=False)
        return self._get(req_id).tables[group][0]

    def slot_mapping(self, req_id: Hashable, group: int, start: int, end: int) -> list[int]:
        """Cache slots (``page * page_tokens + offset``) of positions ``[start, end)`` in ``group``."""
        table = self.block_table(req_id, group)
        P = self.page_tokens
        if not 0 <= start <= end <= len(table) * P:
            raise ValueError(f"positions [start={start}, end={end}) must lie within {len(table) * P} slots")
        out = []
        for pos in range(start, end):
            page = table[pos // P]
            if page == PAD_PAGE:
                raise ValueError(f"position {pos} of request {req_id!r} lies in a released page")
            out.append(page * P + pos % P)
        return out

    def block_table_tensor(
        self, req_ids: Sequence[Hashable], group: int, *, max_pages: int | None = None, device=None
    ) -> torch.Tensor:
        """int32 ``[len(req_ids), max_pages]`` block table of ``group``; released and padding
        entries are 0 (a valid page id that the window mask never reads)."""
        if max_pages is not None:
            _count("max_pages", max_pages)
        tables = [self.block_table(r, group) for r in req_ids]
        width = max_pages if max_pages is not None else max((len(t) for t in tables), default=0)
        out = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if len(t) > width:
                raise ValueError(f"max_pages={width} is below request {req_ids[i]!r}'s {len(t)} pages")
            out[i, : len(t)] = torch.tensor([max(p, 0) for p in t], dtype=torch.int32)
        return out.to(device) if device is not None else out

    def match_prefix(self, token_ids: Sequence[int], *, max_cached_tokens: int, extra_key: bytes | None = None) -> int:
        """Tokens that :meth:`allocate` would serve from the cache now (read-only)."""
        _count("max_cached_tokens", max_cached_tokens)
        return len(self._lookup(token_ids, max_cached_tokens, root_hash(extra_key))[0]) * self.page_tokens

    def memory(self) -> dict[str, int]:
        """Byte accounting of the pool: ``used`` (small pages referenced by requests),
        ``cached`` (evictable cached pages), ``fragment`` (free slots of carved large pages),
        ``free`` (free large pages); they sum to ``total``. ``useful`` is the unpadded part of
        ``used``."""
        lay = self.layout
        used = cached = useful = 0
        for g, grp in enumerate(lay.groups):
            n_cached = len(self._evictable[g])
            n_taken = self.pool.num_taken_small(g)
            used += (n_taken - n_cached) * grp.small_bytes
            useful += (n_taken - n_cached) * grp.useful_bytes
            cached += n_cached * grp.small_bytes
        carved_bytes = (self.pool.num_large - self.pool.num_free_large) * lay.large_bytes
        return {
            "total": self.pool.num_large * lay.large_bytes,
            "used": used,
            "useful": useful,
            "cached": cached,
            "fragment": carved_bytes - used - cached,
            "free": self.pool.num_free_large * lay.large_bytes,
        }

    # ------------------------------------------------------------------ mutations

    def allocate(
        self, req_id: Hashable, token_ids: Sequence[int], num_tokens: int, *, max_cached_tokens: int,
        extra_key: bytes | None = None,
    ) -> int | None:
        """Admit ``req_id``: serve the longest prefix every group can serve, allocate the rest.

        Args:
            req_id: a new request id (hashable).
            token_ids: the request's known tokens.
            num_tokens: tokens to make room for (chunked prefill may stop short of the prompt).
            max_cached_tokens: cap on tokens served from the cache (``len(token_ids) - 1`` keeps
                one token to compute logits from).
            extra_key: salts the request's hash chain (bytes, or None; e.g. a LoRA adapter's identity): it
                shares pages only with requests of the same key.

        Returns:
            Cached tokens (a multiple of ``page_tokens``), or None if the pool is short. Linear
            groups get a live state slot; on a hit it must first receive the checkpoint (queued
            in :meth:`take_state_copies`).
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already allocated")
        _count("num_tokens", num_tokens)
        _count("max_cached_tokens", max_cached_tokens)
        root = root_hash(extra_key)
        hit, hashes = self._lookup(token_ids, max_cached_tokens, root)
        j = len(hashes)
        P = self.page_tokens
        req = _Request(self.num_groups, root)
        req.hashes = hashes
        req.num_computed = j * P
        req.num_tokens = max(num_tokens, j * P)
        # Claim hit entries first so that making room below cannot evict them.
        for g in self._token_groups:
            first = min(self.policies[g].first_needed_page(j * P), j)
            req.released[g] = first
            req.tables[g] = [PAD_PAGE] * first + [hit[i].entries[g] for i in range(first, j)]
            for p in req.tables[g][first:]:
                self._incref(g, p)
        ckpts = {g: hit[j - 1].entries[g] for g in self._linear_groups} if j else {}
        for g, ckpt in ckpts.items():
            self._incref(g, ckpt)  # pinned until its copy is queued; re-enters the LRU as recent
        needs = {g: -(-req.num_tokens // P) - len(req.tables[g]) for g in self._token_groups}
        needs.update({g: 1 for g in self._linear_groups})
        taken = self._take_many(req_id, needs)
        for g, ckpt in ckpts.items():
            self._decref(g, ckpt)
        if taken is None:
            self._drop(req)
            self.pool.disown(req_id)
            return None
        for g, pages in taken.items():
            req.tables[g].extend(pages)
        for g, ckpt in ckpts.items():
            self._copies.append(StateCopy(g, ckpt, req.tables[g][0]))
        self._requests[req_id] = req
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.query_tokens += len(token_ids)
            self.stats.hit_tokens += j * P
        return j * P

    def grow(self, req_id: Hashable, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in total; False (nothing changed) if short."""
        req = self._get(req_id)
        _count("num_tokens", num_tokens)
        if num_tokens <= req.num_tokens:
            return True
        pages = -(-num_tokens // self.page_tokens)
        needs = {g: pages - len(req.tables[g]) for g in self._token_groups}
        taken = self._take_many(req_id, needs)
        if taken is None:
            return False
        for g, new in taken.items():
            req.tables[g].extend(new)
        req.num_tokens = num_tokens
        return True

    def mark_computed(self, req_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that positions ``[0, num_computed)`` are written (and that linear live states
        now summarize exactly ``num_computed`` tokens).

        Publishes newly completed pages to the prefix cache, takes a linear checkpoint when
        ``num_computed`` is a multiple of ``layout.checkpoint_interval`` (schedule prefill chunks
        to end there), and releases sliding-window pages that no later token reads.
        """
        req = self._get(req_id)
        _count("num_computed", num_computed)
        if num_computed > len(token_ids):
            raise ValueError(f"num_computed={num_computed} exceeds len(token_ids)={len(token_ids)}")
        if num_computed > req.num_tokens:
            raise ValueError(f"num_computed={num_computed} exceeds the {req.num_tokens} tokens allocated")
        if num_computed < req.num_computed:
            raise ValueError(f"num_computed={num_computed} is below the {req.num_computed} already computed")
        req.num_computed = num_computed
        P = self.page_tokens
        if self.enable_prefix_caching:
            parent = req.hashes[-1] if req.hashes else req.root
            for i in range(len(req.hashes), num_computed // P):
                tokens = tuple(token_ids[i * P : (i + 1) * P])
                key = hash_page(parent, tokens)
                # A page already cached (under any node) stays private: dedupe, as in BlockManager.
                fresh = [
                    g
                    for g in self._token_groups
                    if req.tables[g][i] != PAD_PAGE and req.tables[g][i] not in self._entry_node[g]
                ]
                if fresh and self._full_groups and i > 0:
                    # Publish only onto an intact chain: if an ancestor was evicted (this request
                    # held a private duplicate of it), a hit could never reach this page.
                    up = self._nodes.get(parent)
                    if up is None or any(g not in up.entries for g in self._full_groups):
                        fresh = []
                if fresh:
                    node = self._node(key, parent, tokens, i)
                    if node.tokens == tokens:  # never file KV under a colliding key
                        for g in fresh:
                            if g not in node.entries:
                                self._publish(node, g, req.tables[g][i])
                req.hashes.append(key)
                parent = key
            if self._linear_groups and self.policies[self._linear_groups[0]].is_checkpoint(num_computed):
                i = num_computed // P - 1
                tokens = tuple(token_ids[i * P : (i + 1) * P])
                up = self._nodes.get(req.hashes[i])
                if self._full_groups and (up is None or any(g not in up.entries for g in self._full_groups)):
                    return self._release_window(req, num_computed)
                node = self._node(req.hashes[i], req.hashes[i - 1] if i else req.root, tokens, i)
                if node.tokens == tokens:
                    for g in self._linear_groups:
                        self._checkpoint(req_id, req, node, g)
                if not node.entries:
                    self._remove_node(node)
        self._release_window(req, num_computed)

    def _release_window(self, req: _Request, num_computed: int) -> None:
        for g in self._token_groups:
            first = min(self.policies[g].first_needed_page(num_computed), len(req.tables[g]))
            table = req.tables[g]
            for i in range(req.released[g], first):
                self._decref(g, table[i])
                table[i] = PAD_PAGE
            req.released[g] = max(req.released[g], first)

    def free(self, req_id: Hashable) -> None:
        """Release all of ``req_id``'s pages and slots: cached ones become evictable."""
        req = self._requests.pop(req_id, None)
        if req is None:
            raise ValueError(f"request {req_id!r} is not allocated (unknown or already freed)")
        self._drop(req)
        self.pool.disown(req_id)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content: evictable pages and checkpoints return to the pool; pages
        in use stay with their requests but are no longer shareable. Statistics are reset."""
        for node in list(self._nodes.values()):
            self._remove_node(node)
        for req in self._requests.values():
            # Live requests rehash on their next mark_computed and republish their pages; pages
            # they released (sliding) are gone, so they republish only what they still hold.
            req.hashes = []
        self.stats.reset()

    def take_state_copies(self) -> list[StateCopy]:
        """Pending linear-state copies (checkpoint -> live on a hit, live -> checkpoint after
        :meth:`mark_computed`); run them in order before the next forward. Clears the queue."""
        out, self._copies = self._copies, []
        return out

    # ------------------------------------------------------------------ internals

    def _get(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"request {req_id!r} is not allocated")
        return req

    def _check_group(self, group: int, *, token: bool) -> None:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ValueError(f"group must be in [0, {self.num_groups}), got {group!r}")
        if token != (self.policies[group].kind != LINEAR):
            what = "an attention" if token else "a linear-state"
            raise ValueError(f"group {group} is not {what} group")

    def _lookup(self, token_ids: Sequence[int], max_cached_tokens: int,
                root: bytes) -> tuple[list[_Node], list[bytes]]:
        """Nodes and keys of the longest prefix every group can serve (no side effects)."""
        if not self.enable_prefix_caching or not self._nodes:
            return [], []
        P = self.page_tokens
        limit = min(max_cached_tokens, len(token_ids)) // P
        nodes: list[_Node] = []
        keys: list[bytes] = []
        parent = root
        for i in range(limit):
            tokens = tuple(token_ids[i * P : (i + 1) * P])
            key = hash_page(parent, tokens)
            node = self._nodes.get(key)
            if node is not None and node.tokens != tokens:
                break  # a chain collision must never hand out foreign KV
            if node is None and self._full_groups:
                break  # full attention cannot serve past a missing page
            nodes.append(node)
            keys.append(key)
            parent = key
        oks = [
            self.policies[g].hit_lengths([n is not None and g in n.entries for n in nodes])
            for g in range(self.num_groups)
        ]
        j = len(nodes)
        while j > 0 and not all(ok(j) for ok in oks):
            j -= 1
        return nodes[:j], keys[:j]

    def _node(self, key: bytes, parent: bytes, tokens: tuple[int, ...], depth: int) -> _Node:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(key, parent, tokens, depth)
            up = self._nodes.get(parent)
            if up is not None:
                up.children.add(key)
        return node

    def _publish(self, node: _Node, g: int, page: int) -> None:
        node.entries[g] = page
        self._entry_node[g][page] = node
        if self._ref[g][page] == 0:
            self._make_evictable(g, page)

    def _checkpoint(self, req_id: Hashable, req: _Request, node: _Node, g: int) -> None:
        if g in node.entries:
            return
        # A checkpoint is an optimization: take free memory or recycle older checkpoints of the
        # same group, but never evict attention pages for it.
        if self.pool.num_free_small(g) < 1 and self._evictable[g]:
            self._evict(g, next(iter(self._evictable[g])))
        slot = self.pool.take(g, req_id, 1)
        if not slot:
            return
        self._ref[g][slot[0]] = 0
        self._publish(node, g, slot[0])
        self._copies.append(StateCopy(g, req.tables[g][0], slot[0]))

    def _take_many(self, owner: Hashable, needs: dict[int, int]) -> dict[int, list[int]] | None:
        """All of ``needs`` (group -> count) or nothing."""
        needs = {g: n for g, n in needs.items() if n > 0}
        if not needs or not self._can_provide(needs):
            return None if needs else {}
        taken: dict[int, list[int]] = {}
        for g, n in needs.items():
            self._make_room(g, n)
            pages = self.pool.take(g, owner, n)
            if pages is None:
                for h, got in taken.items():
                    for p in got:
                        self._decref(h, p)
                return None
            for p in pages:
                self._ref[g][p] = 1
            taken[g] = pages
        return taken

    def _can_provide(self, needs: dict[int, int]) -> bool:
        large = 0
        for g, n in needs.items():
            short = n - self.pool._free_slots[g] - len(self._evictable[g])
            if short > 0:
                large += -(-short // self.per_large[g])
        if large <= self.pool.num_free_large:
            return True
        return large <= self.pool.num_free_large + len(self._fully_evictable(exclude=set(needs)))

    def _fully_evictable(self, *, exclude: set[int]) -> list[int]:
        out = []
        for L in range(self.pool.num_large):
            g = self.pool.group_of_large(L)
            if g is not None and g not in exclude and self._evictable_in[L] == self.pool.taken_in(L):
                out.append(L)
        return out

    def _make_room(self, g: int, n: int) -> None:
        """Evict cached entries until ``n`` small pages of ``g`` are obtainable (best effort)."""
        while self.pool.num_free_small(g) < n:
            if self._evictable[g]:
                self._evict(g, next(iter(self._evictable[g])))
                continue
            victims = self._fully_evictable(exclude={g})
            if not victims:
                return
            L = victims[0]
            h = self.pool.group_of_large(L)
            per = self.per_large[h]
            for p in range(L * per, (L + 1) * per):
                if p in self._evictable[h]:
                    self._evict(h, p)

    def _evict(self, g: int, page: int) -> None:
        node = self._entry_node[g][page]
        if self.policies[g].kind == FULL:
            self._drop_subtree(node)
        else:
            self._unpublish(node, g)
            if not node.entries:
                self._remove_node(node)

    def _drop_subtree(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self._nodes[c] for c in n.children if c in self._nodes)
            for g in list(n.entries):
                self._unpublish(n, g)
            self._remove_node(n)

    def _unpublish(self, node: _Node, g: int) -> None:
        page = node.entries.pop(g)
        del self._entry_node[g][page]
        if self._ref[g][page] == 0:
            del self._evictable[g][page]
            self._evictable_in[self.pool.large_of(g, page)] -= 1
            self.pool.release(g, page)

    def _remove_node(self, node: _Node) -> None:
        for g in list(node.entries):
            self._unpublish(node, g)
        self._nodes.pop(node.key, None)
        up = self._nodes.get(node.parent)
        if up is not None:
            up.children.discard(node.key)

    def _make_evictable(self, g: int, page: int) -> None:
        self._evictable[g][page] = None
        self._evictable_in[self.pool.large_of(g, page)] += 1

    def _touch(self, g: int, page: int) -> None:
        if page in self._evictable[g]:
            self._evictable[g].move_to_end(page)

    def _incref(self, g: int, page: int) -> None:
        if self._ref[g][page] == 0:
            del self._evictable[g][page]
            self._evictable_in[self.pool.large_of(g, page)] -= 1
        self._ref[g][page] += 1

    def _decref(self, g: int, page: int) -> None:
        self._ref[g][page] -= 1
        if self._ref[g][page] == 0:
            if page in self._entry_node[g]:
                self._make_evictable(g, page)
            else:
                self.pool.release(g, page)

    def _drop(self, req: _Request) -> None:
        # Tail first, so the least shareable pages are the first evicted (LRU order).
        for g in range(self.num_groups):
            for p in reversed(req.tables[g]):
                if p != PAD_PAGE:
                    self._decref(g, p)
            req.tables[g] = []

    # ------------------------------------------------------------------ invariants (tests)

    def check_invariants(self) -> None:
        """Recount every page from scratch and assert the books balance."""
        self.pool.check()
        G = self.num_groups
        refs = [dict() for _ in range(G)]
        for req in self._requests.values():
            for g in range(G):
                for i, p in enumerate(req.tables[g]):
                    if p == PAD_PAGE:
                        assert i < req.released[g], "a released page index above the release mark"
                        continue
                    refs[g][p] = refs[g].get(p, 0) + 1
                if self.policies[g].kind == LINEAR:
                    assert len(req.tables[g]) == 1, "one live state slot per request"
                else:
                    assert len(req.tables[g]) * self.page_tokens >= req.num_tokens
                    assert all(p == PAD_PAGE for p in req.tables[g][: req.released[g]])
        evictable_in = [0] * self.pool.num_large
        for g in range(G):
            for p, r in enumerate(self._ref[g]):
                assert r == refs[g].get(p, 0), f"group {g} page {p}: ref {r} != {refs[g].get(p, 0)} holders"
            cached = self._entry_node[g]
            assert set(self._evictable[g]) == {p for p in cached if self._ref[g][p] == 0}
            for p in self._evictable[g]:
                evictable_in[self.pool.large_of(g, p)] += 1
            held = set(refs[g]) | set(cached)
            assert self.pool.num_taken_small(g) == len(held), f"group {g}: leaked or double-held pages"
            for p in held:
                L = self.pool.large_of(g, p)
                assert self.pool.group_of_large(L) == g, f"group {g} page {p} lies in a foreign large page"
        assert evictable_in == self._evictable_in
        for node in self._nodes.values():
            assert node.entries, "a node without entries"
            for g, p in node.entries.items():
                assert self._entry_node[g].get(p) is node
            if node.depth > 0 and any(g in node.entries for g in self._full_groups):
                up = self._nodes.get(node.parent)
                assert up is not None and all(g in up.entries for g in self._full_groups), "full chain broken"
        for g in range(G):
            for p, node in self._entry_node[g].items():
                assert self._nodes.get(node.key) is node and node.entries.get(g) == p
