"""Triton sampler against the reference (CPU interpreter).

The random streams differ (Philox on the device vs. the reference's CPU generator), so the checks
are: greedy rows exact, the sampled support inside (and, with balanced logits, equal to) the
reference's filtered support, and the empirical distribution close to the filtered probabilities.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402
from infercore.ops.sampling import SamplingTensors, apply_top_k_top_p_min_p  # noqa: E402


def _sample(logits, params, prev=None):
    return implementation("sample", "triton")(logits, params, prev_tokens=prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_matches_reference(dtype):
    B, V = 6, 300  # V > one interpreter block (256 after capping? no: 512) exercises the chunked argmax
    logits = (torch.randn(B, V) * 3).to(dtype)
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1  # tie: the first occurrence wins
    prev = torch.tensor([[1, 5, -1], [-1, -1, -1], [3, 3, 9], [0, 7, 8], [2, -1, -1], [4, 4, 4]])
    params = SamplingTensors.from_lists(
        temperature=[0.0] * B, repetition_penalty=[1.0, 1.3, 2.0, 0.7, 1.1, 5.0]
    )
    got = _sample(logits, params, prev)
    want = implementation("sample", "reference")(logits, params, prev_tokens=prev)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[2].item() == 17


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, -1.0]])
    params = SamplingTensors.from_lists(temperature=[0.0], repetition_penalty=[2.0])
    assert _sample(logits, params, torch.tensor([[0]])).item() == 1  # 5/2 < 4


def _balanced_logits(V, top, gen):
    """A few near-equal leading logits (each kept token is drawn often) above a random tail."""
    row = torch.rand(V, generator=gen) - 3.0
    lead = torch.randperm(V, generator=gen)[:top]
    row[lead] = torch.linspace(1.0, 0.6, top)
    return row


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 3, 1.0, 0.0), (0.7, 0, 0.6, 0.0), (1.5, 5, 0.9, 0.7)],
)
def test_support_and_distribution(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(1)
    N, V = 96, 40
    row = _balanced_logits(V, 6, gen)
    logits = row.expand(N, V).contiguous()
    params = SamplingTensors.from_lists(
        temperature=[temperature] * N, top_k=[top_k] * N, top_p=[top_p] * N, min_p=[min_p] * N,
        seeds=list(range(N)), offsets=[11] * N,
    )  # fmt: skip
    filtered = apply_top_k_top_p_min_p(
        row[None] / temperature, params.top_k[:1], params.top_p[:1], params.min_p[:1]
    )
    probs = filtered.softmax(-1)[0]
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    assert 2 <= len(support) < V  # the case really filters

    got = _sample(logits, params)
    drawn = set(got.tolist())
    assert drawn == support
    ref_drawn = set(implementation("sample", "reference")(logits, params).tolist())
    assert ref_drawn <= support
    freq = torch.bincount(got, minlength=V).double() / N
    # 4.5 standard deviations of a binomial proportion: fails for a wrong distribution, not by chance.
    sigma = (probs.double() * (1 - probs.double()) / N).sqrt()
    assert ((freq - probs.double()).abs() <= 4.5 * sigma + 1e-9).all(), (freq, probs)


def test_randomness_is_a_function_of_seed_and_offset():
    gen = torch.Generator().manual_seed(2)
    V = 32
    rows = torch.randn(4, V, generator=gen)
    params = SamplingTensors.from_lists(temperature=[1.0] * 4, seeds=[7, 7, 8, 9], offsets=[3, 3, 3, 4])
    a = _sample(rows, params)
    # Same (seed, offset, logits) in another batch position and batch: same token.
    perm = torch.tensor([1, 0, 3, 2])
    params_p = SamplingTensors.from_lists(temperature=[1.0] * 4, seeds=[7, 7, 9, 8], offsets=[3, 3, 4, 3])
    b = _sample(rows[perm], params_p)
    assert torch.equal(a[perm], b)
    # A different offset changes the draw for at least one of several rows.
    flat = torch.zeros(8, V)
    p0 = SamplingTensors.from_lists(temperature=[1.0] * 8, seeds=list(range(8)), offsets=[0] * 8)
    p1 = SamplingTensors.from_lists(temperature=[1.0] * 8, seeds=list(range(8)), offsets=[1] * 8)
    assert not torch.equal(_sample(flat, p0), _sample(flat, p1))


def test_parallel_first_pass_matches_the_sequential_scan():
    # One or two rows of a vocabulary several blocks long: the first pass runs over slices in
    # parallel (``_argmax_parts_kernel``); greedy picks and the top-k bracket must not change.
    from infercore.ops.sampling import triton as ts

    V = 3000
    assert ts._parts(1, V, 1024, torch.device("cpu")) == 2 and ts._parts(2, V, 1024, torch.device("cpu")) == 2
    assert ts._parts(3, V, 1024, torch.device("cpu")) == 0  # enough rows: one program per row scans
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=gen)
    logits[0, 2900] = logits[0, 40] = 9.0  # a tie across slices: the first occurrence wins
    logits[1, :] = float("-inf")
    logits[1, 2999] = 0.5  # the maximum in the last block of the last slice
    logits[1, 1] = 0.5 - 1e-3
    greedy = SamplingTensors.from_lists(temperature=[0.0, 0.0])
    got = _sample(logits, greedy)
    assert got.tolist() == [40, 2999]
    assert torch.equal(got, implementation("sample", "reference")(logits, greedy))
    everything_masked = torch.full((1, V), float("-inf"))
    assert _sample(everything_masked, SamplingTensors.from_lists(temperature=[0.0])).item() == 0
    # top-k brackets start from the slices' smallest finite value and maximum
    row = torch.randn(V, generator=gen)
    top = torch.topk(row, 4).indices
    params = SamplingTensors.from_lists(temperature=[1.0, 1.0], top_k=[1, 4], seeds=[5, 6])
    drawn = [set(), set()]
    for off in range(40):
        params.offsets.fill_(off)
        a, b = _sample(torch.stack([row, row]), params).tolist()
        drawn[0].add(a)
        drawn[1].add(b)
    assert drawn[0] == {int(top[0])}
    assert drawn[1] <= set(top.tolist()) and len(drawn[1]) >= 2


def test_parallel_first_pass_top_p_total_mass():
    # top-p without top-k measures the mass above the smallest finite value, which comes from the
    # slices' minima: slice 0 holds the 4 largest logits and a tail at -1, slice 1 (from 2048) sits
    # at 0. Mass: 4 e^2 = 29.6, slice 0's tail 752, slice 1 952; top_p 0.02 of all of it (34.7)
    # needs slice 1 too. (Had the tail been left out, 0.02 of the rest would keep the top 4 only.)
    V = 3000
    row = torch.zeros(V)
    row[:2048] = -1.0
    row[[3, 70, 900, 2000]] = 2.0
    params = SamplingTensors.from_lists(temperature=[1.0], top_p=[0.02], seeds=[1])
    drawn = set()
    for off in range(20):
        params.offsets.fill_(off)
        drawn.add(_sample(row[None].clone(), params).item())
    assert any(t >= 2048 for t in drawn), drawn
