"""Load official DFlash / DFlash-2 drafter checkpoints (z-lab layout) and write them into a bundle.

A checkpoint directory holds `config.json` (a Qwen3 config plus `block_size`, `num_target_layers` and
`dflash_config{target_layer_ids, mask_token_id}`; DFlash-2 adds `conv_group_size`, `conv_kernel_size`,
`selector_rank`, `selector_top_k`, read from dflash_config first, then the top level) and safetensors with
the keys of `runtime.drafters.dflash.dflash_weight_names` (no embedding, no lm_head: both the target's;
DFlash-2's selector codebooks without `.weight`). The bundle keeps the same keys and dtypes."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from export.bundle.hf_reader import read_weights, shard_files
from runtime.model.bundle import BundleWriter
from runtime.drafters.dflash import DFlashParams, check_dflash_weights
from runtime.errors import BundleError
from runtime.model.spec import ModelSpec
from runtime.model.tensors import safetensors_dtypes, write_safetensors

V2_KEYS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """Evenly spaced target layers from 1 to N - 3 (the official default); one draft layer reads N // 2."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _draft_value(cfg: Dict[str, Any], key: str, default=None):
    inner = cfg.get("dflash_config") or {}
    return inner.get(key, cfg.get(key, default))


@dataclass
class DFlashCheckpoint:
    path: str
    spec: ModelSpec  # the draft layers' shape (vocab = the target's)
    params: DFlashParams
    weights: Dict[str, np.ndarray]  # bf16 widened to float32; written back as bf16 (bf16_names)
    bf16_names: tuple = ()
    other_block_sizes: tuple = ()  # smaller blocks it was also trained at (dflash_config.trained_block_sizes)

    @property
    def kind(self) -> str:
        return "dflash2" if self.params.v2 else "dflash"


