"""Static SASS of the paged decode-attention kernel (``ops/attention/triton_decode.py``) for sm90, per KV format.

No GPU needed: Triton compiles ``_decode_kernel`` for ``cuda:90`` on the CPU (as a real launch specializes them,
pointers and strides are divisible by 16) and its bundled ``cuobjdump`` prints the SASS. Reports the largest loop's
instructions, the byte-wide shared loads (``LDS.U8`` / ``LDS.S8``: 1-byte codes read back one at a time), the
``ldmatrix`` loads, registers and shared memory. Static counts, not timings; the Triton here may differ from the GPU
machine's.

    python benchmarks/sass_decode_attn.py                              # every format, the TUNING defaults
    python benchmarks/sass_decode_attn.py --kv int8 --no-v16 --block-n 128 --warps 4   # the paths before
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from sass_count import largest_loop, sass_of  # noqa: E402

from infercore.ops.attention import triton_decode as TD  # noqa: E402

CACHE = {"bf16": (0, "bf16"), "int8": (1, "i8"), "fp8": (2, "fp8e4nv"), "fp8_emulated": (3, "u8")}


def compile_decode(kv: str, block_n: int, warps: int, stages: int, v16: bool, f16: bool):
    """``_decode_kernel`` for bf16 queries over a ``kv`` cache: head dim 128, page 16, GQA group padded to 16, split
    partials on, no window / softcap / PDL / fused RoPE."""
    mode, cache = CACHE[kv]
    fn = TD._decode_kernel
    ptr = {"q_ptr": "*bf16", "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}", "ksc_ptr": "*fp32", "vsc_ptr": "*fp32",
           "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*bf16", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
           "kn_ptr": "*bf16", "vn_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
           "sinks_ptr": "*fp32"}
    floats = {"qk_scale", "scale", "softcap", "code_scale"}
    ce = dict(HEAD_DIM=128, PAGE=16, SPLIT=True, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=128, HAS_WINDOW=False,
              HAS_SOFTCAP=False, DOT_PRECISION="tf32", KV_MODE=mode, PREWAIT=False, USE_PDL=False, FUSE_ROPE=False,
              IS_NEOX=True, V16=v16 and mode > 0, F16=f16 and mode > 1, HAS_SINKS=False)
    sig = {n: "constexpr" if n in ce else ptr.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or (n.startswith("stride") and n not in fn.do_not_specialize)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in ce.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", choices=list(CACHE), default=None, help="cache format (default: all four)")
    ap.add_argument("--block-n", type=int, default=None, help="keys per tile (default: TUNING's for the format)")
    ap.add_argument("--warps", type=int, default=None, help="warps per program (default: TUNING's)")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--no-v16", dest="v16", action="store_false", help="1-byte caches: stage V as codes")
    ap.add_argument("--no-f16", dest="f16", action="store_false", help="FP8 caches: q's dtype for the dots")
    args = ap.parse_args()
    tiles = {"bf16": ("block_n", "num_warps"), "int8": ("block_n_codes", "num_warps_codes")}
    for kv in [args.kv] if args.kv else list(CACHE):
        bn_key, w_key = tiles.get(kv, ("block_n_fp8", "num_warps_fp8"))
        bn, warps = args.block_n or TD.TUNING[bn_key], args.warps or TD.TUNING[w_key]
        stages = args.stages or TD.TUNING["num_stages"]
        c = compile_decode(kv, bn, warps, stages, args.v16 and TD.TUNING["kv_v16"], args.f16 and TD.TUNING["fp8_f16"])
        sass, usage = sass_of(c)
        ops = largest_loop(sass)
        every = collections.Counter(m.group(1) for m in re.finditer(r"\s(LDS(?:\.\w+)*|LDSM(?:\.\w+)*)\s", sass))
        narrow = sum(v for k, v in every.items() if re.match(r"LDS\.(U8|S8)", k))
        ldsm = sum(v for k, v in every.items() if k.startswith("LDSM"))
        regs = re.search(r"REG:(\d+)", usage)
        print(f"{kv} BLOCK_N={bn} warps={warps} stages={stages}: {regs.group(1) if regs else '?'} registers, "
              f"{c.metadata.shared} B shared, largest loop {sum(ops.values())} instructions "
              f"({sum(ops.values()) / (2 * bn * 128 / (warps * 32)):.1f} per K / V value a thread); kernel: "
              f"{narrow} byte-wide shared loads, {ldsm} ldmatrix; loop top {ops.most_common(6)}")


if __name__ == "__main__":
    main()
