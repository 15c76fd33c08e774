"""Bad submissions raise a ValueError/TypeError naming the argument, and never leave the engine broken."""

import pytest
import torch

from infercore import Engine, SamplingParams
from infercore.engine.engine import EngineConfig

SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture
def eng(llama_pair):
    return Engine(llama_pair[1], num_pages=64)


def assert_idle_and_working(eng):
    """Nothing was queued, and the engine still serves a request."""
    assert not eng.has_unfinished() and not eng.requests
    (out,) = eng.generate([[1, 2, 3]], SHORT)
    assert out.finished and len(out.token_ids) == 2


@pytest.mark.parametrize(
    "field, value",
    [("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", 2**63), ("top_k", 2**31),
     pytest.param("top_k", 10**5000, id="top_k-too-long-to-print")],
)
def test_seed_and_top_k_outside_the_runner_dtypes_are_rejected(eng, field, value):
    # the runner stores seeds as int64 and the sampler top_k as int32
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
    p = SamplingParams(max_tokens=2)
    setattr(p, field, value)  # changed after construction: add_request checks again
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        eng.add_request([1, 2], p)
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        eng.generate([[1, 2]], p)
    assert_idle_and_working(eng)


def test_seed_and_top_k_at_the_dtype_limits_run(eng):
    for kw in (dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(top_k=2**31 - 1)):
        (out,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True, **kw))
        assert len(out.token_ids) == 2
    assert not eng.has_unfinished()


def test_a_bad_prompt_in_generate_queues_none_of_the_batch(eng):
    with pytest.raises(ValueError, match="prompt"):
        eng.generate([[1, 2], [1, 500]], SHORT)  # 500 is outside the vocabulary
    with pytest.raises(TypeError, match="params"):
        eng.generate([[1, 2], [3, 4]], [SHORT, "greedy"])
    assert_idle_and_working(eng)


def test_params_changed_after_submission_do_not_reach_the_request(eng):
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rid = eng.add_request([1, 2, 3], p)
    p.seed, p.stop_token_ids = 2**63, None
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 2


def test_automatic_ids_skip_ids_the_caller_chose(eng):
    assert eng.add_request([1, 2], SHORT, request_id="0") == "0"
    auto = eng.add_request([1, 2], SHORT)
    assert auto != "0"
    assert eng.add_request([1, 2], SHORT, request_id=int(auto) + 1) == str(int(auto) + 1)
    assert eng.add_request([1, 2], SHORT) not in ("0", auto, str(int(auto) + 1))
    with pytest.raises(ValueError, match="request_id '0' is already in use"):
        eng.add_request([1, 2], SHORT, request_id="0")
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert len(done) == 4


def test_generate_waits_for_its_own_requests_not_earlier_ones(eng):
    eng.add_request([1, 2], SamplingParams(max_tokens=1, ignore_eos=True))  # ends first
    (out,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.finished
    assert not eng.has_unfinished()


def test_engine_arguments_are_checked(llama_pair):
    model = llama_pair[1]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        Engine("x")
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(model, config={"num_pages": 8})
    with pytest.raises(TypeError, match="num_pages"):  # would have been ignored
        Engine(model, config=EngineConfig(num_pages=64), num_pages=8)
    with pytest.raises(ValueError, match="model has no parameters"):
        Engine(torch.nn.Module())
    with pytest.raises(ValueError, match="EngineConfig.page_size"):
        Engine(model, num_pages=8, page_size=True)


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(gpu_memory_fraction="a"), TypeError),
        (dict(gpu_memory_fraction=0.0), ValueError),
        (dict(page_size=True), ValueError),
        (dict(num_pages=False), ValueError),
        (dict(cuda_graph_max_batch=-1), ValueError),
        (dict(cuda_graph_max_batch=1.5), ValueError),
        (dict(enable_prefix_caching="no"), TypeError),
        (dict(async_scheduling=1), TypeError),
    ],
)
def test_bad_engine_config_names_the_field(kw, err):
    (name,) = kw
    with pytest.raises(err, match=f"EngineConfig.{name}"):
        EngineConfig(**kw)
    cfg = EngineConfig()
    setattr(cfg, name, kw[name])
    with pytest.raises(err, match=f"EngineConfig.{name}"):
        cfg.validate()


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(stop=None), TypeError),
        (dict(stop=5), TypeError),
        (dict(stop_token_ids=5), TypeError),
        (dict(stop_token_ids=None), TypeError),
        (dict(stop_token_ids=[True]), ValueError),
        (dict(stop_token_ids=[-1]), ValueError),
        (dict(temperature=10**400), ValueError),
        (dict(temperature=10**5000), ValueError),
        (dict(temperature=1e39), ValueError),  # finite, but not as the fp32 the runner keeps
        (dict(repetition_penalty=-(10**400)), ValueError),
        (dict(min_tokens=10**5000), ValueError),
    ],
)
def test_bad_sampling_param_types_and_ranges_name_the_field(kw, err):
    (name,) = kw
    with pytest.raises(err, match=f"SamplingParams.{name}"):
        SamplingParams(**kw)


def test_generate_names_bad_prompts_and_takes_any_single_prompt(eng):
    with pytest.raises(TypeError, match="prompts must be"):
        eng.generate(5)
    with pytest.raises(TypeError, match="prompt must be"):
        eng.generate([[True, 2]])  # bool is not a token id
    with pytest.raises(TypeError, match="prompt must be"):
        eng.add_request(torch.tensor([True, False]))
    assert not eng.has_unfinished()
    ref = eng.generate([1, 2, 3], SHORT)[0].token_ids
    assert eng.generate((1, 2, 3), SHORT)[0].token_ids == ref
    assert eng.generate(torch.tensor([1, 2, 3]), SHORT)[0].token_ids == ref
    assert [o.token_ids for o in eng.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), SHORT)] == [ref, ref]


@pytest.mark.parametrize(("device", "err"), [("bogus", ValueError), (3.5, TypeError)])
def test_from_pretrained_names_a_bad_device_before_loading(device, err):
    with pytest.raises(err, match="device"):
        Engine.from_pretrained("/nonexistent/checkpoint", device=device)


@pytest.mark.parametrize(("path", "quantization", "err", "match"), [
    ("/nonexistent/checkpoint", "gguf", ValueError, "not a GGUF file"),
    ("/nonexistent/model.gguf", "w4a16-g9", ValueError, "w4a16-g9"),
    ("/nonexistent/model.gguf", "w8a8-smooth", ValueError, "needs calibration"),
    ("/nonexistent/model.gguf", "w4a16-g128-gptq", ValueError, "needs calibration"),
    ("/nonexistent/model.gguf", 4, TypeError, "quantization"),
])
def test_from_pretrained_names_a_bad_quantization_before_loading(path, quantization, err, match):
    with pytest.raises(err, match=match) as e:
        Engine.from_pretrained(path, device="cpu", quantization=quantization)
    assert "quantization" in str(e.value)
