"""The what-if replay's heavy numerics, exact on the CPU or fast on a GPU, behind one interface.

:func:`open_numerics` returns :class:`Exact` (numerics.py, float64 numpy: the definition) or
:class:`Accelerated` (kvtrace.kernels through ``kernels.compute.open_compute``: the Triton kernels
on CUDA, fp32). Both answer the same three questions of a (request, layer) unit with numpy
float64 results of the same shapes, so the replay does not care which runs:

* :meth:`keep_measures` -- mass recall and output error of one keep-set ([B, Hq, Tq] each);
  :meth:`keep_measures_many` answers many keep-sets of one unit in one kernel pass;
* :meth:`reconstruction` -- per-head (MSE, cosine) of a quantiser's round trip of K or V;
* :meth:`output_error` -- ||o' - o|| / ||o|| of attention over a quantiser's dequantised K and V.

Agreement of :class:`Accelerated` with :class:`Exact` (fp32 accumulation; tests in
tests/kernels/test_whatif_kernels.py and tests/whatif/test_whatif_accelerated.py): recall and
output error within 1e-5 absolute (+1e-4 relative) at test sizes, growing like the fp32 rounding
of a sum over the keys (~1e-7 * sqrt(T): ~2e-5 at 32k keys); MSE and cosine within 1e-9 (the
quantisation kernel rounds and sums in float64, as numerics.py does). A quantiser the kernels do not know, or keys at non-contiguous positions, are
answered by :class:`Exact` (the result is the same, only slower).

No torch at import: ``kvtrace whatif`` runs where only numpy is installed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.whatif import numerics as N
from kvtrace.whatif.policies import FP8, HQQ, KIVI, Quantizer, Quanto

if TYPE_CHECKING:
    from kvtrace.kernels.whatif_config import KernelConfig

__all__ = ["Accelerated", "Exact", "open_numerics", "quant_spec"]


class Exact:
    """numerics.py in float64 on the CPU (the reference). With torch installed the attention
    passes run through whatif/cpu_fast.py (torch's CPU kernels, the same float64 arithmetic up to
    summation order; ``fast=False`` or KVTRACE_WHATIF_NUMPY=1: numerics.py alone)."""

    label = "numpy-float64/cpu"
    note = ""

    def __init__(self, fast: bool | None = None) -> None:
        import os

        from kvtrace.whatif import cpu_fast

        if fast is None:
            fast = os.environ.get("KVTRACE_WHATIF_NUMPY", "") in ("", "0")
        self.fast = bool(fast) and cpu_fast.available()

    def keep_measures(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                      window: int | None, scale: float, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(recall, output error) [B, Hq, Tq] of keep-set ``keep`` [B, Hk, T]."""
        return N.keep_measures(q, k, v, N.visible_mask(q_pos, k_pos, window), scale, keep)

    def keep_measures_many(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                           window: int | None, scale: float, keeps: Sequence[np.ndarray]
                           ) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.fast:
            from kvtrace.whatif import cpu_fast

            return cpu_fast.keep_measures_many(q, k, v, q_pos, k_pos, window, scale, keeps)
        return [self.keep_measures(q, k, v, q_pos, k_pos, window, scale, kp) for kp in keeps]

    def reconstruction(self, pol: Quantizer, x: np.ndarray, which: str) -> tuple[list[float], list[float]]:
        """Per head of ``x`` [B, H, T, D]: (MSE, mean cosine) of ``pol``'s round trip."""
        x2 = pol.roundtrip(x, which)
        per = [N.reconstruction(x[:, h], x2[:, h]) for h in range(x.shape[1])]
        return [m for m, _ in per], [c for _, c in per]

    def output_error(self, pol: Quantizer, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                     k_pos: np.ndarray, window: int | None, scale: float) -> np.ndarray:
        """||o' - o|| / ||o|| [B, Hq, Tq] with ``pol``'s dequantised K and V."""
        if self.fast:
            from kvtrace.whatif import cpu_fast

            return cpu_fast.output_error(q, k, v, pol.roundtrip(k, "key"), pol.roundtrip(v, "value"), q_pos, k_pos,
                                         window, scale)
        vis = N.visible_mask(q_pos, k_pos, window)
        return N.output_error(q, k, v, pol.roundtrip(k, "key"), pol.roundtrip(v, "value"), vis, scale)


def quant_spec(pol: Quantizer, which: str) -> Any:
    """The kernels' QuantSpec for ``pol``'s round trip of K (``which`` "key") or V, or None when
    the kernels do not implement this quantiser (numerics.py answers then)."""
    from kvtrace.kernels.whatif import QuantSpec

    # Exact classes: a subclass may quantise differently (then numerics.py answers).
    if type(pol) is KIVI:
        return QuantSpec(bits=pol.nbits, axis="token" if which == "key" else "channel", group=pol.group_size,
                         residual=pol.residual_length)
    if type(pol) in (Quanto, HQQ):
        return QuantSpec(bits=pol.nbits, axis="channel", group=pol.q_group_size, residual=pol.residual_length)
    if type(pol) is FP8:
        man, emin, top = N.FP8_FORMATS[pol.fmt]
        return QuantSpec(kind="fp8", man=man, emin=emin, top=top)
    return None


def _contiguous(pos: np.ndarray) -> bool:
    return len(pos) == 0 or bool(np.array_equal(pos, pos[0] + np.arange(len(pos))))


