"""Command line: ``infercore generate "PROMPT"`` and ``infercore info``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _device(text: str):
    """argparse type for --device: a torch device that exists on this machine."""
    from .devices import check_device

    try:
        return str(check_device(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a usable device ({e})") from None


def _model_path(text: str) -> str:
    if not text:  # an unset shell variable; the default model would otherwise load silently
        raise argparse.ArgumentTypeError("expected a checkpoint directory or .gguf file, got an empty string")
    return text


def _cpu_kv_bytes(args: argparse.Namespace) -> int:
    """``--cpu-kv-cache-gb`` in bytes (per tensor-parallel rank: each keeps its shard's pages)."""
    gb = getattr(args, "cpu_kv_cache_gb", 0.0)  # a Namespace built by hand (tests, callers) may lack it
    if not gb >= 0:  # NaN too
        raise ValueError(f"--cpu-kv-cache-gb must be >= 0, got {gb}")
    return int(gb * (1 << 30))


def _int8_activations(args: argparse.Namespace) -> None:
    """``--int8-activations``: the native CPU INT4 / INT8 GEMVs on 8-bit activations
    (``cpu_native.set_int8_activations``), in this process and in tensor-parallel ranks (through the environment).
    ``ValueError`` where the host cannot."""
    if not getattr(args, "int8_activations", False):
        return
    from .ops.moe import cpu_native

    if not cpu_native.set_int8_activations(True):
        raise ValueError("--int8-activations needs the native CPU kernels with AVX512-VNNI (native kernels: "
                         f"{cpu_native.status()})")
    os.environ["INFERCORE_CPU_INT8_ACTIVATIONS"] = "1"


def _generate(args: argparse.Namespace) -> int:
    from .engine import Engine, SamplingParams

    # Sampling flags are checked before the (slow) model load.
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
        )
        _cpu_kv_bytes(args)  # checked before the ranks start
        _int8_activations(args)
        adapters, lora_kw = _loras(args)
        _draft(args)  # refused with several ranks, before they start
        if len(adapters) > 1:
            raise ValueError("--lora: generate runs one prompt through one adapter; give one")
        if _multi_rank(args):
            return _spawn_tp(args, params)
        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                        num_speculative_tokens=args.num_speculative_tokens,
                                        cpu_kv_cache_bytes=_cpu_kv_bytes(args), **_host_experts(args), **lora_kw,
                                        **_draft(args), **_quantize_experts(args))
        _add_loras(engine, adapters)
    except (OSError, ValueError, TypeError, ImportError) as e:  # OSError: unreadable files too
        print(f"infercore: {e}", file=sys.stderr)
        return 2
    _print_stream(engine, args, params, lora=adapters[0].name if adapters else None)
    return 0


def _print_stream(engine, args: argparse.Namespace, params, *, lora: str | None = None) -> None:
    """Stream the answer (through LoRA adapter ``lora``, or the base model) to stdout and a timing line to
    stderr."""
    start = time.perf_counter()
    first = None
    out = None
    kw = {} if lora is None else {"lora": lora}
    for out in engine.stream(args.prompt, params, chat=not args.no_chat, **kw):
        if first is None:
            first = time.perf_counter()
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    end = time.perf_counter()
    if out is None or first is None:  # nothing streamed: no timing to report
        return
    n = len(out.token_ids)
    decode_s = end - first
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    print(
        f"\n[{n} tokens, prefill {len(out.prompt_token_ids)} tokens in {(first - start) * 1e3:.0f} ms, "
        f"decode {rate:.1f} tokens/s, finish: {out.finish_reason}; {engine.device}, {engine.dtype}]",
        file=sys.stderr,
    )


def _quantize_experts(args) -> dict:
    """``Engine.from_pretrained``'s ``quantize_experts`` from ``--quantize-experts``."""
    if not getattr(args, "quantize_experts", False):
        return {}
    from .engine.engine import _prequantized_method
    from .loading import default_model_path

    if args.quantization is None and _prequantized_method(args.model or default_model_path()) != "fp8":
        raise ValueError("--quantize-experts: set --quantization (w8a16, fp8-wo or fp8-wo-block), or load an FP8 "
                         "checkpoint")
    return {"quantize_experts": True}


