"""Bounds on the model-config values that size anything (a config is data someone else may have made).

A trace stores its model's ``config.to_dict()`` (``/meta model_config_json``); the analyser, the
report, what-if and ``calc --trace`` build lists and arrays from it: layer lists from
``num_hidden_layers``, head pairings from ``num_attention_heads``, float arithmetic from the sizes.
A hostile file holding ``num_attention_heads: 8000000000`` asked ``analyze --contents`` for 24 GB,
and ``10**400`` or a string where an integer belongs raised inside numpy (exit 70). So before a
config sizes anything it is checked here: every sizing value is an integer (or an integral
float) within a ceiling far above any released model, no integer anywhere in the config has more
than 64 bits, and the recorded /layers rows agree with the heads the config declares.

:func:`config_problems` lists what breaks (``kvtrace validate`` reports each); :func:`checked_config`
is what commands call before they size anything from a trace's config: the config, or
InvalidTrace (exit 1) naming the first problem; :func:`kvtrace.geometry.model_geometry` raises
ValueError on the same problems, so no config (a ``calc --config`` file included) sizes anything
unchecked. The standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["CEILINGS", "checked_config", "config_problems", "recorded_problems"]

LAYERS_MAX = 1 << 14  # decoder layers: released models have up to ~200
HEADS_MAX = 1 << 14  # attention / KV heads and experts: up to a few hundred
DIM_MAX = 1 << 16  # head dims and latent ranks: up to ~1,024
WIDTH_MAX = 1 << 20  # hidden and feed-forward widths: up to ~100k
VOCAB_MAX = 1 << 24  # vocabularies: up to ~260k (byte-level ones 2^24 at most)
TOKENS_MAX = 1 << 40  # windows, chunks, positions: no cache holds a trillion tokens
INT64_MAX = (1 << 63) - 1

_GROUPS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (LAYERS_MAX, ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "decoder_layers",
                  "num_kv_shared_layers", "max_window_layers", "first_k_dense_replace")),
    (HEADS_MAX, ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_head_kv", "num_heads",
                 "decoder_attention_heads", "num_global_key_value_heads", "multi_query_group_num",
                 "num_local_experts", "n_routed_experts", "num_experts", "num_experts_per_tok", "n_shared_experts")),
    (DIM_MAX, ("head_dim", "global_head_dim", "d_kv", "attention_head_size", "kv_lora_rank", "q_lora_rank",
               "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")),
    (WIDTH_MAX, ("hidden_size", "d_model", "n_embd", "dim", "intermediate_size", "moe_intermediate_size", "ffn_dim",
                 "d_ff", "n_inner")),
    (VOCAB_MAX, ("vocab_size",)),
    (TOKENS_MAX, ("sliding_window", "sliding_window_size", "attention_chunk_size", "max_position_embeddings",
                  "n_positions")),
)
CEILINGS: dict[str, int] = {key: ceiling for ceiling, keys in _GROUPS for key in keys}
_SCALARS = {"query_pre_attn_scalar": float(1 << 24)}  # a positive number (gemma: 144 or 256)
_HEAD_KEYS = ("decoder_attention_heads", "num_attention_heads", "num_heads", "n_head")  # geometry's order
MAX_LISTED = 8


def _shown(value: Any) -> str:
    """A hostile value, described in a few words (never 400 digits or a megabyte of text)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        bits = abs(value).bit_length()  # str() of more than 4,300 digits raises: count them from the bits
        return f"an integer of {len(str(abs(value))) if bits < 14000 else int(bits * math.log10(2)) + 1} digits"
    text = repr(value[:40] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def _sizing_problem(where: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if key in _SCALARS:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and 0 < value <= _SCALARS[key])  # NaN fails the comparison, inf the ceiling
        return None if ok else f"{where}{key} is {_shown(value)}: a positive number up to {_SCALARS[key]:,.0f} belongs there"
    ceiling = CEILINGS[key]
    # one value per layer or stage (gemma3n intermediate_size, ernie moe_intermediate_size, vision
    # configs' num_heads), or per part (lxmert num_hidden_layers): each within the ceiling
    values = list(value.values()) if isinstance(value, Mapping) else value if isinstance(value, list) else [value]
    for v in values[:LAYERS_MAX + 1]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not (
                math.isfinite(v) and v.is_integer())) or not 0 <= v <= ceiling:
            return f"{where}{key} is {_shown(v)}: an integer in [0, {ceiling:,}] belongs there"
    if len(values) > LAYERS_MAX:
        return f"{where}{key} lists {len(values):,} values (more than {LAYERS_MAX:,} layers)"
    return None


