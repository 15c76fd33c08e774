"""Random arrivals, lengths, aborts and pool sizes through the real scheduler and a tiny model."""

from engine_helpers import ours_from_hf, tiny_hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infercore import Engine, SamplingParams

_MODEL = None
_REF: dict[tuple, list[int]] = {}


def model():
    global _MODEL
    if _MODEL is None:
        _MODEL = ours_from_hf(tiny_hf("llama", num_hidden_layers=1))
    return _MODEL


def reference(prompt: tuple, n: int) -> list[int]:
    key = (prompt, n)
    if key not in _REF:
        eng = Engine(model(), page_size=4, num_pages=256)
        _REF[key] = eng.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[
            0].token_ids
    return _REF[key]


def drive(eng: Engine, arrivals: list[tuple[int, str, tuple, int]], aborts: dict[str, int] | None = None,
          max_steps: int = 3000) -> tuple[dict[str, list[int]], set[str]]:
    """Step ``eng`` until it is idle: ``arrivals`` ``(step, request_id, prompt, max_tokens)`` are added
    at their step (greedy, ``ignore_eos``), ``aborts`` ``{request_id: step}`` aborted then unless
    finished. Checks every step that no request finishes twice and that running requests hold no more
    pages than the pool has. Returns the finished requests' tokens and the aborted ids."""
    bm, aborts = eng.block_manager, aborts or {}
    pending = sorted(arrivals, key=lambda a: a[0])  # stable: same-step arrivals in list order
    added: set[str] = set()
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, n = pending.pop(0)
            eng.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=rid)
            added.add(rid)
        for rid, at in aborts.items():
            if at == step and rid in added and rid not in finished and rid not in aborted:
                eng.abort(rid)
                aborted.add(rid)
        for out in eng.step():
            assert out.request_id not in finished, "a request finished twice"
            if out.finished:
                finished[out.request_id] = out.token_ids
        held = {p for r in eng.scheduler.running for p in bm.block_table(r.request_id)}
        assert len(held) + bm.num_free_pages <= bm.num_pages, "pool accounting"
        step += 1
        assert step < max_steps, "scheduler made no progress"
    assert set(finished) | aborted == added
    return finished, aborted


request = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=24),  # small alphabet: prefixes repeat
    st.integers(1, 12),  # max_tokens
    st.integers(0, 4),  # arrival step
    st.one_of(st.none(), st.integers(0, 6)),  # abort at step (None: never)
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(request, min_size=1, max_size=6),
    num_pages=st.integers(9, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 5),
    caching=st.booleans(),
)
def test_every_request_finishes_no_page_leaks_outputs_unchanged(reqs, num_pages, budget, max_seqs, caching):
    eng = Engine(model(), page_size=4, num_pages=num_pages, max_num_batched_tokens=budget,
                 max_num_seqs=max_seqs, enable_prefix_caching=caching)
    arrivals = [(at, f"r{i}", tuple(prompt), n) for i, (prompt, n, at, _) in enumerate(reqs)]
    aborts = {f"r{i}": ab for i, (_, _, _, ab) in enumerate(reqs) if ab is not None}
    finished, _ = drive(eng, arrivals, aborts, max_steps=2000)
    assert eng.block_manager.num_free_pages == num_pages, "pages leaked"
    for _, rid, prompt, n in arrivals:
        if rid in finished:
            assert finished[rid] == reference(prompt, n), "preemption/caching/chunking changed an output"


long_request = st.tuples(
    st.integers(0, 2),  # which shared prefix (prefix-cache hits across requests)
    st.lists(st.integers(0, 95), min_size=0, max_size=60),  # suffix
    st.integers(1, 8),  # max_tokens
    st.integers(0, 6),  # arrival step
)
PREFIXES = [[(7 * i + 3 * j) % 96 for j in range(40 + 20 * i)] for i in range(3)]  # 40-80 tokens


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(long_request, min_size=1, max_size=5),
    num_pages=st.integers(36, 90),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 5),
    caching=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_long_chunked_prompts_finish_with_unchanged_outputs(reqs, num_pages, budget, max_seqs, caching,
                                                            async_scheduling):
    # Prompts of 40-140 tokens (10-35 pages of 4, more than the host block table's first 16 columns),
    # chunked, preempted and cache-hit; every output equals the request run alone, no page leaks.
    eng = Engine(model(), page_size=4, num_pages=num_pages, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                 enable_prefix_caching=caching, async_scheduling=async_scheduling)  # fmt: skip
    arrivals = [(at, f"r{i}", tuple(PREFIXES[which] + suffix), n) for i, (which, suffix, n, at) in enumerate(reqs)]
    finished, _ = drive(eng, arrivals)
    assert eng.block_manager.num_free_pages == num_pages, "pages leaked"
    for _, rid, prompt, n in arrivals:
        assert finished[rid] == reference(prompt, n), "preemption/caching/chunking changed an output"