def _host_experts(args: argparse.Namespace) -> dict:
    """``--host-experts [SCHEME]`` / ``--host-expert-layers N`` as ``Engine.from_pretrained`` takes them."""
    host, layers = getattr(args, "host_experts", False), getattr(args, "host_expert_layers", None)
    if layers is not None and not host:
        raise ValueError("--host-expert-layers needs --host-experts")
    return {"host_experts": host, "host_expert_layers": layers}


def _loras(args: argparse.Namespace) -> tuple[list, dict]:
    """``--lora [NAME=]PATH`` (repeatable): the adapters read (``lora.load_lora_adapter``) and the engine options
    that give them slots (``max_loras``, ``max_lora_rank``: ``--max-lora-rank`` or the largest rank read)."""
    specs = getattr(args, "lora", None) or []
    if not specs:
        return [], {}
    if getattr(args, "expert_parallel", False):
        raise ValueError("--lora: LoRA adapters are not supported with --expert-parallel (they are with "
                         "--tensor-parallel and --adaptive)")
    from .lora import load_lora_adapter

    adapters = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        adapters.append(load_lora_adapter(path, name=name or None))
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora: adapter names must differ, got {names}")
    rank = getattr(args, "max_lora_rank", None) or max(a.rank for a in adapters)
    return adapters, {"max_loras": len(adapters), "max_lora_rank": rank}


def _draft(args: argparse.Namespace) -> dict:
    """``--draft-model PATH`` as ``Engine.from_pretrained`` takes it (checked against the other flags first)."""
    path = getattr(args, "draft_model", None)
    if path is None:
        return {}
    if _multi_rank(args):
        raise ValueError("--draft-model: not supported with --tensor-parallel / --expert-parallel / --adaptive")
    if not getattr(args, "num_speculative_tokens", 0):
        raise ValueError("--draft-model: set --num-speculative-tokens K (the draft's length) too")
    return {"draft_model": path}


def _add_loras(engine, adapters: list) -> None:
    for a in adapters:
        engine.add_lora(a.name, a)


def _multi_rank(args: argparse.Namespace) -> bool:
    """Whether the flags ask for several ranks (:func:`_spawn_tp` checks them)."""
    return (args.tensor_parallel != 1 or getattr(args, "expert_parallel", False)
            or getattr(args, "adaptive", None) is not None)


