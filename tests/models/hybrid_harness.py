"""Shared helpers of the hybrid-model tests: prefill logits through the engine's own runner."""

import torch
from paged_harness import hf_greedy, hf_logits  # noqa: F401  (re-exported for the hybrid tests)

from infercore import SamplingParams


@torch.inference_mode()
def engine_prefill_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Admit ``prompts`` into ``engine`` as one batch, run its runner's metadata and the model over
    every prompt token, and return fp32 logits ``[len(prompt), vocab]`` per prompt. The requests
    are aborted afterwards (their pages are freed)."""
    rids = [engine.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch.requests] == rids
    assert batch.num_new_tokens == [len(p) for p in prompts], "prompts must fit one step"
    runner = engine.runner
    if hasattr(runner, "apply_state_copies"):
        runner.apply_state_copies()
    input_ids, positions, meta, _ = runner.prepare(batch)
    hidden = engine.model(input_ids, positions, runner.kv_caches, meta)
    logits = engine.model.compute_logits(hidden)
    for rid in rids:
        engine.abort(rid)
    return list(logits.split([len(p) for p in prompts]))
