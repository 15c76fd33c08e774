"""Instructions per code in the main loop of the MODE 4 / MODE 5 weight-only kernels, from an offline sm90 compile.

No GPU needed: Triton compiles for ``cuda:90`` on the CPU and its bundled ``cuobjdump`` prints the SASS;
the script finds the kernel's loops (backward branches) and counts the instructions of the largest
one, divided by the codes each thread decodes per iteration. Static counts, not timings (the Triton
here may differ from the GPU machine's).

    python benchmarks/sass_count.py                       # MODE 4, int4 and fp8, the tuned M = 1 tiles
    python benchmarks/sass_count.py --kind int4 --block-n 4 --block-k 4096 --warps 4 --stages 1
    python benchmarks/sass_count.py --mode 5              # MODE 5, the default 128 x 128 tile (M <= 16)
    python benchmarks/sass_count.py --mode 6 --warps 4 --reps 4 --depth 1   # MODE 6 (triton_frag), M <= 8
    python benchmarks/sass_count.py --mode 6 --kind int4 --wn --depth 2 --nb 2   # warps split N, M 9-16
    python benchmarks/sass_count.py --mode 6 --kind int4 --wn --depth 3 --maxnreg 128   # the tuned M=1 entries
    python benchmarks/sass_count.py --mode 7 --kind int4 --warps 1 --stages 2    # MODE 7 (gluon_frag, Gluon)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from infercore.quant import triton_frag as TF
from infercore.quant import wo_gemv, wo_words


def _sizes(split: str) -> tuple[str, ...]:
    """The i32 size arguments of the MODE 4 / MODE 5 kernels (they name the K-per-split one apart)."""
    return ("M", "N", "K", "KW", split, "stride_xm", "stride_qn", "stride_sn", "stride_ym")


def _compile(fn, ptr: dict, sizes: tuple[str, ...], ce: dict, warps: int, stages: int, maxnreg: int = 0):
    """``fn`` for sm90 with these pointer types, i32 sizes and constexprs; as a real launch specializes
    them, pointers and sizes are divisible by 16."""
    ints = {n: "i32" for n in sizes}
    types = {**ptr, **ints, **{k: "constexpr" for k in ce}}
    sig = {n: types[n] for n in fn.arg_names}  # in the kernel's argument order
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptr, *ints)}
    src = ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gemv4(kind: str, block_n: int, block_kw: int, warps: int, stages: int, packed: bool = False, m: int = 1):
    """MODE 4 (``_gemv4_kernel``) for ``m`` bf16 rows, whole tiles, no split-K; ``packed``: the fp16 word dot."""
    ptr = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16" if kind == "int4" else "*fp32", "z_ptr": "*bf16",
           "ws_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32"}
    if kind == "int4":
        ce = dict(FP8=False, BITS=4, ILV=16, SCALE_WORDS=16, SCALE_ROWS=0, HAS_ZEROS=False)
    else:
        ce = dict(FP8=True, BITS=8, ILV=32, SCALE_WORDS=32, SCALE_ROWS=0, HAS_ZEROS=False)
    ce.update(SPLIT_K=False, EVEN=True, XMASK=False, BLOCK_M=m, BLOCK_N=block_n, BLOCK_KW=block_kw, ACT=0,
              PREWAIT=0, USE_PDL=False, PACKED=packed, NSPLIT=1)  # fmt: skip
    return _compile(wo_gemv._gemv4_kernel, ptr, _sizes("kw_per_split"), ce, warps, stages)


def compile_words(kind: str, block_n: int, block_k: int, warps: int, stages: int):
    """MODE 5 (``_words_small_kernel``) for bf16 activations, whole tiles, split-K on."""
    ptr = {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8" if kind == "int4" else "*fp32",
           "ws_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32"}
    fp8 = kind == "fp8"
    ce = dict(FP8=fp8, GROUP=1 if fp8 else 128, HAS_ZEROS=False, SCALE_BLOCK=0, MAGIC=0 if fp8 else 0x4300,
              MAGIC_BASE=0.0 if fp8 else 128.0, FOLD=2.0**120 if fp8 else 1.0, MODE=2, DOT_PRECISION="ieee",
              EVEN=True, SPLIT_K=True, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=False, NSPLIT=4)
    return _compile(wo_words._words_small_kernel, ptr, _sizes("k_per_split"), ce, warps, stages)


def compile_frag(kind: str, warps: int, reps: int, depth: int, wn: bool = False, nb: int = 1, maxnreg: int = 0):
    """MODE 6 (``triton_frag._frag_kernel``) for bf16 activations, ``nb`` B fragments (M <= 8 or 16),
    split-K on; ``wn``: the warps split N."""
    asm, cons = TF._asm(kind, nb, False, False, reps if wn and kind == "int4" and reps > 1 else 1)
    ptr = {"x_ptr": "*bf16", "qw_ptr": "*i32" if kind == "int4" else "*i64",
           "s_ptr": "*i64" if kind == "int4" else "*fp32", "ws_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32"}
    ce = dict(FP8=kind == "fp8", NB=nb, BSCALE=False, WARPS=warps, REPS=reps, SPLIT_K=True, ACT=0,
              FOLD=1.0, ASM=asm, CONS=cons, DEPTH=depth, USE_PDL=False, PREWAIT=False, WN=wn, NSPLIT=8)
    sizes = ("M", "N", "G", "iters_per_split", "stride_xm", "stride_ym")
    return _compile(TF._frag_kernel, ptr, sizes, ce, warps, 1, maxnreg)


def compile_tma(kind: str, warps: int, stages: int, nb: int = 1, maxnreg: int = 0, sent: bool = False):
    """MODE 7 (``gluon_frag._tma_frag_kernel``, Gluon) for bf16 activations, ``nb`` B fragments, split-K on,
    PDL on (its prewait TMA copies); ``sent``: the ready-flag finish (else the tagged one for INT4 at one fragment)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from infercore.quant import gluon_frag as GF

    fn = GF._tma_frag_kernel
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    asm, cons = TF._asm("fp8", nb, False, False) if kind == "fp8" else TF._asm("int4", nb, False, False,
                                                                                 8 // warps if warps > 1 else 4)
    ptr = {"x_ptr": "*bf16", "s_ptr": "*fp32" if kind == "fp8" else "*i64", "ws_ptr": "*fp32", "y_ptr": "*bf16",
           "cnt_ptr": "*i32", "ep_ptr": "*i32"}
    sizes = ("M", "N", "G", "groups_per_split", "stride_xm", "stride_ym")
    ce = dict(NB=nb, W=warps, STAGES=stages, SPLIT_K=True, ACT=0, ASM=asm, CONS=cons, FP8=kind == "fp8",
              FOLD=2.0**120 if kind == "fp8" else 1.0, USE_PDL=True, NSPLIT=8,
              TAG_MB=1 if nb == 1 and kind == "int4" and not sent else 0,
              FLAGS=sent)  # the finish that M = 1 (tagged) or M > 2 (ready flags) runs
    types = {"w_desc": f"tensordesc<i32[8, 128],{lay!r}>", **ptr, **{n: "i32" for n in sizes}}
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptr, *sizes) if n != "M"}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})})


