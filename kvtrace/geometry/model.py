"""The geometry data model: what a cache layer stores, per token and per sequence."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "chunked", "shared_consumer", "latent", "cross_attention", "no_kv"]
CacheKind = Literal["dynamic", "static", "quantized_fp8"]
MlaCacheMode = Literal["latent", "expanded"]

LAYER_KINDS: tuple[str, ...] = (
    "full", "sliding", "chunked", "shared_consumer", "latent", "cross_attention", "no_kv",
)
CACHE_KINDS: tuple[str, ...] = ("dynamic", "static", "quantized_fp8")
MLA_CACHE_MODES: tuple[str, ...] = ("latent", "expanded")

# Bytes of the two fp32 per-tensor scales (K and V) an fp8 quantized layer keeps.
FP8_SCALE_BYTES = 8


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention dimensions (deepseek_v2 / deepseek_v3)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_attention_heads: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class LayerGeometry:
    """What one cache layer stores, per token and per sequence.

    ``num_kv_heads``, ``k_head_dim`` and ``v_head_dim`` describe the cached tensors
    ``keys [B, num_kv_heads, T, k_head_dim]`` and ``values [B, num_kv_heads, T, v_head_dim]``
    (for a shared consumer: the tensors it reads from its producer).
    """

    index: int
    kind: str
    attention: str  # "full" | "sliding" | "chunked" | "cross" | "none": the attention pattern
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None  # sliding window / attention chunk size, in tokens
    num_attention_heads: int = 0
    kv_same_tensor: bool = False  # keys and values are one tensor: count once
    k_eq_v: bool = False  # K and V share one projection (gemma4 attention_k_eq_v); cache still has 2 tensors
    shares_kv_with: int | None = None  # producer layer a shared consumer reads
    mla: MLADims | None = None

    @property
    def stores_kv(self) -> bool:
        """Whether this layer owns cache tensors (consumers and no-KV layers own none)."""
        return self.kind not in ("shared_consumer", "no_kv")

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token per sequence (0 for layers that store nothing)."""
        if not self.stores_kv:
            return 0
        v = 0 if self.kv_same_tensor else self.v_head_dim
        return self.num_kv_heads * (self.k_head_dim + v)

    @property
    def mha_elements_per_token(self) -> int:
        """Elements per token if this layer were plain multi-head attention with its own K and V."""
        if self.kind == "no_kv":
            return 0
        if self.mla is not None:
            return self.mla.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        return self.num_attention_heads * (self.k_head_dim + self.v_head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelGeometry:
    """All cache layers of a model: decoder layers first, then cross-attention layers if any."""

    model_type: str
    layers: tuple[LayerGeometry, ...]
    num_hidden_layers: int  # decoder layers
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    is_encoder_decoder: bool = False
    mla_cache: str | None = None

    def __iter__(self) -> Iterator[LayerGeometry]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def decoder_layers(self) -> tuple[LayerGeometry, ...]:
        return tuple(g for g in self.layers if g.kind != "cross_attention")

    @property
    def cross_layers(self) -> tuple[LayerGeometry, ...]:
        return tuple(g for g in self.layers if g.kind == "cross_attention")

    def kind_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.layers:
            out[g.kind] = out.get(g.kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [g.to_dict() for g in self.layers]
        return d


@dataclass(frozen=True)
class KVBytes:
    """Cache bytes of a whole model: ``allocated`` (tensor storage) and ``valid`` (tokens held)."""

    allocated: int
    valid: int
    per_layer: tuple[tuple[int, int], ...] = field(default_factory=tuple)

