"""EAGLE heads: read the official checkpoint layouts and write them into a bundle.

EAGLE-1 / EAGLE-2 (SafeAILab/EAGLE `cnets.py`; EAGLE-2 is the same weights with a dynamic tree):
    config.json: a Llama config with one layer, key `bias` (default true) for `fc.bias`
    fc.weight (H, 2H) [+ fc.bias (H,)]      input concat[embed(x_{t+1}), f_t]: embedding FIRST, f_t = the
                                            target's last hidden state after its final norm
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight (layer 0 has NO input_layernorm), no final norm, no lm_head:
    the target's LM head reads the layer output; embed_tokens.weight optional (else the target's).
EAGLE-3 (SafeAILab/EAGLE `eagle/model/cnets.py` of EAGLE-3):
    fc.weight (H, 3 Ht): the hidden states ENTERING target layers 2, N//2, N-3, concatenated low -> high
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight, midlayer.self_attn.* whose
    q/k/v read 2H = concat[input_layernorm(embed), hidden_norm(h)], midlayer.mlp.*, norm.weight,
    lm_head.weight (draft_vocab, H), d2t int64 (draft_vocab,): target id = draft id + d2t[draft id],
    t2d bool (V,) (the same map, kept only to be checked).
vLLM / speculators: the same tensors with `layers.0.` for `midlayer.`, an optional `model.` prefix and
`draft_id_to_target_id` for `d2t`; speculators wraps the Llama config in `transformer_layer_config`
beside `speculators_model_type`, `draft_vocab_size`, `norm_before_residual` (default true there, false in
the official code: the residual is the hidden state before/after hidden_norm) and
`eagle_aux_hidden_state_layer_ids`; its EAGLE-1 calls the fc bias `fusion_bias`.

The bundle stores the official names (`fc.*`, `layers.0.*` / `midlayer.*`, `norm`, `lm_head`, `d2t`) in
float32 or the checkpoint's float dtype; the runtime drafter is `runtime/drafters/eagle.py`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from export.bundle.hf_reader import read_weights
from runtime.model.bundle import BundleWriter, load as load_bundle
from runtime.errors import BundleError
from runtime.model.spec import ModelSpec
from runtime.model.tensors import write_safetensors

KINDS = ("eagle", "eagle3")
KIND_NAMES = {"eagle": "an EAGLE-1", "eagle3": "an EAGLE-3"}
KIND_FLAGS = {"eagle": "`edgespec bundle --eagle DIR`", "eagle3": "`edgespec bundle --eagle3 DIR`"}
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")
EAGLE3_NORMS = ("input_layernorm.weight", "hidden_norm.weight")
QKV_BIAS = tuple(f"self_attn.{x}_proj.bias" for x in "qkv")


def default_tap_layers(num_layers: int) -> List[int]:
    """EAGLE-3's fused target layers: the inputs of layers 2, N//2 and N-3 (N = 8 -> 2, 4, 5)."""
    return [2, num_layers // 2, num_layers - 3]


def tap_collision(layers: Sequence[int], num_layers: int) -> Optional[str]:
    """A one-line warning when EAGLE-3's tap layers name one target layer more than once, else None.
    Example: a 4-layer target's defaults [2, 2, 1] -> "eagle3: tap layers [2, 2, 1] of a 4-layer target repeat
    layer 2: ...". The head still trains and runs (the tap is read once and fused twice), but it sees fewer
    distinct depths than the three EAGLE-3 is built on."""
    layers = [int(i) for i in layers]
    repeated = sorted({i for i in layers if layers.count(i) > 1})
    if not repeated:
        return None
    return (f"eagle3: tap layers {layers} of a {num_layers}-layer target repeat layer "
            f"{', '.join(map(str, repeated))}: the head fuses {len(set(layers))} distinct target layers, not 3 "
            "(EAGLE-3 taps the inputs of layers 2, N//2 and N-3)")


def eagle3_taps(layers: Sequence[int]) -> Tuple[str, ...]:
    return tuple(f"layer_in.{i}" for i in layers)


@dataclass
class EagleHead:
    kind: str  # "eagle" (EAGLE-1/2) or "eagle3"
    spec: ModelSpec  # the single draft layer; vocab_size = the target's
    weights: Dict[str, np.ndarray]  # official names (see the module docstring)
    params: Dict[str, Any]  # bias / tap_layers / draft_vocab_size / norm_before_residual
    target_taps: Tuple[str, ...]


def read_config(path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the Llama layer config, the wrapper: speculators fields or {}) of an EAGLE checkpoint directory."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise BundleError(f"{path}: no config.json; an EAGLE checkpoint directory holds config.json and "
                          "model.safetensors")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{cfg_path}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise BundleError(f"{cfg_path}: expected a JSON object")
    if "transformer_layer_config" in cfg:  # speculators
        layer = cfg["transformer_layer_config"]
        if not isinstance(layer, dict):
            raise BundleError(f"{cfg_path}: transformer_layer_config: expected an object (the Llama layer config)")
        return dict(layer), cfg
    return cfg, {}


