"""Tensor parallelism over NCCL on GPUs. With two GPUs (``-m gpu2``): each rank's shards on its own GPU, decode steps
captured in CUDA graphs with the collectives inside, the ranks' tokens against transformers and the unsharded engine
on one GPU; expert parallelism for a routed-expert model; and a MirroredEngine whose calls the other rank follows (the
server's path). On one GPU (``-m gpu``): a group of one, so that the NCCL collectives inside captured decode graphs
are exercised wherever a GPU is."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "engine"))
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, HERE)

from dist_helpers import _leave  # noqa: E402  (leave the group together)

WORLD = 2


def _spawn_two(worker, *args) -> None:
    """``worker(rank, *args)`` on two processes, one GPU each."""
    if torch.cuda.device_count() < WORLD:
        pytest.fail(f"needs {WORLD} CUDA GPUs, found {torch.cuda.device_count()}")
    mp.spawn(worker, args=args, nprocs=WORLD, join=True)


def _on_gpu(hf, dtype, device):
    from infercore.models import ModelConfig, build_model

    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), dtype=dtype, device=device)
    model.load_weights(hf.state_dict().items())
    return model


def _worker(rank: int, init: str, kind: str) -> None:
    from engine_helpers import hf_greedy, random_prompts, tiny_hf

    from infercore import Engine, SamplingParams
    from infercore.parallel import tensor_parallel_

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD)
    try:
        hf = tiny_hf(kind, num_key_value_heads=2)
        model = tensor_parallel_(_on_gpu(hf, torch.float32, dev))
        assert model.model.layers[0].self_attn.num_kv_heads == 1 and model.lm_head.linear.weight.device == dev
        eng = Engine(model, page_size=16, num_pages=128, max_num_batched_tokens=24)
        assert eng.graph_runner is not None and eng.graph_runner.graphs  # decode graphs hold the collectives
        assert eng.runner.kv_caches[0][0].shape[2] == 1  # this rank's KV head only
        prompts = random_prompts(5, seed=3)
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
        unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
        outs = {name: [o.token_ids for o in eng.generate(prompts, sp)]
                for name, sp in (("greedy", greedy), ("seeded", seeded), ("unseeded", unseeded))}
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, outs)
        assert all(o == outs for o in everyone)  # every rank sampled the same tokens, unseeded requests included
        # bf16 shards, with the Triton GEMVs' layouts swapped in at the engine's build
        bf = Engine(tensor_parallel_(_on_gpu(hf, torch.bfloat16, dev)), page_size=16, num_pages=128)
        bf_out = [o.token_ids for o in bf.generate(prompts, greedy)]
        dist.all_gather_object(everyone, bf_out)
        assert all(o == bf_out for o in everyone)
        if rank == 0:
            assert outs["greedy"] == [hf_greedy(hf, p, 24) for p in prompts]
            plain = Engine(_on_gpu(hf, torch.float32, dev), page_size=16, num_pages=128)
            assert outs["seeded"] == [o.token_ids for o in plain.generate(prompts, seeded)]
            one = Engine(_on_gpu(hf, torch.bfloat16, dev), page_size=16, num_pages=128)
            # bf16: the sharded sums round differently; most greedy tokens still agree with one GPU's
            same = sum(a == b for x, y in zip(bf_out, [o.token_ids for o in one.generate(prompts, greedy)])
                       for a, b in zip(x, y))
            assert same >= 0.8 * sum(map(len, bf_out))
    finally:
        _leave()


@pytest.mark.gpu2
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_gpus_match_one(kind, tmp_path):
    _spawn_two(_worker, f"file://{tmp_path}/rdzv", kind)


def _moe_worker(rank: int, init: str, path: str, experts: str) -> None:
    from paged_harness import hf_greedy
    from test_moe_llama import PROMPTS, tiny_moe

    from infercore import Engine, SamplingParams
    from infercore.models import load_model
    from infercore.parallel import tensor_parallel_

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    hf = tiny_moe("qwen2_moe")  # a shared expert and a dense layer
    hf.save_pretrained(os.path.join(path, f"m{rank}"), safe_serialization=True)  # before the group: each its own
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD)
    try:
        model = tensor_parallel_(load_model(os.path.join(path, f"m{rank}"), dtype=torch.float32, device=dev)[0],
                                 experts=experts)
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        eng = Engine(model, page_size=16, num_pages=64)
        assert eng.graph_runner is not None and eng.graph_runner.graphs
        out = [o.token_ids for o in eng.generate(PROMPTS, greedy)]
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, out)
        assert all(o == out for o in everyone)
        if rank == 0:
            assert out == [hf_greedy(hf, p, 10) for p in PROMPTS]
    finally:
        _leave()


@pytest.mark.gpu2
@pytest.mark.parametrize("experts", ["tp", "ep"])
def test_two_gpus_routed_experts(experts, tmp_path):
    _spawn_two(_moe_worker, f"file://{tmp_path}/rdzv", str(tmp_path), experts)


def _mirror_worker(rank: int, init: str) -> None:
    from engine_helpers import random_prompts, tiny_hf

    from infercore import Engine, SamplingParams
    from infercore.parallel import MirroredEngine, follow, tensor_parallel_

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD)
    try:
        hf = tiny_hf("llama", num_key_value_heads=2)
        eng = Engine(tensor_parallel_(_on_gpu(hf, torch.float32, torch.device("cuda", rank))), page_size=16,
                     num_pages=128)
        if rank:
            assert follow(eng) > 0
            return
        mirrored = MirroredEngine(eng)
        prompts = random_prompts(3, seed=9)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ids = [mirrored.add_request(p, sp) for p in prompts]
        mirrored.abort(ids[1])
        done = {}
        while mirrored.has_unfinished():
            for o in mirrored.step():
                if o.finished:
                    done[o.request_id] = o
        mirrored.close()
        assert len(done[ids[0]].token_ids) == 12 and len(done[ids[2]].token_ids) == 12
        plain = Engine(_on_gpu(hf, torch.float32, torch.device("cuda", 0)), page_size=16, num_pages=128)
        want = plain.generate([prompts[0], prompts[2]], sp)
        assert [done[ids[0]].token_ids, done[ids[2]].token_ids] == [o.token_ids for o in want]
    finally:
        _leave()


@pytest.mark.gpu2
def test_two_gpus_mirrored_engine(tmp_path):
    _spawn_two(_mirror_worker, f"file://{tmp_path}/rdzv")


def _single_worker(rank: int, init: str) -> None:
    from engine_helpers import hf_greedy, random_prompts, tiny_hf

    from infercore import Engine, SamplingParams
    from infercore.parallel import RowParallel, tensor_parallel_

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
    try:
        hf = tiny_hf("llama", num_key_value_heads=2)
        model = tensor_parallel_(_on_gpu(hf, torch.float32, torch.device("cuda", 0)))
        assert isinstance(model.model.layers[0].self_attn.o_proj, RowParallel)
        eng = Engine(model, page_size=16, num_pages=128, max_num_batched_tokens=24)
        assert eng.graph_runner is not None and eng.graph_runner.graphs
        prompts = random_prompts(5, seed=3)
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    finally:
        _leave()


@pytest.mark.gpu
def test_group_of_one_gpu_with_collectives_in_graphs(tmp_path):
    mp.spawn(_single_worker, args=(f"file://{tmp_path}/rdzv", ), nprocs=1, join=True)