def _sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The parts of a config that kvtrace.geometry reads sizes from: the config, its text_config,
    and their per-layer overrides."""
    out: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    tc = config.get("text_config")
    if isinstance(tc, Mapping):
        out.append(("text_config.", tc))
    for prefix, part in list(out):
        plc = part.get("per_layer_config")
        if isinstance(plc, Mapping):
            out += [(f"{prefix}per_layer_config.{str(k)[:20]}.", v) for k, v in list(plc.items())[:LAYERS_MAX]
                    if isinstance(v, Mapping)]
    return out


def _big_integers(config: Any) -> list[str]:
    """Paths of integers beyond 64 bits anywhere in the config (no model config holds one; Python
    reads them, numpy and float arithmetic do not). Iterative: the document's depth is the reader's."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", config)]  # containers only: scalars are checked in place
    while stack and len(found) < MAX_LISTED:
        path, obj = stack.pop()
        for k, v in (obj.items() if isinstance(obj, Mapping) else enumerate(obj)):
            if isinstance(v, (Mapping, list)):
                stack.append((f"{path}{str(k)[:20]}.", v))
            elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX and len(found) < MAX_LISTED:
                found.append(f"{path}{str(k)[:20]} is {_shown(v)}: no model config holds an integer beyond 64 bits")
    return found


def config_problems(config: Any) -> list[str]:
    """Why ``config`` (a trace's stored model config) cannot size anything: one line each, at most
    a few; empty when every sizing value is within its ceiling."""
    if not isinstance(config, Mapping):
        return [f"the model config is {type(config).__name__}, not an object"] if config is not None else []
    problems: list[str] = []
    for where, part in _sections(config):
        for key in (*CEILINGS, *_SCALARS):
            problem = _sizing_problem(where, key, part.get(key))
            if problem is not None:
                problems.append(problem)
        types = part.get("layer_types")
        if types is not None and (not isinstance(types, list) or len(types) > LAYERS_MAX
                                  or not all(isinstance(t, str) for t in types[:LAYERS_MAX])):
            problems.append(f"{where}layer_types is not a list of at most {LAYERS_MAX:,} layer type names")
    seen = set(problems)
    problems += [p for p in _big_integers(config) if not any(p.split(" is ")[0] in q for q in seen)]
    return problems[:MAX_LISTED]


def recorded_problems(config: Any, layers: Any) -> list[str]:
    """The config against the trace's own /layers rows: no layer caches more KV heads than the
    model has attention heads (even an expanded MLA cache holds one per head; a tensor-parallel
    rank holds a share). Checked only where the config names its heads."""
    if not isinstance(config, Mapping) or layers is None or not len(layers):
        return []
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    heads = next((cfg.get(k) for k in _HEAD_KEYS if cfg.get(k) is not None), None)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        return []
    try:
        recorded = int(max(int(h) for h in layers["num_kv_heads"]))
    except (ValueError, TypeError, KeyError, IndexError):
        return []
    if recorded > heads:
        return [f"num_attention_heads is {heads:,} but /layers records a layer caching {recorded:,} KV heads"]
    return []


def checked_config(trace: Any, layers: Any = None) -> dict[str, Any]:
    """The model config of ``trace`` (an open Trace: ``meta.model_config``), once its
    sizes are within bounds (:func:`config_problems`; :func:`recorded_problems` against ``layers``,
    its /layers rows, when given); else InvalidTrace (exit 1) naming the first problem."""
    config = trace.meta.model_config
    problems = config_problems(config) or recorded_problems(config, layers)
    if problems:
        from kvtrace.format.errors import InvalidTrace  # here: geometry itself never needs the format

        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidTrace(f"{trace.path}: /meta model_config_json: {problems[0]}{more}; "
                           "'kvtrace validate' lists every problem")
    return config if isinstance(config, dict) else dict(config or {})
