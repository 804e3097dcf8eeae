"""One model pass per policy for the what-if rerun (kvtrace.whatif.rerun).

The rerun's definition is a teacher-forced pass that feeds one token per forward, the policy
applied to each layer's cache after every step (rerun.PolicyLayer). :func:`one_pass_logprobs`
computes the same thing in one forward over the whole text:

* the model runs without a cache; a wrapper registered with transformers' ``AttentionInterface``
  (through kvtrace.recorder.qcapture, so masks and implementation checks see the model's own
  implementation) receives each attention layer's post-RoPE queries, keys and values of every
  position at once;
* inside it the layer's queries are taken row by row: the prefill block first (the model's own
  causal / sliding mask, sliced), then one position at a time -- ``PolicyLayer.update`` with that
  position's key and value, the model's own attention function over what the layer holds (every
  held key visible, as with one query per step), then ``PolicyLayer.after_attention`` (the
  eviction, with the queries so far for query-based policies);
* the layer's output rows go on to the next layer, which thus sees at position t exactly the
  hidden state the per-token loop computes at step t: the forward is causal, and what position
  t's attention read at every layer depends only on the keep-sets up to step t.

So every policy -- score-based ones whose decisions depend on attention under earlier keep-sets
(observed_attention, snapkv, tova, expected_attention), key-only ones, streaming_llm's sinks,
random's seeded scores, the quantisers' round trips of the whole cache every step -- runs its own
unchanged code with the same state at every step; the only difference from the per-token loop is
the float rounding of projections and MLPs computed for all positions in one matmul
(tests/whatif/test_rerun_pass.py: logits within 1e-5, the same keep-sets, unscored and
over-budget steps, policy by policy, on tiny llama, gemma3 (sliding layers), with a prefill, and
under transformers 5.17 and 5.24).

Not expressible (:class:`NotRowDriven`; the caller then runs the per-token loop and says so):
attention masks that are not tensors (flex attention's BlockMask), attention layers that do not
dispatch through the interface or get keys of another length than the text's, and encoder-decoder
models (refused before either path).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvtrace.recorder.qcapture import QueryCapture

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["NotRowDriven", "RowDriver", "one_pass_logprobs"]


class NotRowDriven(RuntimeError):
    """The model cannot be driven row by row in one pass (the reason); the per-token loop runs."""


_ROW_SLICED = ("position_ids", "cache_position")  # per-position kwargs an attention function may read


class RowDriver(QueryCapture):
    """A QueryCapture whose wrapper replaces each attention call of a wrapped layer by the
    row-by-row loop over the layer's positions (module docstring). ``first``: the prefill block's
    length (>= 1); ``queries``: whether the layers keep their queries (query-based policies)."""

    def __init__(self, model: Any, layers: list[Any], first: int, queries: bool) -> None:
        super().__init__(model, lambda _layer, _q: None)
        self.layers, self.first, self.queries = layers, first, queries
        self.problem = ""

    def _make_wrapper(self, original: str) -> Any:
        def kvtrace_rerun_rows(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            fn = self._original_fn(module, original)
            idx = getattr(module, "layer_idx", None)
            if not isinstance(idx, int) or not 0 <= idx < len(self.layers) or self.problem:
                return fn(module, query, key, value, *args, **kwargs)
            try:
                return self._drive(fn, module, self.layers[idx], query, key, value, args, kwargs)
            except NotRowDriven as exc:
                self.problem = self.problem or str(exc)
                return fn(module, query, key, value, *args, **kwargs)

        return kvtrace_rerun_rows

    def _drive(self, fn: Any, module: Any, layer: Any, query: Any, key: Any, value: Any,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, None]:
        import torch

        n = query.shape[2]
        if key.shape[2] != n or layer.seen:
            raise NotRowDriven(f"layer {layer_index(module)} attends {key.shape[2]} keys for {n} queries "
                               "(not the text's own keys)")
        args = list(args)
        if args:
            mask = args.pop(0)
        else:
            mask = kwargs.pop("attention_mask", None)
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise NotRowDriven(f"the attention mask is a {type(mask).__name__}, not a tensor")
        first = min(self.first, n)
        outs = []
        for start, stop in [(0, first)] + [(t, t + 1) for t in range(first, n)]:
            k, v = layer.update(key[:, :, start:stop], value[:, :, start:stop])
            q = query[:, :, start:stop]
            if self.queries:
                layer.add_queries(q)
            # the prefill block: the model's own mask over its first positions; a single row: every
            # held key visible (the per-token loop's mask for one query)
            m = None if mask is None or stop - start == 1 else mask[..., start:stop, :stop]
            row_kw = {name: (x[..., start:stop] if name in _ROW_SLICED and isinstance(x, torch.Tensor)
                             and x.shape[-1] == n else x) for name, x in kwargs.items()}
            out = fn(module, q, k, v, m, *args, **row_kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
            layer.after_attention()
        return torch.cat(outs, dim=1), None


def layer_index(module: Any) -> Any:
    return getattr(module, "layer_idx", "?")


class _KVProbe(QueryCapture):
    """Records the keys and values each layer's attention function receives."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, lambda _layer, _q: None)
        self.seen: dict[int, tuple[Any, Any]] = {}

    def _make_wrapper(self, original: str) -> Any:
        def kvtrace_rerun_probe(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int):
                self.seen[idx] = (key, value)
            return self._original_fn(module, original)(module, query, key, value, *args, **kwargs)

        return kvtrace_rerun_probe