class Accelerated:
    """The kernels on one torch device (a :class:`kvtrace.kernels.compute.Compute`)."""

    # Device copies of the unit arrays last used (the replay asks about one unit several times: its
    # keep-sets in one pass per query chunk, then each quantiser's reconstruction and output error):
    # kept up to this many bytes, least recently used dropped first.
    CACHE_BYTES = 2 << 30

    def __init__(self, compute: Any) -> None:
        self.compute = compute
        self.exact = Exact()
        self.label, self.note = compute.label, compute.device_note
        self._cache: OrderedDict[int, tuple[np.ndarray, Any]] = OrderedDict()
        self._cached_bytes = 0

    def _dev(self, a: np.ndarray) -> Any:
        hit = self._cache.get(id(a))
        if hit is not None and hit[0] is a:
            self._cache.move_to_end(id(a))
            return hit[1]
        from kvtrace.kernels.whatif import as_bf16_if_exact

        t = as_bf16_if_exact(self.compute.tensor(a))  # the same values; bf16 dots run them exactly
        self._cache[id(a)] = (a, t)  # the array is held, so its id is not reused while cached
        self._cached_bytes += a.nbytes
        while self._cached_bytes > self.CACHE_BYTES and len(self._cache) > 1:
            _, (old, _) = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        return t

    def _attn_kw(self, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None, scale: float) -> dict[str, Any]:
        return dict(q_positions=self.compute.tensor(np.asarray(q_pos, dtype=np.int64)),
                    k_start=int(k_pos[0]) if len(k_pos) else 0, window=window, scale=scale,
                    backend=self.compute.backend)

    def keep_measures(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                      window: int | None, scale: float, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.keep_measures_many(q, k, v, q_pos, k_pos, window, scale, [keep])[0]

    def keep_measures_many(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                           window: int | None, scale: float, keeps: Sequence[np.ndarray]
                           ) -> list[tuple[np.ndarray, np.ndarray]]:
        if not _contiguous(k_pos) or not keeps:
            return self.exact.keep_measures_many(q, k, v, q_pos, k_pos, window, scale, keeps)
        sets = self.compute.tensor(np.stack([np.asarray(kp, dtype=bool) for kp in keeps]))
        recall, err = self.compute.keep_measures(self._dev(q), self._dev(k), self._dev(v), sets,
                                                 **self._attn_kw(q_pos, k_pos, window, scale))
        import torch

        r, e = torch.stack([recall, err]).double().cpu().numpy()  # one device-to-host copy (one sync)
        return [(r[i], e[i]) for i in range(len(keeps))]

    def reconstruction(self, pol: Quantizer, x: np.ndarray, which: str) -> tuple[list[float], list[float]]:
        spec = quant_spec(pol, which)
        if spec is None:
            return self.exact.reconstruction(pol, x, which)
        import torch

        mse, cos = self.compute.quant_error(self._dev(x), spec, backend=self.compute.backend)
        both = torch.stack([mse, cos]).cpu().tolist()  # one device-to-host copy
        return both[0], both[1]

    def output_error(self, pol: Quantizer, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                     k_pos: np.ndarray, window: int | None, scale: float) -> np.ndarray:
        from kvtrace.kernels.whatif import quant_roundtrip

        ks, vs = quant_spec(pol, "key"), quant_spec(pol, "value")
        if ks is None or vs is None or not _contiguous(k_pos):
            return self.exact.output_error(pol, q, k, v, q_pos, k_pos, window, scale)
        import torch

        from kvtrace.kernels._env import resolve_backend

        kd, vd = self._dev(k), self._dev(v)
        # Round trips in float64 (recorded values sit on coarse grids with many rounding ties,
        # which fp32 breaks differently); the attention kernels then read them in fp32.
        k2, v2 = quant_roundtrip(kd, ks), quant_roundtrip(vd, vs)
        if resolve_backend(self.compute.backend, kd) == "triton":
            k2, v2 = k2.to(torch.float32), v2.to(torch.float32)
        err = self.compute.output_error(self._dev(q), kd, vd, k2, v2, **self._attn_kw(q_pos, k_pos, window, scale))
        return err.double().cpu().numpy()


def open_numerics(device: str = "cpu", backend: str = "auto",
                  kernel_config: KernelConfig | None = None) -> Exact | Accelerated:
    """:class:`Exact` for ``device`` "cpu"; for "auto" or "cuda", :class:`Accelerated` when torch
    runs there on a CUDA device, else :class:`Exact` with ``note`` saying why (the numbers are
    the same, only slower). ``kernel_config``: how the Triton kernels run (None: the defaults,
    kvtrace/kernels/whatif_config.py). Raises ValueError for another device name."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return Exact()
    from kvtrace.kernels.compute import open_compute
    from kvtrace.kernels.whatif_config import DEFAULT_CONFIG

    comp = open_compute(device, backend, kernel_config or DEFAULT_CONFIG)
    exact = Exact()
    if isinstance(comp, str):
        exact.note = f"{'GPU asked for but ' if device == 'cuda' else ''}{comp}: ran the exact numpy reference on the CPU"
        return exact
    if comp.device != "cuda":
        exact.note = comp.device_note.replace("the torch reference", "the exact numpy reference")
        return exact
    return Accelerated(comp)