def _spawn_tp(args: argparse.Namespace, params) -> int:
    """``--tensor-parallel N``: N processes (gloo on the CPU, NCCL on GPUs 0..N-1), each loading the model and
    keeping its shard. ``generate``: every rank runs the same engine calls and rank 0 prints. ``serve``: rank 0
    serves through a :class:`~infercore.parallel.MirroredEngine`; the other ranks replay its calls."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    n = args.tensor_parallel
    if n < 1:
        raise ValueError(f"--tensor-parallel must be >= 1, got {n}")
    if getattr(args, "expert_parallel", False) and n == 1:
        raise ValueError("--expert-parallel needs --tensor-parallel N > 1 (it places whole experts on the N ranks)")
    if getattr(args, "adaptive", None) is not None:
        if n == 1:
            raise ValueError("--adaptive needs --tensor-parallel N > 1 (it switches the N ranks between TP and DP)")
        if _host_experts(args)["host_experts"]:
            raise ValueError("--adaptive: not with --host-experts")
    if args.quantization == "gguf":
        raise ValueError("--tensor-parallel: a GGUF file's blocks run as stored are not sharded; use a scheme of "
                         "infercore.quant.SCHEMES, or no --quantization")
    if args.quantization is not None:  # refuse a bad scheme before the ranks load anything
        from .engine.engine import _check_quantization

        _check_quantization(args.quantization, args.model or "")
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_tp_rank, args=(args, params, f"file://{os.path.join(d, 'rdzv')}"), nprocs=n, join=True)
        except mp.ProcessRaisedException as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            raise ValueError(f"a tensor-parallel rank failed: {last}") from None
    return 0


def _tp_rank(rank: int, args: argparse.Namespace, params, init: str) -> None:
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from .devices import default_device
    from .engine import Engine
    from .engine.engine import _parse_dtype, default_dtype
    from .loading import default_model_path
    from .models import load_model
    from .parallel import MirroredEngine, follow, tensor_parallel_

    n = args.tensor_parallel
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    # a server's followers wait in a broadcast for as long as it is idle
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank, world_size=n,
                            timeout=datetime.timedelta(days=365))
    try:
        quantized = args.quantization is not None
        dtype = _parse_dtype(args.dtype) if args.dtype else default_dtype(device, quantized=quantized)
        model, tok, _ = load_model(args.model or default_model_path(), dtype=dtype, device=device)
        experts = "ep" if getattr(args, "expert_parallel", False) else "tp"
        if getattr(args, "adaptive", None) is not None:
            return _adaptive_rank(rank, args, params, model, tok, experts)
        tensor_parallel_(model, experts=experts)
        host = _host_experts(args)
        if host["host_experts"]:  # each rank's share of the experts on the host
            from .offload import offload_experts_

            scheme = host["host_experts"]
            offload_experts_(model, device=device, quantization=None if scheme is True else scheme,
                             layers=host["host_expert_layers"])
        if quantized:  # each rank quantizes its shards
            from .quant import quantize

            quantize(model, args.quantization, **{"experts": True} if _quantize_experts(args) else {})
        elif _quantize_experts(args):  # an FP8 checkpoint: each rank's experts back to FP8 codes
            from .quant import quantize_experts_

            if not quantize_experts_(model, "fp8-block"):
                raise ValueError("--quantize-experts: the model has no stacked routed experts to quantize")
        # LoRA after the sharding: each rank's slots hold its slice of every adapter, all ranks the same adapters in
        # the same order (so their slot tables agree)
        adapters, lora_kw = _serve_engine_kw(args) if args.cmd == "serve" else _loras(args)
        engine = Engine(model, tok, kv_cache_dtype=args.kv_cache_dtype,
                        num_speculative_tokens=args.num_speculative_tokens, cpu_kv_cache_bytes=_cpu_kv_bytes(args),
                        **lora_kw)
        _add_loras(engine, adapters)
        lora = {"lora": adapters[0].name} if adapters and args.cmd != "serve" else {}
        if args.cmd == "serve":
            if rank:
                follow(engine)
            else:
                mirrored = MirroredEngine(engine)
                try:
                    _run_server(mirrored, args)
                finally:
                    mirrored.close()
        elif rank == 0:
            _print_stream(engine, args, params, **lora)
        else:
            for _ in engine.stream(args.prompt, params, chat=not args.no_chat, **lora):
                pass
        dist.barrier()  # leave together: no rank exits while another still works
    finally:
        dist.destroy_process_group()


def _adaptive_rank(rank: int, args: argparse.Namespace, params, model, tok, experts: str) -> None:
    """``--adaptive HIGH,LOW``: the ranks switch with the load between TP and one whole replica each
    (:class:`~infercore.parallel.AdaptiveEngine`); rank 0 generates or serves, the others follow."""
    import torch.distributed as dist

    from .parallel import LoadPolicy, build_adaptive

    if _quantize_experts(args):
        raise ValueError("--quantize-experts: not with --adaptive (its layouts re-shard the experts)")
    high, low = args.adaptive
    adapters, lora_kw = _serve_engine_kw(args) if args.cmd == "serve" else _loras(args)
    kw = dict(kv_cache_dtype=args.kv_cache_dtype, num_speculative_tokens=args.num_speculative_tokens,
              cpu_kv_cache_bytes=_cpu_kv_bytes(args), **lora_kw)
    eng = build_adaptive(model, tok, experts=experts, quantization=args.quantization, tp_engine_kwargs=kw,
                         dp_engine_kwargs=kw, policy=LoadPolicy(high_at=high, low_at=low))
    if rank:
        eng.follow()
    else:
        try:
            _add_loras(eng, adapters)  # rank 0 sends each to both engines of every rank
            if args.cmd == "serve":
                _run_server(eng, args)
            else:
                _print_stream(eng, args, params, **({"lora": adapters[0].name} if adapters else {}))
        finally:
            eng.close()
    dist.barrier()


def _adaptive_at(text: str) -> tuple[int, int]:
    try:
        high, low = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HIGH,LOW (two ints), got {text!r}") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW < HIGH, got {text!r}")
    return high, low


def _serve(args: argparse.Namespace) -> int:
    from .engine import Engine

    if not 0 <= args.port <= 65535:  # before the (slow) load
        print(f"infercore: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    try:
        _cpu_kv_bytes(args)
        _int8_activations(args)
        adapters, lora_kw = _serve_engine_kw(args)
        _draft(args)
        if _multi_rank(args):
            return _spawn_tp(args, None)
        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                        num_speculative_tokens=args.num_speculative_tokens,
                                        cpu_kv_cache_bytes=_cpu_kv_bytes(args), **_host_experts(args), **lora_kw,
                                        **_draft(args), **_quantize_experts(args))
        _add_loras(engine, adapters)
        _run_server(engine, args)
    except (OSError, ValueError, TypeError, ImportError) as e:
        print(f"infercore: {e}", file=sys.stderr)
        return 2
    return 0


def _serve_engine_kw(args: argparse.Namespace) -> tuple[list, dict]:
    """``serve``'s adapters and engine options: ``--lora`` / ``--max-lora-rank`` as :func:`_loras` reads them, the
    slots of ``--max-loras`` (for adapters loaded while serving: POST /v1/load_lora_adapter), and
    ``--scheduling-policy``."""
    adapters, kw = _loras(args)
    if getattr(args, "scheduling_policy", "fcfs") != "fcfs":
        kw["scheduling_policy"] = args.scheduling_policy
    if getattr(args, "max_loras", 0):
        kw = {"max_lora_rank": 16, **kw, "max_loras": args.max_loras}
        if getattr(args, "max_lora_rank", None):
            kw["max_lora_rank"] = args.max_lora_rank
    return adapters, kw


def _run_batch(args: argparse.Namespace) -> int:
    """``run-batch``: ``serve``'s engine (one process or rank 0 of several), answering a file of requests instead of
    listening (:func:`_run_server` sees ``args.batch_job``)."""
    import os

    if args.input_file != "-" and not os.path.isfile(args.input_file):
        print(f"infercore: --input-file {args.input_file!r} not found", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print(f"infercore: --concurrency must be >= 1, got {args.concurrency}", file=sys.stderr)
        return 2
    args.cmd, args.batch_job, args.host, args.port, args.verbose = "serve", True, "127.0.0.1", 0, False
    return _serve(args)


def _batch_file(engine, args: argparse.Namespace, name: str, parser: str) -> None:
    """Answer ``--input-file`` into ``--output-file`` (``-``: standard input / output), one line per request."""
    from .batch import run_batch

    src = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    dst = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    done = failed = 0
    try:
        for out in run_batch(engine, src, model_name=name, concurrency=args.concurrency,
                             tool_call_parser=None if parser == "none" else parser,
                             reasoning_parser=getattr(args, "reasoning_parser", None)):
            dst.write(json.dumps(out) + "\n")
            done += 1
            failed += out["error"] is not None or out["response"]["status_code"] != 200
    finally:
        for f, std in ((src, sys.stdin), (dst, sys.stdout)):
            if f is not std:
                f.close()
    print(f"infercore: {done} requests answered ({failed} with an error)", file=sys.stderr)


def _run_server(engine, args: argparse.Namespace) -> None:
    """Serve ``engine`` (an Engine or rank 0's MirroredEngine) until interrupted (``run-batch``: answer its file)."""
    from pathlib import Path

    from .loading import default_model_path
    from .serve import make_server

    name = args.served_model_name or Path(args.model or default_model_path()).name
    parser = getattr(args, "tool_call_parser", "hermes")
    if getattr(args, "batch_job", False):
        _batch_file(engine, args, name, parser)
        return
    server = make_server(engine, host=args.host, port=args.port, model_name=name, verbose=args.verbose,
                         tool_call_parser=None if parser == "none" else parser,
                         reasoning_parser=getattr(args, "reasoning_parser", None))
    host, port = server.server_address[:2]
    print(f"infercore: serving {name} on http://{host}:{port}/v1 ({engine.device}, {engine.dtype})", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.loop.close()


def _info(args: argparse.Namespace) -> int:
    import torch

    from . import devices
    from . import ops as _ops  # noqa: F401  (registers the implementations)
    from . import quant as _quant  # noqa: F401  (and the quantized matmuls')

    print(f"torch {torch.__version__}")
    for cap in devices.list_devices():
        print(f"device {cap.device_type}{'' if cap.index is None else ':' + str(cap.index)}: {cap.name}; "
              f"cc={cap.compute_capability} bf16={cap.bf16} native_fp8={cap.native_fp8} triton={cap.triton} "
              f"memory={cap.total_memory / 2**30:.1f} GiB")
    device = args.device or str(devices.default_device())
    rep = devices.report(device)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    print(f"\nop backends on {device} (INFERCORE_BACKEND overrides):")
    for op, row in rep.items():
        print(f"  {op:28s} -> {row['selected']:10s} (available: {', '.join(row['implementations'])})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .kv.cache import KV_CACHE_DTYPES
    from .reasoning_parsers import REASONING_PARSERS
    from .tool_parsers import TOOL_PARSERS

    p = argparse.ArgumentParser(prog="infercore", description="LLM inference building blocks")
    sub = p.add_subparsers(dest="cmd", required=True)
    def model_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--model", default=None, type=_model_path,
                       help="HF safetensors dir (GPTQ / AWQ ones too) or .gguf file (default: SmolLM2-135M-Instruct)")
        q.add_argument("--device", default=None, type=_device, help="cpu, cuda, cuda:1 (default: cuda if available)")
        q.add_argument("--lora", action="append", default=None, metavar="[NAME=]PATH",
                       help="a PEFT LoRA adapter directory (NAME defaults to its directory name). generate: the "
                            "prompt runs through it; serve (repeatable): requests whose model is NAME do")
        q.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                       help="the largest adapter rank the slots hold (default: the largest --lora rank; 16 for "
                            "serve --max-loras without --lora)")
        q.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        q.add_argument("--quantization", default=None, metavar="Q",
                       help="'gguf': run a GGUF file's Q4_0 / Q4_1 / Q8_0 linears as stored; or a weight scheme of "
                            "infercore.quant.SCHEMES (e.g. w4a16-g128, w8a16, fp8-wo); the dtype then defaults to "
                            "bfloat16, which the packed CPU kernels take (default: dense weights)")
        q.add_argument("--quantize-experts", action="store_true",
                       help="with --quantization w8a16 / fp8-wo / fp8-wo-block: a MoE model's stacked routed experts "
                            "too (int8 / fp8 codes the routed kernels read); with an FP8 checkpoint, its experts "
                            "(dequantized by the loader) back to FP8 block codes")
        q.add_argument("--int8-activations", action="store_true",
                       help="on the CPU, the quantized linears' decode rows (INT4, INT8, GGUF Q4 / Q8_0 / Q6_K) take "
                            "activations rounded to 8 bits in blocks of 32 (llama.cpp's design; AVX512-VNNI): faster "
                            "where bf16 dot products are slow, not the bf16 activations' values; with "
                            "--quantization gguf a tied lm_head then runs the embedding's blocks (default: off)")
        q.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                       help="KV cache storage: auto (the model's dtype), int8 or fp8 with per-token scales")
        q.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                       help="shard the model over N processes (gloo on the CPU, NCCL on GPUs 0..N-1); N must "
                            "divide the heads, KV heads, MLP width and vocabulary (default 1)")
        q.add_argument("--adaptive", nargs="?", const=(8, 2), default=None, type=_adaptive_at, metavar="HIGH,LOW",
                       help="with --tensor-parallel N: each rank also keeps the whole model, and the N ranks serve as "
                            "N data-parallel replicas from HIGH unfinished requests on, and tensor-parallel again "
                            "at LOW or fewer (requests in flight move with their KV; default 8,2)")
        q.add_argument("--expert-parallel", action="store_true",
                       help="with --tensor-parallel N on a routed-expert model (Mixtral, Qwen2/3-MoE): each rank "
                            "keeps whole experts (N must divide their number) instead of a slice of every expert")
        q.add_argument("--host-experts", nargs="?", const=True, default=False, metavar="SCHEME",
                       help="a routed-expert model's experts stay in host memory and run there (the rest on "
                            "--device); with SCHEME (e.g. w4a16-g128) quantized to it")
        q.add_argument("--host-expert-layers", type=int, default=None, metavar="N",
                       help="with --host-experts: only the first N MoE layers' experts on the host, the rest on "
                            "--device (default: all)")
        q.add_argument("--num-speculative-tokens", default=0, type=int, metavar="K",
                       help="speculative decoding by prompt lookup: draft up to K tokens from n-grams of the "
                            "request's own text, verified in one forward (default 0: off); with --draft-model, "
                            "K tokens of the draft model")
        q.add_argument("--draft-model", default=None, type=_model_path, metavar="PATH",
                       help="a smaller checkpoint of the same vocabulary that drafts --num-speculative-tokens tokens "
                            "(speculative decoding with a draft model; one process only)")
        q.add_argument("--cpu-kv-cache-gb", default=0.0, type=float, metavar="GB",
                       help="host memory for a CPU tier under the prefix cache: cached KV pages the GPU pool "
                            "reuses are copied there and copied back when a prompt continues them (default 0: "
                            "off)")

    g = sub.add_parser("generate", help="stream a chat answer from a model")
    g.add_argument("prompt")
    model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    g.set_defaults(fn=_generate)
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    model_args(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None, help="the model id the API reports (default: the file name)")
    v.add_argument("--verbose", action="store_true", help="log every HTTP request")
    v.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: by each request's priority field (lower first), preempting "
                        "worse-ranked running requests when full")
    v.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapters that run at once (device slots; default: the --lora count); any number "
                        "may be loaded (--lora, POST /v1/load_lora_adapter), taking turns in the slots")
    v.add_argument("--tool-call-parser", default="hermes", choices=[*sorted(TOOL_PARSERS), "none"],
                   help="the format tool_choice 'auto' replies are read in for tool_calls (hermes: "
                        "<tool_call>{...}</tool_call>, as Hermes / Qwen2.5 / Qwen3 write them); none: leave the text")
    v.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="return a thinking model's <think> block as the chat message's reasoning_content "
                        "(deepseek_r1: replies start inside the block; qwen3: only a reply that opens one)")
    v.set_defaults(fn=_serve)
    b = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI Batch API requests (chat / completions / "
                                         "embeddings / score / rerank / classify) into a JSONL file")
    model_args(b)
    b.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="one request per line: {custom_id, method: POST, url, body} (- for standard input)")
    b.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="one answer per line, in input order: {id, custom_id, response: {status_code, request_id, "
                        "body}, error} (- for standard output)")
    b.add_argument("--concurrency", type=int, default=64, metavar="N",
                   help="requests in the engine at once (default 64)")
    b.add_argument("--served-model-name", default=None, help="the model id the answers report")
    b.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapters that run at once (default: the --lora count); a request whose body's model "
                        "is an adapter's NAME runs through it")
    b.add_argument("--tool-call-parser", default="hermes", choices=[*sorted(TOOL_PARSERS), "none"],
                   help="as serve's")
    b.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), help="as serve's")
    b.set_defaults(fn=_run_batch)
    i = sub.add_parser("info", help="devices and which backend serves each op")
    i.add_argument("--device", default=None, type=_device)
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"infercore: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
