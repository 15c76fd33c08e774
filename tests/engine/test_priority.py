"""The scheduler's priority policy: requests run by (priority, arrival); a better-ranked arrival preempts worse running
requests for pages or sequence slots; nothing is lost and no output changes (random arrivals too)."""

import pytest
from engine_helpers import ours_from_hf, serving, tiny_hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import model, reference

from infercore import Engine, SamplingParams
from infercore.engine.scheduler import Scheduler

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _finish_order(eng):
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    return order


def test_queue_runs_by_priority_then_arrival():
    eng = Engine(model(), page_size=4, num_pages=64, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio in (("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", -5)):
        eng.add_request([1, 2, 3], SP, request_id=rid, priority=prio)
    assert _finish_order(eng) == ["e", "b", "d", "c", "a"]
    fcfs = Engine(model(), page_size=4, num_pages=64, max_num_seqs=1)
    for rid, prio in (("a", 3), ("b", 1), ("c", 2)):
        fcfs.add_request([1, 2, 3], SP, request_id=rid, priority=prio)
    assert _finish_order(fcfs) == ["a", "b", "c"]  # FCFS ignores priorities


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_urgent_arrival_preempts_for_slots_and_pages(async_scheduling):
    """Two long low-priority requests fill the sequence slots (then the pages); an urgent one arriving later is
    admitted at once by preempting the worst of them, finishes first, and every output is unchanged."""
    hf = tiny_hf("llama", num_hidden_layers=1)
    long = [[(3 * j + 1) % 96 for j in range(20)], [(5 * j + 2) % 96 for j in range(20)]]
    urgent = [7, 8, 9, 10]
    sp_long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # slots: both taken; pages: after 4 steps the two hold 2 x 6 pages of 4 tokens, the whole pool
    for kw in (dict(max_num_seqs=2, num_pages=64), dict(max_num_seqs=8, num_pages=12)):
        eng = Engine(ours_from_hf(hf), page_size=4, scheduling_policy="priority", async_scheduling=async_scheduling,
                     **kw)
        displaced = []
        orig = eng.scheduler._displace
        eng.scheduler._displace = lambda req, batch, d=displaced, f=orig: d.append(f(req, batch)) or d[-1]
        eng.add_request(long[0], sp_long, request_id="low0", priority=5)
        eng.add_request(long[1], sp_long, request_id="low1", priority=6)
        outs = {}
        for _ in range(4):
            for o in eng.step():
                outs[o.request_id] = o
        eng.add_request(urgent, SP, request_id="urgent", priority=0)
        order = []
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
                if o.finished:
                    order.append(o.request_id)
        assert order[0] == "urgent", (kw, order)
        assert any(d is not None for d in displaced), kw  # admitted by displacing, not by waiting
        assert outs["low1"].metrics.num_preemptions >= 1, kw  # the worst-ranked made room
        assert outs["urgent"].token_ids == reference(tuple(urgent), 6)
        for i in range(2):
            assert outs[f"low{i}"].token_ids == reference(tuple(long[i]), 24)


def test_errors():
    with pytest.raises(ValueError, match="scheduling_policy"):
        Engine(model(), page_size=4, num_pages=16, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="policy"):
        Scheduler(None, max_num_seqs=1, max_num_batched_tokens=8, policy="x")
    eng = Engine(model(), page_size=4, num_pages=16, scheduling_policy="priority")
    with pytest.raises(TypeError, match="priority"):
        eng.add_request([1, 2], priority=1.5)
    with pytest.raises(ValueError, match="priority has 1 entries"):
        eng.generate([[1, 2], [3, 4]], priority=[1])


request = st.tuples(
    st.lists(st.integers(0, 7), min_size=1, max_size=24),
    st.integers(1, 12),  # max_tokens
    st.integers(0, 4),  # arrival step
    st.integers(-2, 2),  # priority
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request, min_size=1, max_size=6), num_pages=st.integers(9, 40), budget=st.integers(4, 48),
       max_seqs=st.integers(1, 5), caching=st.booleans(), async_scheduling=st.booleans())
def test_random_priorities_finish_everything_unchanged(reqs, num_pages, budget, max_seqs, caching, async_scheduling):
    eng = Engine(model(), page_size=4, num_pages=num_pages, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                 enable_prefix_caching=caching, async_scheduling=async_scheduling, scheduling_policy="priority")
    pending = sorted(((at, i) for i, (_, _, at, _) in enumerate(reqs)))
    finished, step = {}, 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            i = pending.pop(0)[1]
            prompt, n, _, prio = reqs[i]
            eng.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                            request_id=f"r{i}", priority=prio)
        for o in eng.step():
            assert o.request_id not in finished
            if o.finished:
                finished[o.request_id] = o.token_ids
        step += 1
        assert step < 3000, "no progress"
    assert eng.block_manager.num_free_pages == num_pages, "pages leaked"
    for i, (prompt, n, _, _) in enumerate(reqs):
        assert finished[f"r{i}"] == reference(tuple(prompt), n)


def test_server_takes_a_priority():
    with serving(Engine(model(), page_size=4, num_pages=64, scheduling_policy="priority")) as call:
        req = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        status, body = call("POST", "/v1/completions", {**req, "priority": -3})
        assert status == 200 and [int(t) for t in body["choices"][0]["logprobs"]["tokens"]] == reference((1, 2, 3), 4)
        status, body = call("POST", "/v1/completions", {**req, "priority": "high"})
        assert status == 400 and body["error"]["param"] == "priority"
