import math

import pytest
import torch

from infercore.ops import SamplingTensors, apply_repetition_penalty, apply_top_k_top_p_min_p, sample

NEG = float("-inf")


def _params(b, **kw):
    kw.setdefault("temperature", [1.0] * b)
    return SamplingTensors.from_lists(**kw)


def test_greedy_rows_take_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = sample(logits, _params(6, temperature=[0.0] * 6, top_k=[3] * 6, seeds=list(range(6))))
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_greedy_rows_unaffected_by_sampling_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 30, dtype=torch.bfloat16)
    out = sample(logits, _params(4, temperature=[0.0, 1.5, 0.0, 2.0], seeds=[1, 2, 3, 4]))
    assert out[0] == logits[0].float().argmax() and out[2] == logits[2].float().argmax()


def test_top_k_one_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(8, 100)
    out = sample(logits, _params(8, temperature=[5.0] * 8, top_k=[1] * 8, seeds=list(range(8))))
    assert torch.equal(out, logits.argmax(-1))


def test_seeded_reproducible_and_independent_of_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, 64)
    kw = dict(
        temperature=[1.0, 0.7, 1.3, 1.0, 0.9],
        top_p=[1.0, 0.9, 1.0, 0.8, 1.0],
        seeds=[11, 22, 33, 44, 55],
        offsets=[0, 3, 7, 1, 2],
    )
    full = sample(logits, SamplingTensors.from_lists(**kw))
    assert torch.equal(full, sample(logits, SamplingTensors.from_lists(**kw)))
    # Each row alone, and the batch reversed, give the same tokens.
    for i in range(5):
        one = SamplingTensors.from_lists(**{k: [v[i]] for k, v in kw.items()})
        assert sample(logits[i : i + 1], one).item() == full[i].item()
    rev = SamplingTensors.from_lists(**{k: v[::-1] for k, v in kw.items()})
    assert torch.equal(sample(logits.flip(0), rev), full.flip(0))