def detect_kind(weights: Dict[str, np.ndarray], cfg: Dict[str, Any], wrapper: Dict[str, Any]) -> str:
    declared = wrapper.get("speculators_model_type")
    if declared is not None:
        if declared not in KINDS:
            raise BundleError(f"config.json: speculators_model_type {declared!r} is not an EAGLE head "
                              f"(expected one of {list(KINDS)})")
        return declared
    if any(k.startswith("midlayer.") or k in ("d2t", "draft_id_to_target_id") for k in weights):
        return "eagle3"
    if "draft_vocab_size" in cfg or any("eagle3" in str(a).lower() for a in cfg.get("architectures") or []):
        return "eagle3"
    return "eagle"


def canonical(weights: Dict[str, np.ndarray], kind: str) -> Dict[str, np.ndarray]:
    """Official names: drop a `model.` prefix; vLLM's `draft_id_to_target_id` -> `d2t`; EAGLE-3's
    `layers.0.` (vLLM / speculators) -> `midlayer.`."""
    out: Dict[str, np.ndarray] = {}
    for name, w in weights.items():
        new = name[len("model."):] if name.startswith("model.") else name
        if new == "draft_id_to_target_id":
            new = "d2t"
        if kind == "eagle3" and new.startswith("layers.0."):
            new = "midlayer." + new[len("layers.0."):]
        if new in out:
            raise BundleError(f"tensor {new!r} is present twice (as {name!r} and under another name)")
        out[new] = w
    return out


def _shape(w: Dict[str, np.ndarray], key: str, want: Tuple[int, ...], why: str) -> None:
    got = tuple(w[key].shape)
    if got != want:
        raise BundleError(f"{key}: shape {got}, expected {want} ({why})")


def _layer_spec(cfg: Dict[str, Any], target: ModelSpec, source: str) -> ModelSpec:
    layer = dict(cfg)
    layer.setdefault("model_type", "llama")
    layer.setdefault("vocab_size", target.vocab_size)
    layer["num_hidden_layers"] = 1
    try:
        spec = ModelSpec.from_hf_config(layer, source=source)
    except KeyError as exc:
        raise BundleError(f"{source}: missing key {exc.args[0]!r} of the draft layer's Llama config") from None
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise BundleError(f"{source}: num_hidden_layers {cfg.get('num_hidden_layers')}: edgespec runs EAGLE heads "
                          "of one decoder layer (the official layout)")
    if spec.vocab_size != target.vocab_size:
        raise BundleError(f"{source}: vocab_size {spec.vocab_size} differs from the target's {target.vocab_size}; "
                          "the head was trained for another target")
    return spec


def load_eagle(path: str, target: ModelSpec, kind: str = "auto") -> EagleHead:
    """Read an EAGLE-1/2 or EAGLE-3 checkpoint directory (official, vLLM or speculators layout) for `target`.
    Raises BundleError naming the file, the key and what was expected."""
    layer_cfg, wrapper = read_config(path)
    raw = read_weights(path)
    if kind not in KINDS + ("auto",):
        raise BundleError(f"EAGLE kind {kind!r}: expected one of {list(KINDS)} or auto")
    found = detect_kind(raw, layer_cfg, wrapper)
    if kind != "auto" and found != kind:
        # Said before the key check, which would only list the other kind's tensors as missing.
        raise BundleError(f"{path}: this is {KIND_NAMES[found]} head, not {KIND_NAMES[kind]} one: "
                          f"pass it with {KIND_FLAGS[found]} (not {KIND_FLAGS[kind]})")
    kind = found if kind == "auto" else kind
    source = os.path.join(path, "config.json")
    try:
        w = canonical(raw, kind)
        spec = _layer_spec(layer_cfg, target, source)
        if kind == "eagle":
            return _eagle1(w, spec, target, layer_cfg, wrapper)
        return _eagle3(w, spec, target, layer_cfg, wrapper, source)
    except BundleError as exc:
        raise BundleError(f"{path}: {exc}") from None


def _check_keys(w: Dict[str, np.ndarray], required: Sequence[str], optional: Sequence[str], layout: str) -> None:
    missing = [k for k in required if k not in w]
    if missing:
        raise BundleError(f"missing tensor {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
                          f"; expected the {layout} layout")
    unknown = sorted(set(w) - set(required) - set(optional))
    if unknown:
        raise BundleError(f"unexpected tensor {unknown[0]!r}{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}"
                          f" in an {layout} checkpoint; is this the right kind of head?")


