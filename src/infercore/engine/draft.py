"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes each decoding request's
next ``k`` tokens, greedily, and the target verifies them in one forward (``engine/speculative.py`` explains the
verification: sample, then compare, which keeps the target's output exactly what it would be without drafts).

The draft model keeps its own paged KV pool. Each target request has a *shadow* request in it whose tokens follow
the target's: before proposing, a shadow's computed prefix is cut back to where its tokens still agree with the
target's (the drafts the target rejected are dropped), the tokens it has not seen are fed in one chunk, and ``k - 1``
single-token steps follow; every shadow of the step runs in the same batched forwards. A shadow whose target has
left the running set is freed; one the draft pool cannot hold proposes nothing this step.
"""

from __future__ import annotations

import torch

from ..kv import BlockManager, allocate_kv_caches
from .params import SamplingParams
from .request import Request
from .runner import ModelRunner
from .scheduler import ScheduledBatch

_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelProposer:
    """Greedy drafts from ``model`` (an infercore model of the target's vocabulary, on the target's device) over a
    KV pool of ``num_pages`` pages of ``page_size`` tokens."""

    def __init__(self, model: torch.nn.Module, *, num_pages: int, page_size: int, device: torch.device) -> None:
        param = next(model.parameters())
        self.model = model
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        kv = allocate_kv_caches(model.kv_specs(), num_pages, page_size, dtype=param.dtype, device=device)
        self.runner = ModelRunner(model, kv, self.bm, device=device)
        self.shadows: dict[str, Request] = {}
        self.proposed = 0  # draft tokens proposed so far (the target's metrics count the accepted ones)

    def _free(self, rid: str) -> None:
        sh = self.shadows.pop(rid)
        self.bm.free(rid)
        self.runner.release(sh)

    def propose(self, wanted: list[tuple[Request, int]], running: list[Request]) -> None:
        """Set ``spec_token_ids`` of each ``(request, k)`` of ``wanted`` (``k >= 1``, the request's last token not
        computed yet) to its draft of up to ``k`` tokens; free the shadows of requests no longer in ``running``."""
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.shadows if rid not in live]:
            self._free(rid)
        jobs: list[tuple[Request, Request, int]] = []
        for req, k in wanted:
            tokens = req.all_token_ids
            rid = req.request_id
            sh = self.shadows.get(rid)
            if sh is None:
                if not self.bm.can_allocate(len(tokens) + k):
                    continue
                sh = Request(rid, list(tokens), _GREEDY)
                if self.bm.allocate(rid, tokens, len(tokens) + k, max_cached_tokens=0) is None:
                    continue
                self.shadows[rid] = sh
            else:
                keep = min(sh.num_computed_tokens, _common_prefix(sh._all, tokens))
                sh._all[:] = tokens
                sh.num_computed_tokens = keep
                if not self.bm.grow(rid, len(tokens) + k):
                    self._free(rid)
                    continue
            jobs.append((req, sh, k))
        if not jobs:
            return
        # round 0: each shadow catches up on what it has not seen and samples its first draft token
        batch = ScheduledBatch([sh for _, sh, _ in jobs], [sh.num_tokens - sh.num_computed_tokens for _, sh, _ in jobs])
        active = jobs
        for step in range(max(k for _, _, k in jobs)):
            sampled = self.runner.execute(batch)
            for sh, n in zip(batch.requests, batch.num_new_tokens):
                sh.num_computed_tokens += n
            nxt = []
            for req, sh, k in active:
                token = sampled[sh]
                req.spec_token_ids.append(token)
                sh._all.append(token)
                if step + 1 < k:
                    nxt.append((req, sh, k))
            active = nxt
            if not active:
                break
            batch = ScheduledBatch([sh for _, sh, _ in active], [1] * len(active))
        self.proposed += sum(len(req.spec_token_ids) for req, _, _ in jobs)
