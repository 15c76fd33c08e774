"""How a hybrid model's KV memory is cut: layer groups, small pages and large pages.

Layers with identical specs form a *group*; the group is the unit of allocation (one block table
or one state slot per request per group), and a *small page* of a group holds one page of
``page_tokens`` tokens -- or one state -- for every layer of the group.

Two modes, for side-by-side comparison:

* ``"multi"`` (Jenga): every group keeps its natural small-page size; a *large page* is the least
  common multiple of the small-page sizes, so any large page can be carved into small pages of any
  one group without a gap. If that LCM is unreasonably large (above ``max_large_page_bytes``),
  small pages are padded to a common granule that keeps the LCM small at the least padding.
  Given the pool size (``budget_bytes``), the large page is chosen to minimize the expected waste:
  padding, plus the budget's remainder modulo the large page, plus about one partly used large
  page per group (see :mod:`.pool`). A large page that is coarse relative to the pool -- the
  147 MiB LCM of Qwen3-Next-80B in a 1 GiB pool -- is then replaced by a granule of the largest
  small page, at ~0.25% padding of the state page.
* ``"uniform"`` (the common baseline): one page size for every layer. Token pages of
  ``page_tokens`` tokens, enlarged to a multiple of ``page_tokens`` until one layer's token page
  can hold one layer's state when the model has linear layers (the vLLM-style "inflated block");
  every layer's page -- and every state -- is padded to that size. Sliding layers keep their full
  history (the managers treat them as full attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..block_manager import _check_count
from .spec import (
    FULL,
    LINEAR,
    SLIDING,
    LayerSpec,
    LinearStateSpec,
    bytes_per_state,
    bytes_per_token,
    normalize_spec,
    spec_kind,
)

MODES = ("multi", "uniform")


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one spec, and how one small page of them is laid out.

    Attributes:
        index: position in :attr:`HybridKVLayout.groups`.
        kind: ``"full"``, ``"sliding"`` or ``"linear"`` -- the spec's kind. (In uniform mode the
            managers treat sliding groups as full; ``kind`` still says what the layers are.)
        spec: the normalized spec shared by the layers.
        layers: model layer indices, ascending.
        dtype: resolved cache dtype of token kinds (None for linear).
        useful_bytes_per_layer: bytes one layer really needs per small page: ``page_tokens *
            bytes_per_token`` for token kinds, the state size for linear.
        layer_stride: bytes reserved per layer inside a small page (``>= useful_bytes_per_layer``;
            larger only in uniform mode).
        small_bytes: bytes of one small page, including any padding; divides the large page.
    """

    index: int
    kind: str
    spec: LayerSpec
    layers: tuple[int, ...]
    dtype: torch.dtype | None
    useful_bytes_per_layer: int
    layer_stride: int
    small_bytes: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def useful_bytes(self) -> int:
        """Useful bytes of one small page (all layers)."""
        return self.useful_bytes_per_layer * len(self.layers)

    @property
    def window(self) -> int | None:
        return getattr(self.spec, "window", None)


