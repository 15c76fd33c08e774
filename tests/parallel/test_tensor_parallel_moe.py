"""Tensor and expert parallelism of the routed-expert families (gloo, two CPU processes): each rank keeps every
expert's slice of the intermediate width, or half of the experts whole; the tokens equal transformers' greedy ones on
every rank."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, HERE)

WORLD = 2


def _worker(rank: int, init: str, path: str) -> None:
    from dist_helpers import _leave
    from paged_harness import hf_greedy, ours_from_hf
    from test_moe_llama import PROMPTS, tiny_moe

    from infercore import Engine, SamplingParams
    from infercore.parallel import RowParallel, tensor_parallel_

    torch.set_num_threads(1)
    # loaded before the group exists: transformers' save_pretrained writes on the main process only
    hfs = {kind: tiny_moe(kind) for kind in ("mixtral", "qwen2_moe")}  # qwen2_moe: a shared expert, a dense layer
    layouts = [(kind, experts) for kind in hfs for experts in ("tp", "ep")]
    models = {lay: ours_from_hf(hfs[lay[0]], os.path.join(path, f"{lay[0]}-{lay[1]}-{rank}"))[0] for lay in layouts}
    odd = ours_from_hf(tiny_moe("qwen3_moe", moe_intermediate_size=25), os.path.join(path, f"odd-{rank}"))[0]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for kind, experts in layouts:
            hf = hfs[kind]
            model = tensor_parallel_(models[kind, experts], experts=experts)
            mlp = model.model.layers[0].mlp
            width = hf.config.intermediate_size if kind == "mixtral" else hf.config.moe_intermediate_size
            num = hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts
            assert isinstance(mlp, RowParallel)
            if experts == "tp":
                assert mlp.linear.experts.down_proj.shape[::2] == (num, width // WORLD)
            else:  # whole experts, half of them
                assert mlp.linear.experts.down_proj.shape[::2] == (num // WORLD, width)
                assert mlp.linear.expert_offset == rank * num // WORLD
            outs = [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(PROMPTS, greedy)]
            everyone = [None] * WORLD
            dist.all_gather_object(everyone, outs)
            assert everyone[0] == everyone[1]
            if rank == 0:
                assert outs == [hf_greedy(hf, p, 10) for p in PROMPTS], (kind, experts)
            if kind == "qwen2_moe":  # each rank's share of the experts on its host: the same tokens
                from infercore.offload import offload_experts_

                info = offload_experts_(model, pack=experts == "ep")
                assert info["layers"] and all(model.model.layers[i].mlp.linear.host_experts for i in info["layers"])
                again = [o.token_ids for o in Engine(model, page_size=4, num_pages=64).generate(PROMPTS, greedy)]
                assert again == outs, (kind, experts)
        with pytest.raises(ValueError, match="moe_intermediate_size=25"):
            tensor_parallel_(odd)
        with pytest.raises(ValueError, match="experts must be"):
            tensor_parallel_(odd, experts="dp")
    finally:
        _leave()


def test_routed_experts_over_two_ranks(tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path}/rdzv", str(tmp_path)), nprocs=WORLD, join=True)


def test_cli_generate_with_expert_parallelism(tmp_path, capfd):
    """``infercore generate --tensor-parallel 2 --expert-parallel`` on a Qwen3-MoE checkpoint directory (tiny
    random weights, SmolLM2's tokenizer): rank 0 prints the same greedy answer as one process; without
    ``--tensor-parallel`` the flag is refused with exit code 2."""
    from test_moe_llama import tiny_moe

    from infercore import cli
    from infercore.loading import GGUFFile, Tokenizer, default_model_path

    tok = Tokenizer.from_gguf(GGUFFile(default_model_path()))
    hf = tiny_moe("qwen3_moe", vocab_size=49152, decoder_sparse_step=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    argv = ["generate", "Name three colours.", "--device", "cpu", "--model", str(tmp_path), "--max-tokens", "8",
            "--temperature", "0", "--no-chat"]  # fmt: skip
    assert cli.main(argv) == 0
    want = capfd.readouterr().out
    assert cli.main(argv + ["--tensor-parallel", "2", "--expert-parallel"]) == 0
    got = capfd.readouterr().out
    assert got == want and want.strip()
    assert cli.main(argv + ["--expert-parallel"]) == 2
    assert "--tensor-parallel" in capfd.readouterr().err
    # the experts on the host: in the model's dtype (the same answer), and INT4 (an answer)
    assert cli.main(argv + ["--host-experts"]) == 0
    assert capfd.readouterr().out == want
    assert cli.main(argv + ["--host-experts", "--host-expert-layers", "1"]) == 0  # llama.cpp's --n-cpu-moe
    assert capfd.readouterr().out == want
    assert cli.main(argv + ["--host-expert-layers", "1"]) == 2
    assert "--host-experts" in capfd.readouterr().err
    assert cli.main(argv + ["--host-experts", "w4a16-g128", "--tensor-parallel", "2", "--expert-parallel"]) == 0
    assert capfd.readouterr().out.strip()
    assert cli.main(argv + ["--host-experts", "fp8-wo"]) == 2
    assert "weight-only INT" in capfd.readouterr().err
    assert cli.main(["generate", "Hi", "--device", "cpu", "--host-experts"]) == 2  # SmolLM2 has no experts
    assert "no routed-expert" in capfd.readouterr().err
    # int8 experts, in one process and over two expert-parallel ranks (each quantizing its own experts and shards:
    # the row-parallel linears' per-channel scales then come from their halves, so the answers may differ)
    assert cli.main(argv + ["--quantization", "w8a16", "--quantize-experts", "--dtype", "float32"]) == 0
    assert capfd.readouterr().out.strip()
    assert cli.main(argv + ["--quantization", "w8a16", "--quantize-experts", "--dtype", "float32",
                            "--tensor-parallel", "2", "--expert-parallel"]) == 0  # fmt: skip
    assert capfd.readouterr().out.strip()
    assert cli.main(argv + ["--quantize-experts"]) == 2
    assert "--quantization" in capfd.readouterr().err
