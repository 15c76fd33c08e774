"""Shared pieces of the model-family tests that compare a tiny transformers checkpoint with the Engine: random
prompts, the module-scoped checkpoints of a test file's kinds, and the batched / chunked greedy run with a prefix-cache
hit."""

from __future__ import annotations

import random
from collections.abc import Callable

from paged_harness import hf_greedy

from infercore import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 30, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def save_checkpoints(tmp_path_factory, kinds, tiny: Callable) -> dict:
    """``{kind: (hf model, checkpoint dir)}``: ``tiny(kind)`` of every kind, saved with ``save_pretrained``."""
    out = {}
    for kind in kinds:
        hf = tiny(kind)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        out[kind] = hf, str(path)
    return out


def check_batched_greedy_and_prefix_hit(hf, path: str, kv: dict, *, cached: int, varied: bool = True,
                                        invariants: bool = True) -> None:
    """Three prompts of different lengths in one batch, prefilled in 11-token chunks beside the others' decodes, give
    transformers' greedy tokens; the first (21 tokens) again gets ``cached`` tokens from the prefix cache (whole pages,
    or a recurrent state's last checkpoint) and the same tokens. ``varied``: the outputs are not one repeated token."""
    eng = Engine.from_pretrained(path, max_num_batched_tokens=11, **kv)
    ps = random_prompts(3, seed=2, lo=6, hi=28)
    ps[0] = random_prompts(1, seed=3, lo=21, hi=21)[0]
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    if varied:
        assert len({t for o in outs for t in o.token_ids}) > 8
    again = eng.generate([ps[0]], GREEDY)[0]
    assert again.metrics.num_cached_tokens == cached
    assert again.token_ids == outs[0].token_ids
    if invariants:
        eng.block_manager.check_invariants()


__all__ = ["GREEDY", "check_batched_greedy_and_prefix_hit", "random_prompts", "save_checkpoints"]