@dataclass(frozen=True)
class HybridKVLayout:
    """Groups, page sizes and the large-page size of one model's KV memory.

    Build with :meth:`build`. ``page_tokens`` is shared by every token group, so token position
    ``p`` lives in page ``p // page_tokens`` of every attention group; ``checkpoint_interval`` (a
    multiple of ``page_tokens``) is the spacing of the linear-state checkpoints that serve prefix
    hits for recurrent layers.
    """

    mode: str
    page_tokens: int
    groups: tuple[LayerGroup, ...]
    large_bytes: int
    checkpoint_interval: int
    num_layers: int

    @classmethod
    def build(
        cls,
        specs: Sequence[object],
        *,
        page_tokens: int = 16,
        mode: str = "multi",
        dtype: torch.dtype = torch.bfloat16,
        max_large_page_bytes: int | None = None,
        checkpoint_interval: int | None = None,
        budget_bytes: int | None = None,
    ) -> HybridKVLayout:
        """Lay out the KV memory of a model with per-layer ``specs``.

        Args:
            specs: one spec per layer (:class:`FullAttentionSpec`, :class:`SlidingWindowSpec`,
                :class:`LinearStateSpec`).
            page_tokens: tokens per small page of the attention groups (multi mode) or the base
                that uniform mode enlarges.
            mode: ``"multi"`` or ``"uniform"`` (see the module docstring).
            dtype: cache dtype of attention specs whose ``dtype`` is None.
            max_large_page_bytes: cap on the large page in multi mode; default ``16 *`` the
                largest small page, or ``budget_bytes`` when given. Above it small pages are
                padded to a common granule.
            checkpoint_interval: tokens between linear-state checkpoints (a multiple of the page
                size). Default: the fewest pages whose attention KV outweighs one checkpoint, so
                checkpoints at most double the cached bytes per cached token.
            budget_bytes: the pool size the layout is for (multi mode). When given, the large
                page (within the cap) minimizes padding + budget remainder + one large page per
                group; when None, the least padding wins (the natural LCM if it fits the cap).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens <= 0:
            raise ValueError(f"page_tokens must be a positive int, got {page_tokens!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence) or len(specs) == 0:
            raise ValueError("specs must be a non-empty sequence of layer specs")
        norm = [normalize_spec(s, name=f"specs[{i}]") for i, s in enumerate(specs)]
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0
        ):
            raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
        if max_large_page_bytes is not None and (
            isinstance(max_large_page_bytes, bool)
            or not isinstance(max_large_page_bytes, int)
            or max_large_page_bytes <= 0
        ):
            raise ValueError(f"max_large_page_bytes must be a positive int or None, got {max_large_page_bytes!r}")

        # Group identical specs (resolved dtype included), ordered by first layer.
        keyed: dict[object, list[int]] = {}
        for i, s in enumerate(norm):
            key = s if isinstance(s, LinearStateSpec) else (s, s.dtype or dtype)
            keyed.setdefault(key, []).append(i)
        members = list(keyed.values())

        def useful(s: LayerSpec, tokens: int) -> int:
            if isinstance(s, LinearStateSpec):
                return bytes_per_state(s)
            return tokens * bytes_per_token(s, default_dtype=dtype)

        has_linear = any(isinstance(s, LinearStateSpec) for s in norm)
        token_specs = [s for s in norm if not isinstance(s, LinearStateSpec)]

        if mode == "uniform":
            tokens = page_tokens
            if has_linear and token_specs:
                state = max(bytes_per_state(s) for s in norm if isinstance(s, LinearStateSpec))
                smallest = min(bytes_per_token(s, default_dtype=dtype) for s in token_specs)
                tokens = page_tokens * math.ceil(state / (smallest * page_tokens))
            stride = max(useful(s, tokens) for s in norm)
            strides = [stride] * len(members)
            page_tokens = tokens
        else:
            strides = [useful(norm[m[0]], page_tokens) for m in members]
        raw_small = [stride * len(m) for stride, m in zip(strides, members)]

        if mode == "uniform":
            small, large = raw_small, _lcm(raw_small)
        else:
            # Without a budget, a generous cap: the natural LCM of real models is a few times the
            # largest page (5x for Gemma-3-27B's 52 sliding + 10 global layers), and padding a
            # page to dodge it costs up to ~15% of every request. With a budget, the waste
            # estimate of _fit_large_page decides, so only the budget itself bounds the page.
            if max_large_page_bytes is not None:
                cap = max_large_page_bytes
            else:
                cap = 16 * max(raw_small) if budget_bytes is None else max(budget_bytes, max(raw_small))
            if cap < max(raw_small):
                raise ValueError(f"max_large_page_bytes={cap} is below the largest small page ({max(raw_small)} bytes)")
            small, large = _fit_large_page(raw_small, cap, budget_bytes)

        groups = []
        for g, (m, stride, sb) in enumerate(zip(members, strides, small)):
            s = norm[m[0]]
            kind = spec_kind(s)
            groups.append(
                LayerGroup(
                    index=g,
                    kind=kind,
                    spec=s,
                    layers=tuple(m),
                    dtype=None if kind == LINEAR else (s.dtype or dtype),
                    useful_bytes_per_layer=useful(s, page_tokens),
                    # Padding from the large-page fit goes at the end of the small page.
                    layer_stride=stride,
                    small_bytes=sb,
                )
            )

        if checkpoint_interval is None:
            checkpoint_interval = page_tokens
            state_bytes = sum(g.useful_bytes for g in groups if g.kind == LINEAR)
            kv_page = sum(g.useful_bytes for g in groups if g.kind != LINEAR)
            if mode == "multi" and state_bytes and kv_page:
                checkpoint_interval = page_tokens * max(1, math.ceil(state_bytes / kv_page))
        elif (
            isinstance(checkpoint_interval, bool)
            or not isinstance(checkpoint_interval, int)
            or checkpoint_interval <= 0
            or checkpoint_interval % page_tokens
        ):
            raise ValueError(
                f"checkpoint_interval must be a positive multiple of the page size {page_tokens}, "
                f"got {checkpoint_interval!r}"
            )
        return cls(mode, page_tokens, tuple(groups), large, checkpoint_interval, len(norm))

    # ------------------------------------------------------------------ derived sizes

    def smalls_per_large(self, group: int) -> int:
        return self.large_bytes // self._group(group).small_bytes

    def num_large_pages(self, budget_bytes: int) -> int:
        """Large pages that fit in ``budget_bytes``."""
        _check_count("budget_bytes", budget_bytes, minimum=0)
        return budget_bytes // self.large_bytes

    def group_of_layer(self, layer: int) -> LayerGroup:
        if isinstance(layer, bool) or not isinstance(layer, int):  # 1.0 in a tuple of ints would match layer 1
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        for g in self.groups:
            if layer in g.layers:
                return g
        raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")

    @property
    def token_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.kind != LINEAR)

    @property
    def linear_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.kind == LINEAR)

    def effective_kind(self, group: int) -> str:
        """The policy a group is managed with: uniform mode keeps sliding layers' full history."""
        kind = self._group(group).kind
        return FULL if (kind == SLIDING and self.mode == "uniform") else kind

    def needed_bytes(self, num_tokens: int) -> int:
        """The least memory a request of ``num_tokens`` tokens needs: every token of full layers,
        the last ``window`` tokens of sliding layers, one state per linear layer (no padding)."""
        _check_count("num_tokens", num_tokens, minimum=0)
        total = 0
        for g in self.groups:
            spec = g.spec
            if g.kind == LINEAR:
                total += bytes_per_state(spec) * g.num_layers
            else:
                n = num_tokens if g.kind == FULL else min(num_tokens, g.window)
                total += n * bytes_per_token(spec, default_dtype=g.dtype) * g.num_layers
        return total

    def _group(self, group: int) -> LayerGroup:
        # A negative index would silently pick a group from the end.
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise ValueError(f"group must be in [0, {len(self.groups)}), got {group!r}")
        return self.groups[group]


