"""Llama-family models vs Hugging Face transformers on tiny random configs (fp32, paged KV)."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, hf_greedy, hf_logits, ours_from_hf, tiny_hf_model

# Lengths straddle page boundaries (page_size 4) and exceed the sliding window (8).
PROMPTS = [
    [1, 17, 42, 99, 5, 230, 7, 64, 12, 150, 33, 8, 71, 200, 3, 91, 45, 18, 260],
    [1, 250, 4, 4, 19],
    [1, 88, 120, 7, 56, 290, 14, 3, 77, 101, 9, 66, 240, 31, 2, 180, 55, 123, 11, 92, 47, 6, 199, 13, 70, 28],
]

CASES = {
    "llama": dict(kind="llama"),
    "llama_tied": dict(kind="llama", tie_word_embeddings=True),
    "llama3_rope": dict(
        kind="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rope_theta=500000.0,
    ),
    "qwen2_bias": dict(kind="qwen2"),
    "qwen2_window_layers": dict(
        kind="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen3_qk_norm": dict(kind="qwen3"),
    "mistral_window": dict(kind="mistral", sliding_window=8),
}


def _hf(case: str):
    spec = dict(CASES[case])
    return tiny_hf_model(spec.pop("kind"), **spec)


def _check_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), f"max abs error {err} vs max |logit| {ref.abs().max().item()}"


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_hf(case, tmp_path):
    hf = _hf(case)
    model, _ = ours_from_hf(hf, tmp_path)
    logits = PagedRunner(model).step(list(enumerate(PROMPTS)))
    ref = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    _check_close(logits, ref)


@pytest.mark.parametrize("case", ["mistral_window", "qwen2_window_layers"])
def test_sliding_window_is_really_applied(case, tmp_path):
    """The window must change HF's logits for these prompt lengths, and ours must follow HF, not the
    full-attention model with the same weights."""
    hf = _hf(case)
    spec = dict(CASES[case])
    kind = spec.pop("kind")
    spec["sliding_window"] = None
    if kind == "qwen2":
        spec["use_sliding_window"] = False
    full = tiny_hf_model(kind, **spec)  # same shapes, no window; then the same weights
    full.load_state_dict(hf.state_dict())
    prompt = PROMPTS[0]
    ref, ref_full = hf_logits(hf, prompt), hf_logits(full, prompt)
    window = hf.config.sliding_window
    # Inside the window the two agree; past it the windowed model differs clearly.
    torch.testing.assert_close(ref[:window], ref_full[:window])
    assert (ref[window:] - ref_full[window:]).abs().max() > 1e-2 * ref.abs().max()

    model, _ = ours_from_hf(hf, tmp_path)
    ours = PagedRunner(model).step([(0, prompt)])
    _check_close(ours, ref)


@pytest.mark.parametrize("case", ["llama_tied", "qwen2_bias", "qwen3_qk_norm", "mistral_window"])
def test_greedy_decode_matches_hf_generate(case, tmp_path):
    hf = _hf(case)
    model, _ = ours_from_hf(hf, tmp_path)
    ours = PagedRunner(model, num_pages=64).greedy(PROMPTS, 32)
    for prompt, got in zip(PROMPTS, ours):
        assert got == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("case", ["llama3_rope", "mistral_window", "qwen3_qk_norm"])
def test_chunked_prefill_matches_full_prefill(case, tmp_path):
    """Prefill in 2-3 chunks on top of the cached prefix, with sequences at different stages in one
    step (one of them decoding), and compare every token's logits with HF's single forward."""
    hf = _hf(case)
    model, _ = ours_from_hf(hf, tmp_path)
    runner = PagedRunner(model)
    a, b, c = PROMPTS
    pieces: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    steps = [
        [(0, a[:7]), (1, b[:3])],
        [(1, b[3:]), (0, a[7:13]), (2, c[:10])],
        [(2, c[10:21]), (0, a[13:])],
        [(2, c[21:])],
    ]
    for step in steps:
        logits = runner.step(step)
        for seq_id, chunk in step:
            pieces[seq_id].append(logits[: len(chunk)])
            logits = logits[len(chunk) :]
    for seq_id, prompt in enumerate(PROMPTS):
        _check_close(torch.cat(pieces[seq_id]), hf_logits(hf, prompt))


def test_mixed_decode_and_prefill_step(tmp_path):
    """A single-token step of one sequence beside a prefill of another (prefill path with q_len 1)."""
    hf = _hf("qwen3_qk_norm")
    model, _ = ours_from_hf(hf, tmp_path)
    runner = PagedRunner(model)
    a, c = PROMPTS[0], PROMPTS[2]
    runner.step([(0, a[:-1])])
    logits = runner.step([(0, a[-1:]), (1, c)])
    _check_close(logits[:1], hf_logits(hf, a)[-1:])
    _check_close(logits[1:], hf_logits(hf, c))
