"""How the what-if Triton kernels run (:class:`KernelConfig`, passed by the caller) and what a run
had to replace (:class:`KernelFallbacks`, held by the caller for the run). Imports neither torch
nor triton: callers that only choose a configuration need neither.

The defaults are the measured winners on an H200 (docs/benchmarks.md, the what-if kernels):

* ``exact_decode`` -- fewer than 16 query rows per KV head (a decode step) with fp32 K or V: the
  exact fp32 CUDA-core kernel, no bf16-grid check pass and no host sync (32k keys, one query,
  fp32 values: 0.439 ms a call against 0.736 for the packed kernel after the check). Off: the
  packed tensor-core kernel after the grid check (the exact kernel's fallback).
* ``pieces`` -- 16+ query rows per KV head: the signature-pieces path (one attention pass for all
  keep-sets) always (True), never (False: the shared-max kernel), or where its cost model says it
  pays ("auto": 32k keys x 64 queries 2.17 ms against 3.87 for the shared-max kernel; small calls
  stay on the shared-max kernel, whose fixed cost is lower).
* ``direct_launch`` -- after a kernel's first call through Triton, later calls of the same
  specialisation through its compiled launcher (0.491 vs 0.558 ms a decode-step call, the same
  bits). Off: Triton's own call path every time.

All settings compute the same numbers within the kernels' tolerances; they choose the speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_CONFIG", "KernelConfig", "KernelFallbacks"]


@dataclass(frozen=True)
class KernelConfig:
    """The what-if kernels' choices (module docstring); the defaults are the measured winners."""

    exact_decode: bool = True
    pieces: bool | Literal["auto"] = "auto"
    direct_launch: bool = True

    def __post_init__(self) -> None:
        if self.pieces not in (True, False, "auto"):
            raise ValueError(f"pieces must be True, False or 'auto', got {self.pieces!r}")


DEFAULT_CONFIG = KernelConfig()


class KernelFallbacks:
    """The kernels a run replaced by another (a compiler or launcher that rejected them), each
    with why: once a kernel failed here it is not tried again by calls given this record. A
    caller holds one per run (``kernels.compute.Compute`` does) and may report ``notes``; a call
    given none gets a fresh one (the failure is then retried by the next call)."""

    DIRECT_LAUNCH = "direct launch"
    SHARED = "shared-max kernel"
    PIECES = "signature pieces"

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._off: set[str] = set()

    @staticmethod
    def exact_decode(gp: int) -> str:
        """The key of the exact few-query kernel compiled for ``gp`` query rows (padded)."""
        return f"exact decode (GP {gp})"

    def off(self, key: str) -> bool:
        """Whether the kernel ``key`` failed in this run (and is not to be tried again)."""
        return key in self._off

    def turn_off(self, key: str, note: str) -> None:
        """Record that ``key`` failed: ``note`` says why and what answers instead."""
        self._off.add(key)
        self.notes.append(note)

    def __repr__(self) -> str:
        return f"KernelFallbacks({self.notes!r})"
