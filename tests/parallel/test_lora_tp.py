"""Multi-LoRA on a tensor-parallel model (gloo, two CPU processes): each rank's slots hold its slice of every PEFT
adapter (B by output rows for qkv / gate_up, A by input columns for o / down); the greedy tokens of a mixed batch
(different adapters and base rows, more adapters than slots) equal PEFT's on every rank."""

import os
import sys

import peft
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.dirname(__file__))

from dist_helpers import _leave  # noqa: E402
from engine_helpers import hf_greedy, ours_from_hf, tiny_hf  # noqa: E402

WORLD = 2
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {"all": dict(r=8, alpha=16, target_modules=ALL),
         "attn": dict(r=4, alpha=8, target_modules=["k_proj", "o_proj"], use_rslora=True),
         "mlp1": dict(r=16, alpha=4, target_modules=["up_proj", "down_proj"], layers_to_transform=[1])}
LORAS = ["all", None, "attn", "mlp1", "all", "attn"]
MAX_TOKENS = 8


def _hf(kind):
    # Llama with attention biases: qkv's are sharded, o_proj's is rank 0's (under its LoRA)
    return tiny_hf(kind, attention_bias=kind == "llama")


def _prompts():
    # the last one (70 tokens) takes the per-adapter GEMMs at prefill; the decode steps the native per-row kernel
    return [[(5 * i + 3 * j) % 96 for j in range(4 + 7 * i)] for i in range(5)] + [[(11 * j + 1) % 96
                                                                                       for j in range(70)]]


def _save_adapter(kind, path, *, r, alpha, target_modules, seed, **kw):
    """A PEFT adapter over the tiny model with random A and B (PEFT starts B at zero), saved to ``path``; returns
    PEFT's merged model, the reference."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                          init_lora_weights=False, **kw)
    model = peft.get_peft_model(_hf(kind), cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model.merge_and_unload()


def _worker(rank: int, init: str, kind: str, paths: dict, want: list) -> None:
    from infercore import Engine, SamplingParams
    from infercore.lora import LoRALinear
    from infercore.ops.moe import cpu_native
    from infercore.parallel import MirroredEngine, follow, tensor_parallel_

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        fused = []  # the fused native decoder layers take whole projections: a sharded model runs op by op
        for fn in ("llama_decode_layer", "llama_decode_layers"):
            orig = getattr(cpu_native, fn)
            setattr(cpu_native, fn, lambda *a, _orig=orig, _fn=fn, **k: (fused.append(_fn), _orig(*a, **k))[1])
        model = tensor_parallel_(ours_from_hf(_hf(kind)))
        eng = Engine(model, page_size=4, num_pages=256, max_loras=2, max_lora_rank=16)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        qkv, o = attn.qkv_proj, attn.o_proj.linear  # the row-parallel LoRA inside RowParallel, before the sum
        assert isinstance(o, LoRALinear) and isinstance(mlp.down_proj.linear, LoRALinear)
        assert (qkv.shard, qkv.sizes, qkv.full_sizes) == ("column", (16, 8, 8), (32, 16, 16))
        assert (o.shard, o.in_features, o.full_in_features) == ("row", 16, 32)
        for name in SPECS:  # 3 adapters, 2 slots
            eng.add_lora(name, paths[name])
        # the rank's slice of the adapter in its slot: k_proj's B rows, o_proj's A columns
        from infercore.lora import load_lora_adapter

        full = load_lora_adapter(paths["all"])
        slot = eng.lora.slots["all"]
        a_k, b_k = full.weights[(0, "k_proj")]
        torch.testing.assert_close(qkv.b[slot, 16:24, :8], b_k[rank * 8 : (rank + 1) * 8])
        torch.testing.assert_close(qkv.a[slot, 16:24], a_k)
        a_o, b_o = full.weights[(0, "o_proj")]
        torch.testing.assert_close(o.a[slot, :8], a_o[:, rank * 16 : (rank + 1) * 16])
        torch.testing.assert_close(o.b[slot, :, :8], b_o)

        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.token_ids for o in eng.generate(_prompts(), greedy, lora=LORAS)]
        assert got == want, (rank, got, want)
        assert eng.lora.loads >= 3 and eng.lora.refs == [0, 0]  # the adapters took turns in the slots
        assert not fused, fused
        # served from rank 0: adapters loaded and unloaded while serving reach every rank
        if rank == 0:
            drv = MirroredEngine(eng)
            drv.remove_lora("attn")
            drv.add_lora("attn2", paths["attn"])
            again = drv.generate([_prompts()[2]], greedy, lora="attn2")[0].token_ids
            drv.close()
            assert again == want[2]
        else:
            assert follow(eng) > 0
        # every rank keeps the same adapters, slot table and prefix-cache salts
        state = (eng.list_loras(), dict(eng.lora.slots), [eng.lora.salt(n) for n in eng.list_loras()])
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, state)
        assert all(s == state for s in everyone) and state[0] == ["all", "attn2", "mlp1"]
    finally:
        _leave()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_sharded_adapters_match_peft(kind, tmp_path):
    """Two ranks, each with its slice of three adapters in two slots, run a mixed batch (two adapters twice, one
    once, a base row): every rank's greedy tokens equal PEFT's merged model per adapter and transformers' base."""
    base = _hf(kind)
    refs, paths = {}, {}
    for seed, (name, spec) in enumerate(SPECS.items(), 1):
        paths[name] = str(tmp_path / name)
        refs[name] = _save_adapter(kind, paths[name], seed=seed, **spec)
    want = []
    for p, la in zip(_prompts(), LORAS):
        want.append(hf_greedy(base if la is None else refs[la], p, MAX_TOKENS))
        if la is not None:  # each adapter changes what the model says: the comparison can fail
            assert want[-1] != hf_greedy(base, p, MAX_TOKENS), la
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", kind, paths, want), nprocs=WORLD, join=True)


def test_lora_before_sharding_is_refused():
    """``enable_lora_`` then ``tensor_parallel_``: a ValueError that says to shard first (checked before the group,
    which this process does not have)."""
    from infercore.lora import enable_lora_
    from infercore.parallel import tensor_parallel_

    model = ours_from_hf(tiny_hf("llama"))
    enable_lora_(model, max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match="shard it first, then enable LoRA"):
        tensor_parallel_(model)
