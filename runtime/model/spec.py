"""The architecture of a decoder-only target (or draft) model, read from an HF `config.json`.

One frozen dataclass covers the three families edgespec reads: Llama (incl. llama3 / linear rope
scaling), Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on q and k per head)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from runtime.errors import BundleError

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()

    @property
    def kv_bytes_per_position(self) -> int:
        """float32 K+V bytes one position costs across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_dict(d: Dict[str, Any], source: str = "spec") -> "ModelSpec":
        """The spec a manifest records, with every key, type and size checked: a BundleError names the key,
        the value and what was expected (`num_layers: "eight"` is refused here, not deep in a forward)."""
        from runtime.config import from_dict  # typed loading, shared with the runtime YAML
        from runtime.errors import REBUILD_BUNDLE, ConfigError

        try:
            spec = from_dict(ModelSpec, d, source=source)
        except ConfigError as exc:
            raise BundleError(f"{exc}; {REBUILD_BUNDLE}") from None
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if getattr(spec, name) < 1:
                raise BundleError(f"{source}: {name}: got {getattr(spec, name)!r}, expected an integer >= 1")
        if spec.family not in FAMILIES:
            raise BundleError(f"{source}: family: got {spec.family!r}, expected one of {list(FAMILIES)}")
        if spec.num_heads % spec.num_kv_heads:
            raise BundleError(f"{source}: num_heads {spec.num_heads} is not a multiple of num_kv_heads "
                              f"{spec.num_kv_heads}")
        return spec

    @staticmethod
    def from_hf_config(cfg: Dict[str, Any], source: str = "config.json") -> "ModelSpec":
        """Map an HF config (LlamaConfig / Qwen2Config / Qwen3Config) to a ModelSpec."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise BundleError(f"{source}: model_type {model_type!r} is not supported; expected one of {FAMILIES}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None)
        scaling = RopeScaling()
        rope_theta = float(cfg.get("rope_theta", (rs or {}).get("rope_theta", 10000.0)))
        if rs:
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise BundleError(f"{source}: rope_scaling type {kind!r} is not supported (default, linear, llama3)")
            if kind != "default":
                scaling = RopeScaling(
                    kind=kind,
                    factor=float(rs.get("factor", 1.0)),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelSpec(
            family=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
