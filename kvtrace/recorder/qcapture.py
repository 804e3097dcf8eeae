"""Post-RoPE query capture through transformers' attention-interface registry.

Attention modules in transformers 5.x call ``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)(module, query, key, value, mask, ...)``
with the query already rotated. We register a wrapper under a new name that hands ``query`` to a
callback and then calls exactly the function the model would have called, and point the model's
configs at that name. ``restore()`` puts every config's original value back and unregisters.

The new name embeds the original one (``kvtrace_q<n>:sdpa``) because transformers tests
implementations by substring (``"flash" in name``); the mask-function registry gets the same
entry as the original so masks are built identically. Known limit: the few model files that test
``_attn_implementation == "sdpa"`` literally (e.g. gemma4's logits slicing shortcut) take their
generic path while capture is installed.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

_ATTR = "_attn_implementation_internal"  # the field behind config._attn_implementation
_counter = itertools.count()
_MISSING = object()


def _model_configs(model: nn.Module) -> list[Any]:
    """Every config the model's modules dispatch on: the top one, sub-configs, submodels'."""
    from transformers import PretrainedConfig

    found: dict[int, Any] = {}
    stack = [getattr(model, "config", None)] + [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if not isinstance(cfg, PretrainedConfig) or id(cfg) in found:
            continue
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            stack.append(getattr(cfg, key, None))
    return list(found.values())


class QueryCapture:
    """``QueryCapture(model, callback).install()`` ... ``.restore()`` (or use as a context manager).

    ``callback(layer_idx, query)`` receives the post-RoPE query [B, Hq, T, D] of every call made
    by a module with an integer ``layer_idx`` (or only by ``modules`` when given). Exceptions
    from the callback are counted in ``errors`` and never reach the model. ``group_sizes[layer]``
    holds query heads per KV head as seen at the last call.
    """

    def __init__(
        self,
        model: nn.Module,
        callback: Callable[[int, torch.Tensor], None],
        *,
        modules: Iterable[nn.Module] | None = None,
    ) -> None:
        self.model = model
        self.callback = callback
        self._only = None if modules is None else {id(m) for m in modules}
        self.installed = False
        self.errors = 0
        self.calls = 0
        self.last_error = ""
        self.group_sizes: dict[int, int] = {}
        self._token = next(_counter)
        self._saved: list[tuple[Any, Any]] = []  # (config, original value or _MISSING)
        self._keys: dict[str, str] = {}  # registered name -> original implementation
        self._resolved: dict[tuple[type, str], Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def name_for(self, original: str) -> str:
        return f"kvtrace_q{self._token}:{original}"

    # ---- install / restore ------------------------------------------------------------------

    def install(self) -> None:
        """Switch the model to the wrapper. Raises before changing anything if an attention
        module's original function cannot be resolved."""
        if self.installed:
            return
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        configs = [c for c in _model_configs(self.model) if isinstance(getattr(c, _ATTR, None), str)]
        originals = {getattr(c, _ATTR) for c in configs}
        for module in self.model.modules():  # fail before touching anything
            namespace = sys.modules.get(type(module).__module__)
            original = getattr(getattr(module, "config", None), _ATTR, None)
            dispatches = hasattr(namespace, "ALL_ATTENTION_FUNCTIONS")
            if dispatches and isinstance(original, str) and isinstance(getattr(module, "layer_idx", None), int):
                self._original_fn(module, original, strict=True)
        for original in sorted(originals):
            name = self.name_for(original)
            self._keys[name] = original
            AttentionInterface.register(name, self._make_wrapper(original))
            if original in AttentionMaskInterface._global_mapping:
                AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
        for cfg in configs:
            self._saved.append((cfg, cfg.__dict__.get(_ATTR, _MISSING)))
            object.__setattr__(cfg, _ATTR, self.name_for(getattr(cfg, _ATTR)))
        self.installed = True

    def restore(self) -> None:
        """Put back every config's exact original value and unregister our names. Idempotent."""
        if not self.installed:
            return
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        for cfg, value in reversed(self._saved):
            if value is _MISSING:
                cfg.__dict__.pop(_ATTR, None)
            else:
                object.__setattr__(cfg, _ATTR, value)
        self._saved.clear()
        for name in self._keys:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
        self._keys.clear()
        self._resolved.clear()
        self.installed = False

    def __enter__(self) -> QueryCapture:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    # ---- the wrapper ------------------------------------------------------------------------

    def _original_fn(self, module: nn.Module, original: str, strict: bool = False) -> Callable[..., Any]:
        """What the module's own forward would fetch: its file's ALL_ATTENTION_FUNCTIONS
        (which may carry local overrides) with its file's eager_attention_forward as default."""
        key = (type(module), original)
        fn = self._resolved.get(key)
        if fn is not None:
            return fn
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        namespace = sys.modules.get(type(module).__module__)
        interface = getattr(namespace, "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
        try:  # get_interface(name, default) is `interface[name]` else `default`
            fn = interface[original]
        except KeyError:
            fn = getattr(namespace, "eager_attention_forward", None)
        if fn is None:
            if strict:
                raise RuntimeError(
                    f"query capture: cannot find the {original!r} attention function of "
                    f"{type(module).__name__} (module {type(module).__module__})"
                )
            raise KeyError(original)
        self._resolved[key] = fn
        return fn

    def _make_wrapper(self, original: str) -> Callable[..., Any]:
        def kvtrace_query_capture(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            fn = self._original_fn(module, original)
            layer = getattr(module, "layer_idx", None)
            if isinstance(layer, int) and (self._only is None or id(module) in self._only):
                self._capture(layer, query, key)
            return fn(module, query, key, value, *args, **kwargs)

        return kvtrace_query_capture

    def _capture(self, layer: int, query: Any, key: Any) -> None:
        import torch

        if torch.compiler.is_compiling():  # never put a Python callback into a compiled graph
            return
        try:
            if getattr(key, "dim", None) and key.dim() == 4 and key.shape[1] and query.shape[1] % key.shape[1] == 0:
                self.group_sizes[layer] = query.shape[1] // key.shape[1]
            self.calls += 1
            self.callback(layer, query)
        except Exception as exc:  # noqa: BLE001 - a recorder failure must not reach the model
            with self._lock:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