def read_dflash_checkpoint(path: str, target_spec: Optional[ModelSpec] = None) -> DFlashCheckpoint:
    """Read and check a DFlash or DFlash-2 directory (against `target_spec` when given). Raises BundleError
    naming the file and the key at fault."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise BundleError(f"{path}: no config.json; expected a DFlash drafter directory (config.json + safetensors)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{cfg_path}: not readable JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise BundleError(f"{cfg_path}: expected a JSON object")
    cfg = dict(cfg, model_type=cfg.get("model_type", "qwen3"))
    if cfg["model_type"] != "qwen3":
        raise BundleError(f"{cfg_path}: model_type {cfg['model_type']!r}; DFlash drafters are Qwen3-style (qwen3)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise BundleError(f"{cfg_path}: missing key {key!r} (a Qwen3 config field)")
    if not isinstance(cfg.get("dflash_config"), dict):
        raise BundleError(f"{cfg_path}: missing key 'dflash_config' (an object with target_layer_ids, mask_token_id)")
    spec = ModelSpec.from_hf_config(cfg, source=cfg_path)
    layer_ids = _draft_value(cfg, "target_layer_ids")
    if layer_ids is None:
        if "num_target_layers" not in cfg:
            raise BundleError(f"{cfg_path}: dflash_config.target_layer_ids is missing and so is num_target_layers")
        layer_ids = default_target_layer_ids(int(cfg["num_target_layers"]), spec.num_layers)
    fields = {"block_size": _draft_value(cfg, "block_size"), "mask_token_id": _draft_value(cfg, "mask_token_id"),
              "target_layer_ids": layer_ids}
    for key, name in (("block_size", "block_size"), ("mask_token_id", "dflash_config.mask_token_id")):
        if fields[key] is None:
            raise BundleError(f"{cfg_path}: missing key {name!r}")
    given = [k for k in V2_KEYS if _draft_value(cfg, k) is not None]
    if given and len(given) < len(V2_KEYS):
        missing = [k for k in V2_KEYS if k not in given]
        raise BundleError(f"{cfg_path}: DFlash-2 config has {given} but not {missing[0]!r}")
    fields.update({k: _draft_value(cfg, k) for k in given})
    for key in ("input_embedding_scale", "output_multiplier"):
        if float(_draft_value(cfg, key, 1.0)) != 1.0:
            raise BundleError(f"{cfg_path}: {key} {_draft_value(cfg, key)!r} is not supported (expected 1.0)")
    params = DFlashParams.from_dict(fields, cfg_path)
    trained = _draft_value(cfg, "trained_block_sizes", [params.block_size])
    if not isinstance(trained, list) or not all(isinstance(b, int) and 2 <= b <= params.block_size for b in trained):
        raise BundleError(f"{cfg_path}: dflash_config.trained_block_sizes: got {trained!r}, expected a list of block "
                          f"sizes 2..block_size ({params.block_size})")
    weights = read_weights(path)
    target_hidden = spec.hidden_size
    if target_spec is not None:
        check_against_target(cfg_path, spec, params, target_spec)
        target_hidden = target_spec.hidden_size
    check_dflash_weights(weights, spec, params, target_hidden, path)
    dtypes: Dict[str, str] = {}
    for full in shard_files(path):
        dtypes.update(safetensors_dtypes(full))
    return DFlashCheckpoint(path, spec, params, weights, tuple(n for n in weights if dtypes.get(n) == "BF16"),
                            tuple(sorted(set(trained) - {params.block_size})))


def check_against_target(source: str, spec: ModelSpec, params: DFlashParams, target: ModelSpec) -> None:
    if spec.hidden_size != target.hidden_size:
        raise BundleError(f"{source}: hidden_size {spec.hidden_size} differs from the target's {target.hidden_size}; "
                          "DFlash runs on the target's embedding and LM head")
    if spec.vocab_size != target.vocab_size:
        raise BundleError(f"{source}: vocab_size {spec.vocab_size} differs from the target's {target.vocab_size}")
    bad = [i for i in params.target_layer_ids if i >= target.num_layers]
    if bad:
        raise BundleError(f"{source}: dflash_config.target_layer_ids has {bad[0]}; the target has "
                          f"{target.num_layers} layers (0..{target.num_layers - 1})")
    if params.mask_token_id >= target.vocab_size:
        raise BundleError(f"{source}: dflash_config.mask_token_id {params.mask_token_id} is outside the target's "
                          f"vocabulary ({target.vocab_size})")


def add_dflash_drafter(w: BundleWriter, path: str, target_spec: ModelSpec, name: Optional[str] = None) -> str:
    """Write the checkpoint at `path` into the bundle being built by `w` as drafter `name` (default: its kind),
    and, for each smaller block size its config says it was trained at (edgespec's
    dflash_config.trained_block_sizes), a drafter `<name>_b<size>` on the same file. Returns the name."""
    ck = read_dflash_checkpoint(path, target_spec)
    name = name or ck.kind
    taken = [n for n in [name] + [f"{name}_b{b}" for b in ck.other_block_sizes] if n in w.manifest["drafters"]]
    if taken:
        raise BundleError(f"{path}: the bundle already has a drafter named {taken[0]!r} (one {ck.kind} drafter per bundle "
                          "from `edgespec bundle --target DIR --dflash DIR --out DIR`)")
    rel = f"{name}/model.safetensors"
    write_safetensors(w.path(rel), ck.weights, bf16=ck.bf16_names)
    p = ck.params
    params = {"block_size": p.block_size, "mask_token_id": p.mask_token_id, "target_layer_ids": list(p.target_layer_ids),
              "layout": "z-lab"}
    if p.v2:
        params.update(conv_group_size=p.conv_group_size, conv_kernel_size=p.conv_kernel_size,
                      selector_rank=p.selector_rank, selector_top_k=p.selector_top_k)
    for n, block in [(name, p.block_size)] + [(f"{name}_b{b}", b) for b in ck.other_block_sizes]:
        w.add_drafter(n, ck.kind, files=[rel], params=dict(params, block_size=block), spec=ck.spec,
                      target_taps=[f"layer_out.{i}" for i in p.target_layer_ids])
    return name