def sass_of(compiled) -> tuple[str, str]:
    """``(SASS, resource usage)`` of a Triton-compiled kernel, from the bundled ``cuobjdump``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return sass, usage


def largest_loop(sass: str) -> collections.Counter:
    rows = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]+)\*/\s+([^;]*);", sass)]
    best = collections.Counter()
    for addr, ins in rows:
        t = re.search(r"BRA\s+.*?0x([0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            lo = int(t.group(1), 16)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                                      for a, i in rows if lo <= a <= addr)  # fmt: skip
            if ops["EXIT"]:  # a retry stub past the kernel's exit jumping back into its loop (mbarrier waits)
                continue
            if sum(ops.values()) > sum(best.values()):
                best = ops
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", type=int, choices=[4, 5, 6, 7], default=4)
    ap.add_argument("--kind", choices=["int4", "fp8"], default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=None, help="codes per tile")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--reps", type=int, default=4, help="MODE 6: repetitions per iteration")
    ap.add_argument("--depth", type=int, default=1, help="MODE 6: DEPTH (1, 2; 3 = 2 without register rotation)")
    ap.add_argument("--maxnreg", type=int, default=0, help="MODE 6: ptxas register cap (MAXNREG; 0 = none)")
    ap.add_argument("--wn", action="store_true", help="MODE 6: the warps split N")
    ap.add_argument("--sent", action="store_true", help="MODE 7: the ready-flag split-K finish (M > 2)")
    ap.add_argument("--nb", type=int, choices=[1, 2], default=1, help="MODE 6: B fragments (2: M 9-16)")
    ap.add_argument("--packed", action="store_true", help="MODE 4: the packed fp16 dot")
    ap.add_argument("--m", type=int, choices=[1, 2, 4], default=1, help="MODE 4: rows (BLOCK_M)")
    args = ap.parse_args()
    if (args.packed or args.m > 1) and args.mode != 4:
        ap.error("--packed / --m: MODE 4 only (--mode 4)")
    for kind in [args.kind] if args.kind else ["int4", "fp8"]:
        cpw = 8 if kind == "int4" else 4
        if args.mode == 7:
            c = compile_tma(kind, args.warps, args.stages or 2, args.nb, args.maxnreg, args.sent)
            # per thread and iteration (one group): 8 / W 16-byte chunks, 32 INT4 or 16 FP8 codes each
            block_n, block_k, stages = args.warps * 32, 8 // args.warps * (32 if kind == "int4" else 16), 1
        elif args.mode == 6:
            c = compile_frag(kind, args.warps, args.reps, args.depth, args.wn, args.nb, args.maxnreg)
            # per thread and iteration: REPS 16-byte loads, 32 INT4 or 16 FP8 codes each
            block_n, block_k, stages = args.warps * 32, args.reps * (32 if kind == "int4" else 16), 1
        elif args.mode == 5:
            block_n, block_k, stages = args.block_n or 128, args.block_k or 128, args.stages or 3
            c = compile_words(kind, block_n, block_k, args.warps, stages)
        else:
            block_n = args.block_n or 4
            block_k = args.block_k or (4096 if kind == "int4" else 2048)
            stages = args.stages or (1 if kind == "int4" else 2)
            c = compile_gemv4(kind, block_n, block_k // cpw, args.warps, stages, args.packed, args.m)
        sass, usage = sass_of(c)
        ops = largest_loop(sass)
        codes_per_thread = block_n * block_k / (args.warps * 32)
        unroll = 3 if args.mode == 6 and args.depth == 3 else 1  # DEPTH 3's loop body holds three iterations
        n = sum(ops.values()) / unroll
        regs = re.search(r"REG:(\d+)", usage)
        label = (f"stages={args.stages or 2} nb={args.nb}" if args.mode == 7
                 else f"reps={args.reps} depth={args.depth} wn={int(args.wn)} nb={args.nb} maxnreg={args.maxnreg}"
                 if args.mode == 6
                 else f"BLOCK_N={block_n} BLOCK_K={block_k} stages={stages} M={args.m} packed={int(args.packed)}")
        print(f"MODE {args.mode} {kind} {label} warps={args.warps}: {regs.group(1) if regs else '?'} registers, "
              f"{n:.0f} instructions per iteration, {n / codes_per_thread:.2f} per code; top (whole loop): "
              f"{ops.most_common(8)}")


if __name__ == "__main__":
    main()