def _layer_shapes(w, p: str, spec: ModelSpec, attn_in: int) -> None:
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    why = f"{'2H' if attn_in != h else 'H'} attention input"
    _shape(w, p + "self_attn.q_proj.weight", (q, attn_in), why)
    _shape(w, p + "self_attn.k_proj.weight", (kv, attn_in), why)
    _shape(w, p + "self_attn.v_proj.weight", (kv, attn_in), why)
    _shape(w, p + "self_attn.o_proj.weight", (h, q), "heads x head_dim -> H")
    _shape(w, p + "mlp.gate_proj.weight", (spec.intermediate_size, h), "intermediate_size x H")
    _shape(w, p + "mlp.up_proj.weight", (spec.intermediate_size, h), "intermediate_size x H")
    _shape(w, p + "mlp.down_proj.weight", (h, spec.intermediate_size), "H x intermediate_size")


def _float32(w: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Floats as float32, except fp16 tensors, kept as stored (the runtime widens them at load)."""
    return {k: (np.ascontiguousarray(v, np.float32) if np.issubdtype(v.dtype, np.floating) and v.dtype != np.float16
                else np.ascontiguousarray(v)) for k, v in w.items()}


def _eagle1(w, spec: ModelSpec, target: ModelSpec, cfg, wrapper) -> EagleHead:
    if wrapper:
        if wrapper.get("layernorms"):
            raise BundleError("config.json: layernorms true (HASS-style extra norms) is not supported; "
                              "edgespec runs the official EAGLE-1 layer")
        bias = bool(wrapper.get("fusion_bias", False))
    else:
        bias = cfg.get("bias", True)
        if not isinstance(bias, bool):
            raise BundleError(f"config.json: bias: got {bias!r}, expected true or false")
    h = spec.hidden_size
    if h != target.hidden_size:
        raise BundleError(f"config.json: hidden_size {h} differs from the target's {target.hidden_size}; EAGLE-1 "
                          "reads the target's hidden state and LM head at the same width")
    p = "layers.0."
    has_qkv_bias = any(p + b in w for b in QKV_BIAS)
    required = ["fc.weight"] + (["fc.bias"] if bias else []) + [p + k for k in LAYER_KEYS]
    required += [p + b for b in QKV_BIAS] if has_qkv_bias else []
    if not bias and "fc.bias" in w:
        raise BundleError("fc.bias is present but the config says bias false; fix the config's `bias`")
    _check_keys(w, required, ["embed_tokens.weight"], "EAGLE-1")
    _shape(w, "fc.weight", (h, 2 * h), "concat[embedding, hidden] 2H -> H")
    if bias:
        _shape(w, "fc.bias", (h,), "H")
    _layer_shapes(w, p, spec, h)
    if "embed_tokens.weight" in w:
        _shape(w, "embed_tokens.weight", (target.vocab_size, h), "V x H")
    spec = replace(spec, qkv_bias=has_qkv_bias, qk_norm=False)
    return EagleHead("eagle", spec, _float32(w), {"bias": bias}, ("final_norm",))


def _eagle3(w, spec: ModelSpec, target: ModelSpec, cfg, wrapper, source: str) -> EagleHead:
    h = spec.hidden_size
    both = dict(cfg, **wrapper)
    target_h = int(both.get("target_hidden_size") or h)
    if target_h != target.hidden_size:
        raise BundleError(f"{source}: target_hidden_size {target_h} differs from the target's {target.hidden_size}")
    if h != target.hidden_size and "embed_tokens.weight" not in w:
        raise BundleError(f"{source}: hidden_size {h} differs from the target's {target.hidden_size} and the head "
                          "has no embed_tokens.weight of its own")
    layers = both.get("eagle_aux_hidden_state_layer_ids") or default_tap_layers(target.num_layers)
    if (not isinstance(layers, list) or len(layers) != 3
            or any(not isinstance(i, int) or not 0 <= i < target.num_layers for i in layers)):
        raise BundleError(f"{source}: eagle_aux_hidden_state_layer_ids {layers!r}: expected three target layer "
                          f"indices in 0..{target.num_layers - 1}")
    norm_before_residual = both.get("norm_before_residual", bool(wrapper))
    if not isinstance(norm_before_residual, bool):
        raise BundleError(f"{source}: norm_before_residual: got {norm_before_residual!r}, expected true or false")
    p = "midlayer."
    has_qkv_bias = any(p + b in w for b in QKV_BIAS)
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + [p + k for k in LAYER_KEYS + EAGLE3_NORMS]
    required += [p + b for b in QKV_BIAS] if has_qkv_bias else []
    if "lm_head.weight" not in w:
        raise BundleError("missing tensor 'lm_head.weight'; an EAGLE-3 head has its own LM head")
    draft_vocab = int(w["lm_head.weight"].shape[0])
    declared = both.get("draft_vocab_size")
    if declared is not None and int(declared) != draft_vocab:
        raise BundleError(f"lm_head.weight has {draft_vocab} rows, config draft_vocab_size says {declared}")
    if draft_vocab < target.vocab_size:
        required.append("d2t")
    _check_keys(w, required, ["d2t", "t2d", "embed_tokens.weight"], "EAGLE-3")
    _shape(w, "fc.weight", (h, 3 * target_h), "three fused target hidden states 3H -> H")
    _layer_shapes(w, p, spec, 2 * h)
    _shape(w, "lm_head.weight", (draft_vocab, h), "draft_vocab x H")
    if "embed_tokens.weight" in w:
        _shape(w, "embed_tokens.weight", (target.vocab_size, h), "V x H")
    if draft_vocab > target.vocab_size:
        raise BundleError(f"lm_head.weight has {draft_vocab} rows, more than the target's vocabulary {target.vocab_size}")
    if "d2t" in w:
        d2t = np.asarray(w["d2t"])
        if d2t.shape != (draft_vocab,) or not np.issubdtype(d2t.dtype, np.integer):
            raise BundleError(f"d2t: shape {d2t.shape} dtype {d2t.dtype}, expected ({draft_vocab},) integers "
                              "(target id = draft id + d2t[draft id])")
        ids = np.arange(draft_vocab) + d2t
        if ids.min() < 0 or ids.max() >= target.vocab_size or np.unique(ids).size != draft_vocab:
            raise BundleError(f"d2t: draft id + d2t must be distinct target ids in 0..{target.vocab_size - 1}")
        if "t2d" in w:
            t2d = np.asarray(w["t2d"]).astype(bool)
            if t2d.shape != (target.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), np.sort(ids)):
                raise BundleError("t2d does not mark exactly the target ids that d2t maps to")
        w = dict(w, d2t=d2t.astype(np.int64))
    w.pop("t2d", None)
    spec = replace(spec, qkv_bias=has_qkv_bias, qk_norm=False)
    layers = sorted(layers)  # the target's forward appends them in layer order: low -> high
    params = {"tap_layers": [int(i) for i in layers], "draft_vocab_size": draft_vocab,
              "norm_before_residual": norm_before_residual}
    return EagleHead("eagle3", spec, _float32(w), params, eagle3_taps(layers))


# The zoo's EAGLE-2 tree: of (total_tokens, depth, top_k) 4/3/2, 8/4/3, 12/5/3, 16/5/4, 24/6/4 and the paper's
# 60/6/10, 4/3/2 gave the most tok/s on the 2-core CPU with the heads on ONNX Runtime (BENCHMARKS.md, issue 16).
ZOO_TREE = {"total_tokens": 4, "depth": 3, "top_k": 2}


def add_eagle_to_bundle(bundle_dir: str, checkpoint: str, kind: str = "auto", name: Optional[str] = None,
                        fp16: bool = False, tree: Optional[Dict[str, int]] = None,
                        drafters: Optional[Dict[str, Optional[Dict[str, int]]]] = None) -> List[str]:
    """Add an EAGLE head to an existing bundle. `drafters` maps drafter names to their EAGLE-2 dynamic tree
    (total_tokens, depth, top_k) or None for chains; all share one weight file. Default: {name or the
    head's kind: tree}. Returns the drafter names added."""
    bundle = load_bundle(bundle_dir)
    writer = BundleWriter.extend(bundle_dir)
    added = add_eagle_head(writer, checkpoint, bundle.target.spec, kind, name, fp16, tree, drafters)
    writer.write()
    return added


def add_eagle_head(writer: BundleWriter, checkpoint: str, spec, kind: str = "auto", name: Optional[str] = None,
                   fp16: bool = False, tree: Optional[Dict[str, int]] = None,
                   drafters: Optional[Dict[str, Optional[Dict[str, int]]]] = None) -> List[str]:
    """`add_eagle_to_bundle` into a bundle being written by `writer` (its target's spec `spec`); the caller writes."""
    head = load_eagle(checkpoint, spec, kind)
    drafters = drafters or {name or head.kind: tree}
    for n in drafters:
        if n in writer.manifest["drafters"]:
            raise BundleError(f"{writer.root}: already has a drafter {n!r}; choose another name")
    rel = f"{head.kind}/{head.kind}.safetensors"
    if os.path.exists(writer.path(rel)):
        rel = f"{next(iter(drafters))}/{head.kind}.safetensors"
    weights = {k: (v.astype(np.float16) if fp16 and v.dtype == np.float32 else v) for k, v in head.weights.items()}
    write_safetensors(writer.path(rel), weights)
    for n, t in drafters.items():
        params = dict(head.params, **({"tree": dict(t)} if t else {}))
        writer.add_drafter(n, head.kind, files=[rel], params=params, target_taps=head.target_taps, spec=head.spec)
    return list(drafters)
