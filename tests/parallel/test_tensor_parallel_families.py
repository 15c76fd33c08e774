"""Tensor / expert parallelism of the families added after the first layouts (gloo, two CPU processes). DeepSeek:
each rank keeps half of the query heads of the latent attention (its rows of q_proj / q_b_proj and kv_b_proj,
o_proj's columns; the latent cache whole) and a slice of every expert, or half of the experts whole; the shared
experts by width. GPT-OSS: half of the heads with their sinks, every biased expert by width (interleaved gate / up
pairs) or half of them whole. Then Granite 4.0 hybrid, Nemotron-H and Falcon-H1, and OLMo 2, Phi-3, Granite 3 and
Gemma 2. Tokens equal transformers' greedy ones on every rank, through prefill, chunked prefill with split-off
decodes and decode."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, HERE)

WORLD = 2


def _same_tokens_everywhere(eng, hf, prompts, n: int, rank: int, tag) -> None:
    """Greedy ``n`` tokens of ``prompts`` through ``eng`` on this rank: equal on every rank, and to transformers'."""
    from paged_harness import hf_greedy

    from infercore import SamplingParams

    outs = [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, outs)
    assert everyone[0] == everyone[1], tag
    if rank == 0:
        assert outs == [hf_greedy(hf, p, n) for p in prompts], tag


