"""Launching the what-if Triton kernels (kvtrace/kernels/_triton_whatif.py has the overview).
Imported lazily.

A :class:`Launcher` is made per call from the caller's ``KernelConfig.direct_launch`` and
``KernelFallbacks``: on CUDA, after a kernel's first call for a specialisation, later calls go
through the compiled kernel's own launcher (Triton's call path -- argument binding, cache key,
autotuner lookup -- cost ~50 us of Python per launch on the H200's host, several times a decode
step's kernel). The compiled kernels are cached for the process (``_COMPILED``): a cache, the same
bits either way.
"""

from __future__ import annotations

import triton

from kvtrace.kernels._env import interpreting
from kvtrace.kernels.whatif_config import KernelFallbacks

_COMPILED: dict = {}


def _spec(x) -> object:
    """What Triton specialises a runtime argument on (dtype and 16-byte alignment of a tensor; an
    int's ==1, %16 and 32/64-bit class), or a little more: a key that never maps two different
    compilations to one entry."""
    if isinstance(x, bool):
        return ("b", x)
    if isinstance(x, int):
        return (x == 1, x % 16 == 0, -2**31 <= x < 2**31)
    if isinstance(x, float):
        return "f"
    return (x.dtype, x.data_ptr() % 16 == 0)


class Launcher:
    """Launches kernels for one call: directly after their first call when ``direct`` (and no
    direct launch failed in this run), and records in ``fallbacks`` what had to be replaced."""

    __slots__ = ("direct", "fallbacks")

    def __init__(self, direct: bool = True, fallbacks: KernelFallbacks | None = None) -> None:
        self.direct = direct
        self.fallbacks = KernelFallbacks() if fallbacks is None else fallbacks

    def __call__(self, tag: str, fn, grid, args: tuple, consts: dict) -> None:
        """``fn[grid](*args, **consts)``, through the compiled launcher where it can. ``grid``: a
        tuple or a callable of the constexprs (the autotuner's choice included); ``args``: the
        kernel's runtime arguments in signature order, ``consts`` its constexprs."""
        fb = self.fallbacks
        if interpreting() or not self.direct or fb.off(fb.DIRECT_LAUNCH) or not hasattr(triton, "knobs"):
            fn[grid](*args, **consts)  # knobs: triton >= 3.4
            return
        key = (tag, *map(_spec, args), *consts.items())
        hit = _COMPILED.get(key)
        if hit is None:
            compiled = fn[grid](*args, **consts)  # compiles (and autotunes) on the first call
            meta = dict(consts)
            if isinstance(fn, triton.runtime.Autotuner):
                meta.update(fn.best_config.kwargs)
            names = fn.arg_names[len(args):]  # the constexprs trail every kernel's runtime arguments
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                _COMPILED[key] = (compiled, meta, tuple(meta[n] for n in names))
            return
        compiled, meta, tail = hit
        g = grid(meta) if callable(grid) else grid
        g = (*g, 1, 1)
        knobs = triton.knobs.runtime
        stream = triton.runtime.driver.active.get_current_stream(triton.runtime.driver.active.get_current_device())
        full = (*args, *tail)
        try:  # as JITFunction.run launches in triton 3.6 (every argument, constexprs included)
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(g, stream, *full), knobs.launch_enter_hook, knobs.launch_exit_hook,
                         *full)
        except (TypeError, AttributeError) as exc:  # a Triton whose launcher differs: its own call path
            fb.turn_off(fb.DIRECT_LAUNCH, f"direct launches unavailable ({type(exc).__name__}: {str(exc)[:200]}); "
                                          "Triton's call path")
            fn[grid](*args, **consts)