def test_seed_and_offset_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: any change of the noise changes the token (almost surely)
    draws = {sample(logits, _params(1, seeds=[s], offsets=[o])).item() for s in range(4) for o in range(4)}
    assert len(draws) >= 12
    # (seed, offset+1) must not replay (seed+1, offset): the streams are mixed, not added.
    a = sample(logits, _params(1, seeds=[5], offsets=[1])).item()
    b = sample(logits, _params(1, seeds=[6], offsets=[0])).item()
    assert a != b


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    temp = 0.8
    n = 4000
    params = SamplingTensors.from_lists(temperature=[temp] * n, seeds=[7] * n, offsets=list(range(n)))
    tokens = sample(logits.expand(n, -1), params)
    counts = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(logits.double() / temp, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (counts, expected)  # chi-square, 4 dof: p ~ 4e-4


def test_empirical_distribution_respects_top_k():
    logits = torch.tensor([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    n = 3000
    params = SamplingTensors.from_lists(
        temperature=[1.0] * n, top_k=[3] * n, seeds=[1] * n, offsets=list(range(n))
    )
    counts = torch.bincount(sample(logits.expand(n, -1), params), minlength=6).double()
    assert counts[3:].sum() == 0
    expected = torch.softmax(logits[:3].double(), -1) * n
    assert (((counts[:3] - expected) ** 2) / expected).sum() < 18.4  # 2 dof, p ~ 1e-4


def test_top_p_hand_computed():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    ones = torch.ones(1)
    kill = lambda keep: torch.tensor([[v if k else NEG for v, k in zip(logits[0].tolist(), keep)]])  # noqa: E731
    # mass before each token (descending): 0, .5, .7, .85, .95
    for top_p, keep in [
        (0.5, [1, 0, 0, 0, 0]),
        (0.6, [1, 1, 0, 0, 0]),
        (0.7, [1, 1, 0, 0, 0]),
        (0.71, [1, 1, 1, 0, 0]),
        (0.9, [1, 1, 1, 1, 0]),
        (1.0, [1, 1, 1, 1, 1]),
        (0.01, [1, 0, 0, 0, 0]),
    ]:
        out = apply_top_k_top_p_min_p(logits, torch.zeros(1, dtype=torch.int32), ones * top_p, torch.zeros(1))
        assert torch.equal(out, kill(keep)), (top_p, out)


def test_top_k_then_top_p_renormalizes_and_min_p():
    # Shuffled order so the scatter back to vocabulary positions is exercised.
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    z = torch.zeros(1)
    # top-k=3 keeps .4,.3,.15 -> renormalized .47,.35,.18;
    # top-p .8 keeps the first two (the mass before .18 is .82)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([3], dtype=torch.int32), torch.tensor([0.8]), z)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    # min-p 0.3: threshold 0.3 * 0.4 = 0.12 -> keep .4, .3, .15
    out = apply_top_k_top_p_min_p(
        logits, torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.tensor([0.3])
    )
    assert torch.isfinite(out).tolist() == [[False, True, False, True, True]]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    # min-p 1.0 keeps only the max; 0 keeps all
    out = apply_top_k_top_p_min_p(logits, torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.ones(1))
    assert torch.isfinite(out).sum() == 1 and torch.isfinite(out[0, 1])
    out = apply_top_k_top_p_min_p(logits, torch.zeros(1, dtype=torch.int32), torch.ones(1), z)
    assert torch.equal(out, logits)


def test_top_k_keeps_ties_and_zero_or_large_k_is_off():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    one, z = torch.ones(1), torch.zeros(1)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2], dtype=torch.int32), one, z)
    assert torch.isfinite(out).tolist() == [[True, False, True, True, False]]
    for k in (0, 5, 99):
        assert torch.equal(
            apply_top_k_top_p_min_p(logits, torch.tensor([k], dtype=torch.int32), one, z), logits
        )


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [1.0, 1.0, 1.0, 1.0, -1.0]])
    prev = torch.tensor([[0, 1, 1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    out = apply_repetition_penalty(logits, prev, torch.tensor([2.0, 1.5]))
    expected = torch.tensor([[1.0, -2.0, 0.5, -3.0, 1.0], [1.0, 1.0, 1.0, 1.0, -1.5]])
    assert torch.equal(out, expected)
    # Compare with HF's processor on the first row.
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 1]]), logits[:1].clone())
    assert torch.equal(out[:1], hf)


def test_repetition_penalty_applies_to_greedy():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    prev = torch.tensor([[0]], dtype=torch.int32)
    p = _params(1, temperature=[0.0], repetition_penalty=[2.0])
    assert sample(logits, p, prev_tokens=prev).item() == 1
    assert sample(logits, p).item() == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
    ],
)
def test_bad_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingTensors.from_lists(**{"temperature": [1.0], field: [value]})
    good = _params(1)
    setattr(good, field, torch.tensor([value], dtype=getattr(good, field).dtype))
    with pytest.raises(ValueError, match=f"sample: {field}"):
        sample(torch.randn(1, 10), good)


def test_sample_layout_errors_name_the_argument():
    p = _params(2)
    with pytest.raises(ValueError, match="sample: logits"):
        sample(torch.randn(10), p)
    with pytest.raises(TypeError, match="sample: logits"):
        sample(torch.ones(2, 10, dtype=torch.int64), p)
    with pytest.raises(ValueError, match="sample: params has 2 rows"):
        sample(torch.randn(3, 10), p)
    with pytest.raises(TypeError, match="sample: params"):
        sample(torch.randn(2, 10), {"temperature": 1.0})
    with pytest.raises(TypeError, match="sample: prev_tokens"):
        sample(torch.randn(2, 10), p, prev_tokens=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sample: prev_tokens"):
        sample(torch.randn(2, 10), p, prev_tokens=torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="SamplingTensors: top_k"):
        SamplingTensors(
            temperature=torch.ones(2),
            top_k=torch.zeros(2),
            top_p=torch.ones(2),
            min_p=torch.zeros(2),
            repetition_penalty=torch.ones(2),
            seeds=torch.zeros(2, dtype=torch.int64),
            offsets=torch.zeros(2, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="SamplingTensors: seeds"):
        SamplingTensors.from_lists(temperature=[1.0, 1.0], seeds=[1])
