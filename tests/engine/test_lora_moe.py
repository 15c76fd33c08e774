"""Multi-LoRA on sparse-MoE models against PEFT: adapters on the routed experts (PEFT's ``target_parameters`` on
transformers 5's stacked expert tensors, and the per-expert module form of transformers 4 checkpoints), on Qwen2-MoE's
shared expert and on the attention; each request's greedy tokens equal PEFT's model with its adapter, in mixed
batches, eager and through the CUDA-graph runner's path."""

import numpy as np
import peft
import pytest
import torch
from engine_helpers import hf_greedy
from safetensors.torch import save_file
from test_lora import _save_adapter

from infercore import Engine, SamplingParams
from infercore.lora import load_lora_adapter
from infercore.models import load_model

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1,
              eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip


def _tiny(kind):
    import transformers as tf

    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=6,
                                num_experts_per_tok=3, shared_expert_intermediate_size=24, mlp_only_layers=[1])
        cls = tf.Qwen2MoeForCausalLM
    else:
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # greedy choices far from ties
    return model


def _peft(hf, path, *, seed, modules=(), params=(), r=4, alpha=8):
    """The PEFT model (unmerged) of a random adapter on ``modules`` and the stacked expert tensors ``params``."""
    return _save_adapter(hf, path, r=r, alpha=alpha, targets=modules, params=list(params), seed=seed, std=0.4,
                         merge=False)


def _ours(hf, tmp_path, device="cpu"):
    d = tmp_path / "base"
    hf.save_pretrained(d, safe_serialization=True)
    model, _, _ = load_model(d, dtype=torch.float32, device=device)
    return model


