"""vLLM's "KV cache size" line predicted from a model config and a KV memory budget
(``kvtrace calc --engine vllm``), and checked against an engine trace's ``cache_config_info``.

vLLM v1 (0.32.0, ``vllm/v1/core/kv_cache_utils.py``) sizes a full-attention model's pool as
``num_blocks = budget // page_bytes // layers`` with ``page_bytes = block_size x 2 (K, V) x kv_heads x
head_dim x dtype bytes`` per layer, then logs ``KV cache size: num_blocks x block_size tokens,
Maximum concurrency for L tokens per request: num_blocks / ceil(L / block_size) x``. The budget is
``--kv-cache-memory-bytes`` when given; otherwise vLLM measures it at start (free memory x
``gpu_memory_utilization`` less weights and activations), which no config can predict.

The KV dtype ``auto`` is the model's dtype, except that vLLM runs float32 checkpoints in 16 bits
(bfloat16 on the CPU backend, float16 on GPUs) unless ``--dtype float32`` is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import BadOption

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


@dataclass
class VllmPool:
    block_size: int
    page_bytes_per_layer: int
    layers: int
    num_blocks: int
    tokens: int
    max_concurrency: float
    kv_dtype: str
    dtype_note: str

    def line(self, context: int) -> str:
        return (f"KV cache size: {self.tokens:,} tokens, Maximum concurrency for {context:,} tokens per request: "
                f"{self.max_concurrency:.2f}x")


def _int(cfg: dict[str, Any], *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def predict(config: dict[str, Any], budget_bytes: int, context: int, block_size: int = 16,
            kv_dtype: str | None = None, device: str = "cpu") -> VllmPool:
    """The pool vLLM builds for `config` with `budget_bytes` of KV memory (see the module docstring).
    BadOption for a model whose layers are not all full attention (its groups are sized otherwise)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if cfg.get("kv_lora_rank") or any(t not in ("full_attention", "attention") for t in cfg.get("layer_types") or []):
        raise BadOption("calc --engine vllm predicts full-attention models only (MLA, sliding-window and hybrid "
                        "models get other KV groups in vLLM)", "--engine")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    hidden = _int(cfg, "hidden_size", "n_embd")
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        raise BadOption("the model config names no layer count, KV heads and head size", "--config")
    if block_size <= 0:
        raise BadOption(f"block size {block_size}: at least 1", "--engine")
    note = "as given"
    if kv_dtype is None or kv_dtype == "auto":
        model = str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
        if model == "float32":
            kv_dtype = "bfloat16" if device == "cpu" else "float16"
            note = f"auto: the checkpoint's float32 run in {kv_dtype} (vLLM's default on the {device} backend)"
        else:
            kv_dtype, note = model, "auto: the checkpoint's dtype"
    if kv_dtype not in DTYPE_BYTES:
        raise BadOption(f"KV dtype {kv_dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}", "--kv-dtype")
    page = block_size * 2 * kv_heads * head_dim * DTYPE_BYTES[kv_dtype]
    blocks = budget_bytes // page // layers
    per_request = math.ceil(context / block_size) if context > 0 else 1
    return VllmPool(block_size, page, layers, blocks, blocks * block_size, blocks / per_request, kv_dtype, note)


def element_bytes(config: dict[str, Any], block_size: int, bytes_per_block: int) -> int:
    """Bytes of one KV element as the engine stores it, from its block bytes and the model's geometry
    (a KV dtype of "auto" resolved: 2 for bfloat16/float16, 1 for fp8); -1 when the geometry is not a
    plain full-attention one or the division is not exact."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    hidden = _int(cfg, "hidden_size", "n_embd")
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim) or block_size <= 0 or bytes_per_block <= 0:
        return -1
    per = block_size * layers * 2 * kv_heads * head_dim
    return bytes_per_block // per if bytes_per_block % per == 0 and bytes_per_block // per in (1, 2, 4) else -1


def check(pool: VllmPool, engine_config: dict[str, Any]) -> dict[str, Any]:
    """The prediction against an engine trace's recorded configuration (recorder_settings_json)."""
    rec_blocks = engine_config.get("pool_blocks", -1)
    rec_tokens = engine_config.get("pool_tokens", -1)
    return {"recorded_blocks": rec_blocks, "recorded_tokens": rec_tokens,
            "blocks_match": rec_blocks == pool.num_blocks, "tokens_match": rec_tokens == pool.tokens}