@contextmanager
def _installed(capture: QueryCapture) -> Iterator[None]:
    """``capture`` installed for the block (NotRowDriven where it cannot be), restored after."""
    try:
        capture.install()
    except RuntimeError as exc:
        raise NotRowDriven(str(exc)) from None
    try:
        yield
    finally:
        capture.restore()


def check_drivable(model: Any, ids: torch.Tensor) -> None:
    """:class:`NotRowDriven` unless, on a one-token forward through a plain cache, every cache
    layer is given exactly the keys and values its attention function then reads: a model that
    caches something else (an MLA latent up-projected after the cache, padded values) would be
    pressed on other tensors in one pass than by the definition."""
    import torch
    from transformers import DynamicCache

    from kvtrace.recorder.hooks import cache_keyword

    cache = DynamicCache(config=model.config)
    given: dict[int, tuple[Any, Any]] = {}
    for i, layer in enumerate(cache.layers):
        def update(k: Any, v: Any, *args: Any, _i: int = i, _orig: Any = layer.update, **kwargs: Any) -> Any:
            given[_i] = (k, v)
            return _orig(k, v, *args, **kwargs)

        layer.update = update
    probe = _KVProbe(model)
    with _installed(probe), torch.no_grad():
        model(input_ids=ids[:, :1], use_cache=True, **{cache_keyword(model.forward): cache})
    for i in range(len(cache.layers)):
        if i not in given or i not in probe.seen:
            raise NotRowDriven(f"cache layer {i} is not updated and read through the attention interface")
        (k, v), (ka, va) = given[i], probe.seen[i]
        if k.shape != ka.shape or v.shape != va.shape or not (torch.equal(k, ka) and torch.equal(v, va)):
            raise NotRowDriven(f"cache layer {i} holds K/V {list(k.shape)} / {list(v.shape)} while attention reads "
                               f"{list(ka.shape)} / {list(va.shape)} (e.g. an MLA latent, up-projected after the cache)")


def one_pass_logprobs(model: Any, ids: torch.Tensor, layers: list[Any], prefill: int,
                      queries: bool) -> np.ndarray:
    """Next-token log-probabilities [N, V] (float64) of one forward over ``ids`` [1, N] with the
    policy ``layers`` (rerun.PolicyLayer, fresh) driven row by row; :class:`NotRowDriven` where the
    model cannot be (the layers are then spent: build new ones for the per-token loop)."""
    import torch

    check_drivable(model, ids)
    driver = RowDriver(model, layers, max(prefill, 1), queries)
    with _installed(driver), torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    if driver.problem:
        raise NotRowDriven(driver.problem)
    n = ids.shape[1]
    missed = [i for i, x in enumerate(layers) if x.seen != n]
    if missed:
        raise NotRowDriven(f"cache layers {missed} were not driven through the attention interface")
    return torch.log_softmax(out.logits[0].double(), dim=-1).cpu().numpy()