def _prompts():
    return [[(5 * i + 3 * j) % 96 for j in range(4 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_lora")
    base = _tiny("qwen3_moe")
    state = {k: v.clone() for k, v in base.state_dict().items()}
    refs = {}
    specs = {"experts": dict(params=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], seed=1),
             "down": dict(params=["mlp.experts.down_proj"], modules=["q_proj", "o_proj"], seed=2, r=8, alpha=4),
             # PEFT turns target_modules naming the experts' projections into target_parameters (gate_up at rank 2r)
             "modules": dict(modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], seed=3),
             # attention only: its slot is not live in the experts' LoRA (their kernels skip its pairs)
             "attn": dict(modules=["q_proj", "o_proj"], seed=4)}
    for name, spec in specs.items():
        hf = _tiny("qwen3_moe")
        hf.load_state_dict(state)
        refs[name] = _peft(hf, d / name, **spec)
    return base, refs, d


def test_target_parameters_are_read_per_expert(qwen3):
    """PEFT's stacked-expert layout: expert e's pair is ``A.view(E, r, in)[e]`` and ``B.view(out, r, E)[..., e]``;
    the merged delta equals PEFT's own ``get_delta_weight``."""
    _, refs, d = qwen3
    a = load_lora_adapter(d / "experts")
    assert {m for _, m in a.weights} == {"experts.gate_proj", "experts.up_proj", "experts.down_proj"}
    wrapper = refs["experts"].base_model.model.model.layers[1].mlp.experts
    want_down = wrapper.get_delta_weight("default")  # [E, H, I]
    want_gu = wrapper.base_layer.get_delta_weight("default")  # [E, 2I, H]
    A, B = a.weights[(1, "experts.down_proj")]
    torch.testing.assert_close(torch.bmm(B, A), want_down.float())
    Ag, Bg = a.weights[(1, "experts.gate_proj")]
    Au, Bu = a.weights[(1, "experts.up_proj")]
    torch.testing.assert_close(torch.cat([torch.bmm(Bg, Ag), torch.bmm(Bu, Au)], 1), want_gu.float())
    assert a.rank == 4 and load_lora_adapter(d / "down").rank == 8
    m = load_lora_adapter(d / "modules")  # rank_pattern / alpha_pattern: gate_up at 2r, 2 alpha (the same scaling)
    assert m.rank == 8 and m.weights[(0, "experts.gate_proj")][0].shape == (8, 8, 32)
    assert m.weights[(0, "experts.down_proj")][0].shape == (8, 4, 16)


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_batch_matches_peft(qwen3, tmp_path, graphs):
    """Five prompts, each under an adapter on the experts, on the experts' down projections and attention, on the
    attention and (PEFT's conversion of ``target_modules``) the experts, on attention only, or none, in one batch
    (two slots for four adapters): greedy tokens equal PEFT's.
    ``graphs``: the CUDA-graph runner's path on the CPU (captured graphs replayed eagerly: LoRA on for every row,
    the slots read from the staged buffer by the experts too)."""
    from engine_helpers import EagerGraph, with_fake_graphs

    from infercore.engine.graph_runner import CUDAGraphRunner

    base, refs, d = qwen3
    eng = Engine(_ours(base, tmp_path), page_size=4, num_pages=256, max_num_seqs=8, max_loras=2, max_lora_rank=8)
    for name in refs:
        eng.add_lora(name, d / name)
    replays = []
    if graphs:
        gr = with_fake_graphs(eng, CUDAGraphRunner, max_batch=8, buckets=(1, 2, 4))
        lora = eng.lora

        class Captured(EagerGraph):
            def replay(self):
                lora.capturing()
                replays.append(self.b)
                super().replay()

        for b in gr.buckets:
            gr.graphs[b] = Captured(gr, b)
    prompts = _prompts() + [[(7 * j + 2) % 96 for j in range(70)]]  # > 64 tokens: the per-adapter GEMM path
    loras = ["experts", None, "down", "modules", "attn"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=loras)
    assert not graphs or replays
    for p, la, o in zip(prompts, loras, outs):
        ref = base if la is None else refs[la]
        assert o.token_ids == hf_greedy(ref, p, 8), la
        if la is not None:
            assert o.token_ids != hf_greedy(base, p, 8), la


def _per_expert_state(peft_model, kind):
    """The same adapter written in the per-expert module form (transformers 4 checkpoints: one LoRA per expert's
    gate / up / down projection; Mixtral's w1 / w3 / w2), from the stacked wrappers' factors."""
    out = {}
    E = peft_model.base_model.model.config.num_local_experts if kind == "mixtral" else \
        peft_model.base_model.model.config.num_experts
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if kind == "mixtral" else None
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        w = getattr(layer.mlp, "experts", None)
        if not isinstance(w, peft.tuners.lora.ParamWrapper):
            continue
        for wrapper, param in ((w, "down_proj"), (w.base_layer, "gate_up_proj")):
            A, B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
            r = A.shape[0] // E
            A = A.reshape(E, r, -1)
            B = B.reshape(B.shape[0], r, E).permute(2, 0, 1)
            for e in range(E):
                if param == "down_proj":
                    parts = {"down_proj": (A[e], B[e])}
                else:
                    half = B.shape[1] // 2
                    parts = {"gate_proj": (A[e], B[e, :half]), "up_proj": (A[e], B[e, half:])}
                for proj, (a, b) in parts.items():
                    name = names[proj] if names else proj
                    pre = f"base_model.model.model.layers.{i}.{block}.experts.{e}.{name}"
                    out[f"{pre}.lora_A.weight"] = a.detach().clone().contiguous()
                    out[f"{pre}.lora_B.weight"] = b.detach().clone().contiguous()
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_per_expert_modules_and_shared_expert_match_peft(kind, tmp_path):
    """Mixtral (w1 / w3 / w2 per expert) and Qwen2-MoE (gate / up / down per expert, plus its shared expert's
    modules, a dense layer between): the per-expert form answers as PEFT's stacked-parameter model does."""
    base = _tiny(kind)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    hf = _tiny(kind)
    hf.load_state_dict(state)
    modules = ["q_proj"] + (["gate_proj", "up_proj", "down_proj"] if kind == "qwen2_moe" else [])
    ref = _peft(hf, tmp_path / "stacked", params=["gate_up_proj", "down_proj"], modules=modules, seed=5)
    # the per-expert copy: the stacked wrappers' factors per expert, beside the same module adapters
    import json

    from safetensors.torch import load_file

    stacked = load_file(tmp_path / "stacked" / "adapter_model.safetensors")
    per = {k: v for k, v in stacked.items() if ".experts." not in k}
    per.update(_per_expert_state(ref, kind))
    (tmp_path / "per").mkdir()
    save_file(per, tmp_path / "per" / "adapter_model.safetensors")
    cfg = json.loads((tmp_path / "stacked" / "adapter_config.json").read_text())
    cfg["target_parameters"] = None
    (tmp_path / "per" / "adapter_config.json").write_text(json.dumps(cfg))
    a = load_lora_adapter(tmp_path / "per")
    want = {"experts.gate_proj", "experts.up_proj", "experts.down_proj", "q_proj"}
    if kind == "qwen2_moe":
        want |= {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "gate_proj",
                 "up_proj", "down_proj"}  # the dense layer's MLP
    assert {m for _, m in a.weights} == want
    eng = Engine(_ours(base, tmp_path), page_size=4, num_pages=128, max_loras=2, max_lora_rank=4)
    eng.add_lora("stacked", tmp_path / "stacked")
    eng.add_lora("per", tmp_path / "per")
    prompts = _prompts()
    loras = ["per", "stacked", None, "per"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=loras)
    for p, la, o in zip(prompts, loras, outs):
        assert o.token_ids == hf_greedy(base if la is None else ref, p, 8), la
        if la is not None:
            assert o.token_ids != hf_greedy(base, p, 8)


def test_moe_lora_errors(qwen3, tmp_path):
    """An adapter with more experts than the model, or the wrong expert width, is refused when added and leaves
    nothing registered; a target-parameter wrapper that the config does not name is refused at load."""
    import json

    from safetensors.torch import load_file

    base, _, d = qwen3
    eng = Engine(_ours(base, tmp_path), page_size=4, num_pages=64, max_loras=1, max_lora_rank=8)
    st = load_file(d / "experts" / "adapter_model.safetensors")
    cfg = json.loads((d / "experts" / "adapter_config.json").read_text())
    for what, fix in (("experts", lambda k, v: torch.cat([v, v], 0 if "lora_A" in k else 1)),  # 16 experts of 8
                      ("width", lambda k, v: v[:, :-1] if "lora_A" in k and "base_layer" not in k else v)):
        bad = tmp_path / what
        bad.mkdir()
        save_file({k: f(k, v).contiguous() for k, v in st.items() for f in (fix,)}, bad / "adapter_model.safetensors")
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="experts"):
            eng.add_lora(what, bad)
    assert eng.list_loras() == []
    # a layer's target-parameter wrapper that target_parameters does not name cannot be placed
    one = tmp_path / "one"
    one.mkdir()
    save_file({k: v for k, v in st.items() if "base_layer" not in k}, one / "adapter_model.safetensors")
    (one / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": None}))
    with pytest.raises(ValueError, match="target-parameter"):
        load_lora_adapter(one)
    (one / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": ["mlp.experts.down_proj"]}))
    assert {m for _, m in load_lora_adapter(one).weights} == {"experts.down_proj"}


def test_experts_kept_on_the_host_take_no_adapter(qwen3, tmp_path):
    """Experts offloaded to the host (``offload_experts_``) have no LoRA slots: an expert adapter is refused with the
    reason, an attention-only one still loads."""
    from infercore.lora import LoRAAdapter
    from infercore.offload import offload_experts_

    base, _, d = qwen3
    model = _ours(base, tmp_path)
    offload_experts_(model, device="cpu")
    eng = Engine(model, page_size=4, num_pages=64, max_loras=1, max_lora_rank=8)
    assert (1, "experts") not in eng.lora.layers
    with pytest.raises(ValueError, match="no experts that take LoRA"):
        eng.add_lora("experts", d / "experts")
    full = load_lora_adapter(d / "down")
    eng.add_lora("attn", LoRAAdapter("attn", {k: v for k, v in full.weights.items() if not k[1].startswith("experts")}))
    assert eng.list_loras() == ["attn"]


def test_slots_hold_each_adapters_experts(qwen3, tmp_path):
    """The experts' slot rows: slot s of expert e at row s * E + e; an adapter's A / B copied there (zeros past its
    rank), zeros where its adapter has no expert weights."""
    base, _, d = qwen3
    eng = Engine(_ours(base, tmp_path), page_size=4, num_pages=64, max_loras=2, max_lora_rank=8)
    eng.add_lora("experts", d / "experts")
    eng.add_lora("down", d / "down")
    lin = eng.lora.layers[(1, "experts")]
    a = load_lora_adapter(d / "experts")
    s, E = eng.lora.slots["experts"], lin.num_experts
    A, B = a.weights[(1, "experts.down_proj")]
    np.testing.assert_allclose(lin.a_down[s * E : (s + 1) * E, :4].numpy(), A.numpy())
    np.testing.assert_allclose(lin.b_down[s * E : (s + 1) * E, :, :4].numpy(), B.numpy())
    assert not lin.a_down[s * E : (s + 1) * E, 4:].any()
    o = eng.lora.slots["down"]  # its experts' down projections only
    assert not lin.a_gate_up[o * E : (o + 1) * E].any() and not lin.b_gate_up[o * E : (o + 1) * E].any()
    assert lin.a_down[o * E : (o + 1) * E].any()


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_moe_adapters_on_cuda_match_peft(qwen3, tmp_path, async_scheduling):
    """On CUDA (fp32): decode steps replay the captured graphs (the experts' LoRA through the routed Triton kernels'
    extras, slots from the staged buffer), prefills take the grouped kernels; greedy tokens equal PEFT's."""
    base, refs, d = qwen3
    model = _ours(base, tmp_path, "cuda")
    eng = Engine(model, page_size=16, num_pages=256, max_num_batched_tokens=128, max_num_seqs=8, max_loras=2,
                 max_lora_rank=8, async_scheduling=async_scheduling)
    assert eng.graph_runner is not None and eng.graph_runner.graphs
    for name in refs:
        eng.add_lora(name, d / name)
    prompts = _prompts() + [[(7 * j + 2) % 96 for j in range(90)], [3, 4, 5]]
    loras = ["experts", None, "down", "modules", "experts", "down"]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), lora=loras)
    for p, la, o in zip(prompts, loras, outs):
        assert o.token_ids == hf_greedy(base if la is None else refs[la], p, 16), la