def _lcm(sizes: Sequence[int]) -> int:
    out = 1
    for s in sizes:
        out = out * s // math.gcd(out, s)
    return out


def _fit_large_page(sizes: list[int], cap: int, budget: int | None = None) -> tuple[list[int], int]:
    """Small-page sizes (padded if needed) and their LCM, the large page, with LCM <= cap.

    Granule candidates: each size times a small power of two (pad every page to a multiple of one
    group's page) and powers of two (pad to an alignment; small ones leave the sizes unpadded, so
    the natural LCM is a candidate). Without ``budget`` the least relative padding wins (the
    natural LCM whenever it fits). With it, the expected waste fraction wins:

        max relative padding + (budget % LCM + len(sizes) * LCM) / budget

    -- the remainder of the budget that is no whole large page, plus one partly used large page
    per group (the pool strands less than that per group during admission; a worst case, so the
    estimate leans to finer pages when padding them is nearly free).
    """
    large = _lcm(sizes)
    if large <= cap and budget is None:
        return list(sizes), large
    candidates = {s << k for s in sizes for k in range(6)} | {1 << k for k in range(8, 40)}
    best: tuple[float, int, list[int]] | None = None
    for u in sorted(candidates):
        padded = [-(-s // u) * u for s in sizes]
        lcm = _lcm(padded)
        if lcm > cap:
            continue
        waste = max((p - s) / p for p, s in zip(padded, sizes))
        if budget is not None:
            waste += (budget % lcm + len(sizes) * lcm) / budget
        if best is None or (waste, lcm) < (best[0], best[1]):
            best = (waste, lcm, padded)
    if best is None:  # unreachable: u = max(sizes) pads everything to one size, LCM = max <= cap
        raise ValueError(f"no large page of at most {cap} bytes fits small pages {sizes}")
    return best[2], best[1]
