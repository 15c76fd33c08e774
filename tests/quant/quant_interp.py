"""The quant kernel modules re-decorated for the CPU interpreter, for test modules that set
``TRITON_INTERPRET=1`` themselves: another test module may have imported the kernels before the flag
was set (``triton.jit`` reads it at decoration time)."""

import importlib

from infercore.quant import triton_w8a8, triton_wo, wo_gemv, wo_packed, wo_tables, wo_tiles, wo_words


def reload_for_interpreter() -> None:
    """Reload the kernel modules unless they were decorated under the interpreter already; the modules
    that others import from are reloaded first, so every ``from ... import`` picks up the new kernels."""
    if triton_wo._INTERPRET and triton_w8a8._INTERPRET:
        return
    for mod in (wo_tiles, wo_packed, wo_gemv, wo_words, wo_tables, triton_wo, triton_w8a8):
        importlib.reload(mod)