def _worker(rank: int, init: str, path: str) -> None:
    from dist_helpers import _leave
    from paged_harness import ours_from_hf
    from test_deepseek import PROMPTS, tiny
    from test_gpt_oss import PROMPTS as OSS_PROMPTS
    from test_gpt_oss import tiny_gpt_oss

    from infercore import Engine
    from infercore.parallel import RowParallel, tensor_parallel_

    torch.set_num_threads(1)
    layouts = [("v2_lite", "tp"), ("v2", "ep"), ("v3", "tp"), ("v3", "ep")]
    hfs = {kind: tiny(kind) for kind in ("v2_lite", "v2", "v3")}
    models = {lay: ours_from_hf(hfs[lay[0]], os.path.join(path, f"{lay[0]}-{lay[1]}-{rank}"))[0] for lay in layouts}
    oss = tiny_gpt_oss()
    oss_models = [ours_from_hf(oss, os.path.join(path, f"oss{i}-{rank}"))[0] for i in range(2)]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        for kind, experts in layouts:
            hf = hfs[kind]
            model = tensor_parallel_(models[kind, experts], experts=experts)
            attn = model.model.layers[0].self_attn
            assert attn.num_heads == hf.config.num_attention_heads // WORLD
            assert isinstance(attn.o_proj, RowParallel)
            moe = model.model.layers[-1].mlp
            assert isinstance(moe, RowParallel)
            E = hf.config.n_routed_experts
            if experts == "ep":
                assert moe.linear.experts.down_proj.shape[0] == E // WORLD
            else:
                assert moe.linear.experts.down_proj.shape[2] == hf.config.moe_intermediate_size // WORLD
            eng = Engine(model, page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=12)
            _same_tokens_everywhere(eng, hf, PROMPTS, 8, rank, (kind, experts))
        for experts, model in zip(("tp", "ep"), oss_models):
            model = tensor_parallel_(model, experts=experts)
            attn = model.model.layers[0].self_attn
            assert attn.num_heads == oss.config.num_attention_heads // WORLD and attn.sinks.shape == (attn.num_heads,)
            ex = model.model.layers[0].mlp.linear.experts
            E, width = oss.config.num_local_experts, oss.config.intermediate_size
            if experts == "tp":
                assert ex.down_proj.shape[:2] == (E, width // WORLD) and ex.expert_offset is None
            else:
                assert ex.down_proj.shape[:2] == (E // WORLD, width) and ex.expert_offset == rank * E // WORLD
            eng = Engine(model, page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=12)
            _same_tokens_everywhere(eng, oss, OSS_PROMPTS, 8, rank, experts)
    finally:
        _leave()


def test_deepseek_and_gpt_oss_over_two_ranks(tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=WORLD, join=True)


def _hybrid_worker(rank: int, init: str, path: str) -> None:
    """Granite 4.0 hybrid (Mamba2 mixers, attention, experts + the ungated shared MLP, or the shared MLP alone),
    Nemotron-H (Mamba2, NoPE attention, squared-ReLU MLP and latent MoE blocks) and Falcon-H1 (attention beside the
    mixer, muP multipliers, gated norms split by group or summed over the ranks) over two ranks on the hybrid pool:
    transformers' greedy tokens through chunked prefill."""
    import test_falcon_h1 as falcon
    import test_granite_hybrid as granite
    import test_nemotron_h as nemotron
    from dist_helpers import _leave
    from family_harness import random_prompts
    from paged_harness import ours_from_hf

    from infercore import Engine
    from infercore.parallel import RowParallel, tensor_parallel_

    torch.set_num_threads(1)
    # Falcon-H1 with one group and a gated norm: its mean square summed over the ranks (before and after the gate)
    falcon.KINDS["one_group_before"] = dict(falcon.MUP, mamba_rms_norm=True, mamba_norm_before_gate=True,
                                            mamba_n_groups=1)  # fmt: skip
    falcon.KINDS["one_group_after"] = dict(falcon.MUP, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                           mamba_n_groups=1, mamba_proj_bias=True)  # fmt: skip
    cases = [(granite, "moe_rope", "tp"), (granite, "moe_rope", "ep"), (granite, "dense_nope", "tp"),
             (nemotron, "pattern", "tp"), (nemotron, "moe", "tp"), (nemotron, "moe", "ep"), (nemotron, "wide", "tp"),
             *[(falcon, kind, "tp") for kind in ("mup_norm", "plain", "norm_before_gate", "one_group_before",
                                                 "one_group_after")]]  # fmt: skip
    hfs = {(m.__name__, kind): m.tiny(kind) for m, kind, _ in cases}
    models = [ours_from_hf(hfs[m.__name__, kind], os.path.join(path, f"{m.__name__}-{kind}-{ex}-{rank}"))[0]
              for m, kind, ex in cases]  # fmt: skip
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        prompts = random_prompts(3, seed=2, lo=6, hi=24)
        for (mod, kind, experts), model in zip(cases, models):
            hf = hfs[mod.__name__, kind]
            tensor_parallel_(model, experts=experts)
            if mod is nemotron:  # "M-M*-M", "ME*EM", "M*M-": layer 1 an MLP or MoE block, layer 0 a mixer
                assert isinstance(model.backbone.layers[1 if kind != "wide" else 3].mixer, RowParallel)
                if kind == "moe":
                    ex = model.backbone.layers[1].mixer.linear.experts
                    E = hf.config.n_routed_experts
                    whole = experts == "ep"
                    assert ex.up_proj.shape[0] == (E // WORLD if whole else E)
                    assert ex.expert_offset == (rank * E // WORLD if whole else None)
                assert model.backbone.layers[0].mixer.H == hf.config.mamba_num_heads // WORLD
            elif mod is falcon:
                layer = model.model.layers[0]
                assert layer.mamba.H == hf.config.mamba_n_heads // WORLD
                assert layer.self_attn.num_heads == hf.config.num_attention_heads // WORLD
                assert (layer.mamba.norm_reduce is not None) == kind.startswith("one_group")
            else:
                layers = model.model.layers
                assert layers[0].mamba.H == hf.config.mamba_n_heads // WORLD and layers[0].ffn_reduce is not None
                attn = next(la.self_attn for la in layers if hasattr(la, "self_attn"))
                assert attn.num_heads == hf.config.num_attention_heads // WORLD
            eng = Engine(model, page_size=4, kv_cache_bytes=1 << 20, checkpoint_interval=8, max_num_batched_tokens=11)
            _same_tokens_everywhere(eng, hf, prompts, 10, rank, (mod.__name__, kind, experts))
    finally:
        _leave()


def test_hybrid_families_over_two_ranks(tmp_path):
    mp.spawn(_hybrid_worker, args=(f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=WORLD, join=True)


def _dense_worker(rank: int, init: str, path: str) -> None:
    """OLMo 2 (q / k norms over the whole projections: partial sums of squares summed over the ranks), Phi-3 (partial
    rotary, LongRoPE, a window), Granite 3 (multipliers, tied or untied, biases) and Gemma 2 (softcaps, sliding
    layers) over two ranks: transformers' greedy tokens on every rank."""
    from dist_helpers import _leave
    from paged_harness import ours_from_hf
    from test_gemma2 import PROMPTS as GEMMA_PROMPTS
    from test_gemma2 import tiny_gemma2
    from test_more_families import LONG_PROMPTS, SHORT_PROMPTS, tiny

    from infercore import Engine
    from infercore.parallel import tensor_parallel_

    torch.set_num_threads(1)
    kinds = ["olmo2", "olmo2_bias", "phi3", "phi3_longrope", "granite", "granite_bias", "gemma2"]
    hfs = {kind: tiny_gemma2(seed=1) if kind == "gemma2" else tiny(kind) for kind in kinds}
    models = {kind: ours_from_hf(hfs[kind], os.path.join(path, f"{kind}-{rank}"))[0] for kind in kinds}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        for kind in kinds:
            hf, model = hfs[kind], tensor_parallel_(models[kind])
            attn = model.model.layers[0].self_attn
            assert attn.num_heads == hf.config.num_attention_heads // WORLD
            if kind.startswith("olmo2"):
                assert attn.q_norm.weight.shape == (attn.q_size,) and attn.norm_reduce is not None
            prompts = {"phi3_longrope": LONG_PROMPTS, "gemma2": GEMMA_PROMPTS}.get(kind, SHORT_PROMPTS)
            eng = Engine(model, page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=12)
            _same_tokens_everywhere(eng, hf, prompts, 8, rank, kind)
    finally:
        _leave()


def test_olmo2_phi3_granite_gemma2_over_two_ranks(tmp_path):
    mp.spawn(_dense_worker, args=(f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=WORLD, join=True)
