"""The memory-bound stand-in: the zoo target widened with zero-contribution padding, so that a forward
streams the bytes of a ~125 M-parameter model while the logits stay the zoo target's.

The zoo target (7 M params, 28 MB fp32) sits in cache on a CPU, where a forward is fixed overhead and
speculation pays least; a robot's 0.6-8 B target is memory-bound. The stand-in costs like the latter and
predicts like the former, so drafters keep their trained acceptance while the verify pass pays for
weight traffic. Every padded weight is zero, so the arithmetic is the original's plus exact zeros:

  hidden H -> H'       embedding columns H..H' are zero, so every residual stream is [x, 0]
  RMSNorm              over [x, 0], mean(x^2) shrinks by H/H': weight x sqrt(H/H') and eps x H/H' give
                       w' * [x,0] / sqrt(mean'(x^2) + eps') == [w * x / sqrt(mean(x^2) + eps), 0]
  intermediate I -> I' gate/up rows and down columns I..I' are zero: silu(0) * 0 = 0
  heads                head_dim unchanged; heads' = H' / head_dim query heads, `kv_heads` KV heads.
                       Original KV head j stays KV head j; original query head i (group i // g) goes to
                       slot i % g of new group i // g (g = the original group size). Every other q/k/v row
                       is zero; the padded query heads attend uniformly, but their o_proj columns are zero
  Medusa heads         ResBlock W [H, H] -> [H', H'], b and head projections [V, H] -> [V, H'] zero-padded:
                       [x, 0] + SiLU(W'[x, 0] + b') = [x + SiLU(W x + b), 0] (SiLU(0) = 0), `widen_medusa`
  MTP (DeepSeek-V3)    enorm / hnorm / shared_head.norm as above; eh_proj [H, 2H] -> [H', 2H'] with the
                       embedding half at columns 0..H and the hidden half at H'..H'+H
  EAGLE-1 / EAGLE-3    (`widen_eagle`) fc [H, nH] -> [H', nH'], input block i at columns i*H'..i*H'+H (EAGLE-1
                       concat[embed, f], EAGLE-3 its three taps); EAGLE-3's q/k/v over the 2H attention input
                       likewise at columns 0..H and H'..H'+H; d2t / t2d unchanged; the rest as the target's
  DFlash / DFlash-2    (`widen_dflash`) fc [H, nH] over the target layer outputs like EAGLE's fc; q_norm / k_norm
                       (per head_dim) unchanged; DFlash-2's conv base kernels [2, 2, H] zero-padded per channel
                       and kernel_projection [2*2*G, H] -> [2*2*G', H'] (the same conv_group_size, so channel
                       c < H keeps group c // size; row (io, tap, g) moves to (io, tap, g) of G'); the selector's
                       hidden_projection [R, H] -> [R, H'], codebooks [V, R] unchanged; the rest as the target's

Worked example (H 256 -> 1024, 8 q / 4 KV heads -> 32 / 8, g = 2, new group size 4): original query head 5
(KV head 2) becomes query head 4 * 2 + 1 = 9, which reads KV head 9 // 4 = 2.

Deeper (`deepen`, `edgespec zoo standin --depth D`): a robot's target has 28-36 layers, so one drafter layer
costs ~1/30 of a step, not the zoo's 1/8. The N original layers keep their order at depths layer_map(N, D)
(evenly spread: 8 in 24 -> 0, 3, 6, ..., 21) and every other layer is a zero-contribution layer: all its
projections zero, so attention and MLP add exact zeros and the residual stream passes it unchanged. So the
hidden state entering stand-in layer layer_map[k] is the one entering zoo layer k, and the output of stand-in
layer layer_map[k] is zoo layer k's output: EAGLE-3's taps (inputs of layers) and DFlash's target_layer_ids
(outputs of layers) are renamed through the map and land on real layers. MTP modules move from
model.layers.{N+i} to model.layers.{D+i}."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import numpy as np

from export.bundle.hf_reader import read_hf_checkpoint
from runtime.errors import ConfigError
from runtime.model.tensors import write_safetensors

NORM_SUFFIXES = ("layernorm.weight", "norm.weight")  # input_/post_attention_layernorm, model.norm, enorm, hnorm


def _pad(w: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """w (float32) in the top-left corner of a zero array of `shape`."""
    out = np.zeros(shape, np.float32)
    out[tuple(slice(0, n) for n in w.shape)] = w
    return out


def head_slots(num_heads: int, num_kv: int, new_kv: int, new_heads: int) -> np.ndarray:
    """New index of each original query head: slot i % g of group i // g, each group keeping its KV head.

    >>> head_slots(8, 4, 8, 32).tolist()
    [0, 1, 4, 5, 8, 9, 12, 13]"""
    g, new_g = num_heads // num_kv, new_heads // new_kv
    i = np.arange(num_heads)
    return (i // g) * new_g + i % g


def check_widening(config: dict, hidden: int, intermediate: int, kv_heads: int) -> None:
    """A ConfigError naming the flag unless the widening keeps every original head and channel."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config.get("head_dim") or \
        config["hidden_size"] // config["num_attention_heads"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    if hidden < h or hidden % d:
        raise ConfigError(f"--hidden: got {hidden}, expected a multiple of head_dim {d} that is >= {h}")
    if intermediate < inter:
        raise ConfigError(f"--intermediate: got {intermediate}, expected >= {inter}")
    new_heads = hidden // d
    if kv_heads < nkv or new_heads % kv_heads or new_heads // kv_heads < nh // nkv:
        raise ConfigError(f"--kv-heads: got {kv_heads}, expected >= {nkv} dividing {new_heads} query heads into "
                          f"groups of >= {nh // nkv}")


def widen(weights: Dict[str, np.ndarray], config: dict, hidden: int, intermediate: int,
          kv_heads: int) -> Tuple[Dict[str, np.ndarray], dict]:
    """(HF-named float32 weights, HF config) of the stand-in; see the module docstring for the rules."""
    check_widening(config, hidden, intermediate, kv_heads)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    new_heads = hidden // d
    slots = head_slots(nh, nkv, kv_heads, new_heads)
    q_rows = (slots[:, None] * d + np.arange(d)).reshape(-1)  # (nh*d,) rows of q_proj / columns of o_proj
    scale = math.sqrt(h / hidden)
    out = {}
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        if name.endswith(NORM_SUFFIXES):
            out[name] = _pad(w * np.float32(scale), (hidden,))
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            out[name] = _pad(w, (w.shape[0], hidden))
        elif name.endswith("q_proj.weight"):
            q = np.zeros((new_heads * d, hidden), np.float32)
            q[q_rows, :h] = w
            out[name] = q
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = _pad(w, (kv_heads * d, hidden))  # KV head j stays KV head j
        elif name.endswith("o_proj.weight"):
            o = np.zeros((hidden, new_heads * d), np.float32)
            o[:h, q_rows] = w
            out[name] = o
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _pad(w, (intermediate, hidden))
        elif name.endswith("down_proj.weight"):
            out[name] = _pad(w, (hidden, intermediate))
        elif name.endswith("eh_proj.weight"):  # [H, 2H] over concat[enorm(emb), hnorm(h)]
            e = np.zeros((hidden, 2 * hidden), np.float32)
            e[:h, :h], e[:h, hidden:hidden + h] = w[:, :h], w[:, h:]
            out[name] = e
        else:
            raise ConfigError(f"{name}: no widening rule for this tensor (shape {w.shape}); the stand-in handles "
                              "Llama layers and DeepSeek-V3 MTP modules")
    cfg = dict(config, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=new_heads,
               num_key_value_heads=kv_heads, head_dim=d, rms_norm_eps=config["rms_norm_eps"] * h / hidden,
               torch_dtype="float32")
    cfg["edgespec_standin"] = {"widened_from": {"hidden_size": h, "intermediate_size": inter,
                                                "num_attention_heads": nh, "num_key_value_heads": nkv},
                               "note": "zero-contribution padding: predicts what the original predicts"}
    return out, cfg


def layer_map(n: int, depth: int) -> list:
    """Stand-in depth of each original layer, evenly spread, the first at 0.

    >>> layer_map(8, 24)
    [0, 3, 6, 9, 12, 15, 18, 21]
    >>> layer_map(8, 8)
    [0, 1, 2, 3, 4, 5, 6, 7]"""
    if depth < n:
        raise ConfigError(f"--depth: got {depth}, expected >= the model's {n} layers")
    return [i * depth // n for i in range(n)]


LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def deepen(weights: Dict[str, np.ndarray], config: dict, depth: int) -> Tuple[Dict[str, np.ndarray], dict]:
    """(weights, config) with the N layers at layer_map(N, depth) and zero-contribution layers between (see the
    module docstring); MTP modules (model.layers.{N+i}) move to model.layers.{depth+i}."""
    n = config["num_hidden_layers"]
    where = layer_map(n, depth)
    out, template = {}, {}
    for name, w in weights.items():
        m = LAYER_KEY.match(name)
        if m is None:
            out[name] = w
            continue
        i, rest = int(m.group(1)), m.group(2)
        out[f"model.layers.{where[i] if i < n else depth + i - n}.{rest}"] = w
        if i == 0:
            template[rest] = w
    for j in sorted(set(range(depth)) - set(where)):
        for rest, w in template.items():  # norms 1, projections 0: the layer adds exact zeros
            out[f"model.layers.{j}.{rest}"] = (np.ones_like(w) if rest.endswith(NORM_SUFFIXES) else np.zeros_like(w))
    cfg = dict(config, num_hidden_layers=depth)
    cfg["edgespec_standin"] = dict(config.get("edgespec_standin") or {}, layer_map=where,
                                   deepened_from={"num_hidden_layers": n})
    return out, cfg


def remap_taps(config: dict, where: list, depth: int, eagle3: bool = False) -> dict:
    """A drafter's config with its target layer numbers renamed through the stand-in's layer map: EAGLE-3's
    eagle_aux_hidden_state_layer_ids (default 2, N//2, N-3 of the ORIGINAL depth) and DFlash's
    dflash_config.target_layer_ids / num_target_layers."""
    from export.drafters.dflash import default_target_layer_ids
    from export.drafters.eagle import default_tap_layers

    cfg = json.loads(json.dumps(config))
    n = len(where)
    if eagle3:
        layers = cfg.get("eagle_aux_hidden_state_layer_ids") or default_tap_layers(n)
        cfg["eagle_aux_hidden_state_layer_ids"] = [where[i] for i in layers]
    inner = cfg.get("dflash_config")
    if isinstance(inner, dict):
        ids = inner.get("target_layer_ids") or default_target_layer_ids(int(cfg.get("num_target_layers", n)),
                                                                        int(cfg["num_hidden_layers"]))
        inner["target_layer_ids"] = [where[i] for i in ids]
        cfg["num_target_layers"] = depth
    return cfg


def widen_medusa(weights: Dict[str, np.ndarray], hidden: int) -> Dict[str, np.ndarray]:
    """Medusa-1 heads for the stand-in: every (.., H) column block and (H,) vector zero-padded to `hidden`.
    The stand-in's final-norm hidden is [x, 0], so a ResBlock gives [x + SiLU(W x + b), x0 + SiLU(0)] with x0 = 0
    and SiLU(0) = 0: the padding stays zero through every block, and each head's (V, H') projection over
    [r, 0] is the original's over r."""
    out = {}
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        if name.endswith("linear.weight"):
            out[name] = _pad(w, (hidden, hidden))
        elif name.endswith("linear.bias"):
            out[name] = _pad(w, (hidden,))
        else:  # {h}.{L}.weight, the head's vocabulary projection (V, H)
            out[name] = _pad(w, (w.shape[0], hidden))
    return out


def write_standin_medusa(src: str, out: str, hidden: int) -> str:
    """The Medusa heads in `src` (official layout) widened for the stand-in into `out` (fp16, their config and
    tree kept, hidden_size set). Returns `out`."""
    from export.drafters.medusa import read_medusa, write_medusa

    heads = read_medusa(src)
    write_medusa(out, widen_medusa(heads.weights, hidden), dict(heads.config, hidden_size=hidden))
    return out


def widen_eagle(weights: Dict[str, np.ndarray], config: dict, hidden: int, intermediate: int,
                kv_heads: int) -> Tuple[Dict[str, np.ndarray], dict]:
    """An EAGLE-1 or EAGLE-3 head (official names, export/drafters/eagle.py) padded like its target by `widen`,
    so that on the stand-in's [x, 0] states it predicts what it predicts on the zoo target's x."""
    h, d = config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    check_widening(config, hidden, intermediate, kv_heads)
    nh, nkv, new_heads = config["num_attention_heads"], config["num_key_value_heads"], hidden // d
    q_rows = (head_slots(nh, nkv, kv_heads, new_heads)[:, None] * d + np.arange(d)).reshape(-1)
    two = np.concatenate([np.arange(h), hidden + np.arange(h)])  # the 2H attention input's columns
    own, rest = {}, {}
    for name, w in weights.items():
        if name in ("d2t", "t2d"):
            own[name] = w
        elif name == "fc.weight":  # (H, n*H) over n concatenated H-wide inputs
            w = np.asarray(w, np.float32)
            fc = np.zeros((hidden, hidden * (w.shape[1] // h)), np.float32)
            for i in range(w.shape[1] // h):
                fc[:h, i * hidden:i * hidden + h] = w[:, i * h:(i + 1) * h]
            own[name] = fc
        elif name == "fc.bias":
            own[name] = _pad(np.asarray(w, np.float32), (hidden,))
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and w.shape[1] == 2 * h:
            rows = q_rows if name.endswith("q_proj.weight") else np.arange(nkv * d)
            out = np.zeros((new_heads * d if name.endswith("q_proj.weight") else kv_heads * d, 2 * hidden), np.float32)
            out[np.ix_(rows, two)] = np.asarray(w, np.float32)
            own[name] = out
        else:
            rest[name] = w
    widened, cfg = widen(rest, config, hidden, intermediate, kv_heads)
    return dict(widened, **own), cfg


def widen_dflash(weights: Dict[str, np.ndarray], config: dict, hidden: int, intermediate: int,
                 kv_heads: int) -> Tuple[Dict[str, np.ndarray], dict]:
    """A DFlash or DFlash-2 drafter (z-lab names, runtime/drafters/dflash.py) padded like its target by `widen`,
    so that on the stand-in's [x, 0] taps, embedding and LM head it drafts what it drafts on the zoo target.

    The draft layers' own hidden size IS the target's (DFlash runs on the target's embedding and head), so it
    widens to `hidden` too. q_norm / k_norm act per head over head_dim (unchanged): kept as they are, but
    they share the config's rms_norm_eps, which `widen` scales by H/H' (1e-5 -> 2.5e-6 at 256 -> 1024); over
    a head's d = 32 channels of O(1) values that moves the draft logits by ~1e-6 relative, not exactly 0.
    Example (H 256 -> 1024, conv_group_size 16): G 16 -> 64 groups; kernel_projection row (in/out 1, tap 0,
    group 3) = 1*2*16 + 0*16 + 3 = 35 moves to 1*2*64 + 0*64 + 3 = 131, columns 0..256."""
    h = config["hidden_size"]
    inner = config.get("dflash_config") or {}
    group = inner.get("conv_group_size", config.get("conv_group_size"))
    own, rest = {}, {}
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        if name == "fc.weight":  # (H, n*H) over the n target layer outputs: block i at columns i*H'..i*H'+H
            fc = np.zeros((hidden, hidden * (w.shape[1] // h)), np.float32)
            for i in range(w.shape[1] // h):
                fc[:h, i * hidden:i * hidden + h] = w[:, i * h:(i + 1) * h]
            own[name] = fc
        elif name.endswith(("q_norm.weight", "k_norm.weight")) or name.endswith("_codebook"):
            own[name] = w
        elif name.endswith("base_kernel"):  # (2 in/out, taps, H) per channel
            own[name] = _pad(w, w.shape[:-1] + (hidden,))
        elif name.endswith("kernel_projection.weight"):  # (2 in/out * taps * G, H)
            if not group or hidden % group:
                raise ConfigError(f"{name}: conv_group_size {group!r} does not divide the stand-in hidden {hidden}")
            g, new_g = h // group, hidden // group
            kp = np.zeros((w.shape[0] // g, new_g, hidden), np.float32)
            kp[:, :g, :h] = w.reshape(-1, g, h)
            own[name] = kp.reshape(-1, hidden)
        elif name == "candidate_selector.hidden_projection.weight":  # (rank, H) over the final-normed slot
            own[name] = _pad(w, (w.shape[0], hidden))
        else:
            rest[name] = w
    widened, cfg = widen(rest, config, hidden, intermediate, kv_heads)
    return dict(widened, **own), cfg


def write_standin_dflash(src: str, out: str, hidden: int = 1024, intermediate: int = 4096, kv_heads: int = 8,
                         layers: Optional[Tuple[list, int]] = None) -> str:
    """The widened DFlash drafter of checkpoint dir `src` at `out` (config.json, model.safetensors): fp16 if it
    was and the norm scale sqrt(H/H') is a power of two (1/2 for the zoo's 256 -> 1024: exact), else float32
    (an fp16 norm weight x 0.816 would round by ~1e-3 and move the draft logits by as much)."""
    from export.bundle.hf_reader import read_weights

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    raw = read_weights(src)
    weights, cfg = widen_dflash(raw, config, hidden, intermediate, kv_heads)
    if layers is not None:  # a deepened target: target_layer_ids renamed through the layer map
        cfg = remap_taps(cfg, layers[0], layers[1])
    exact = math.log2(hidden / config["hidden_size"]) % 2 == 0  # H'/H a power of 4
    keep = np.float16 if exact and {str(v.dtype) for v in raw.values()} == {"float16"} else np.float32
    cfg["torch_dtype"] = "float16" if keep is np.float16 else "float32"
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), {k: v.astype(keep) for k, v in weights.items()},
                      metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return out


def add_standin_dflash(zoo: str, out: str, bundle_dir: str, hidden: int, intermediate: int, kv_heads: int,
                       layers: Optional[Tuple[list, int]] = None) -> list:
    """Pad the zoo's DFlash drafters (zoo/dflash, zoo/dflash2, where present) into `out` and add them to the
    stand-in bundle under the zoo bundle's drafter names (dflash, dflash_b8, dflash2, dflash2_b8)."""
    from export.drafters.dflash import add_dflash_drafter
    from runtime.model.bundle import BundleWriter, load as load_bundle

    srcs = [s for s in ("dflash", "dflash2") if os.path.isfile(os.path.join(zoo, s, "model.safetensors"))]
    if not srcs:
        return []
    writer = BundleWriter.extend(bundle_dir)  # one manifest write (it checksums the whole bundle)
    spec, before = load_bundle(bundle_dir, verify_checksums=False).target.spec, set(writer.manifest["drafters"])
    for src in srcs:
        head = write_standin_dflash(os.path.join(zoo, src), os.path.join(out, src), hidden, intermediate, kv_heads,
                                    layers)
        add_dflash_drafter(writer, head, spec)
    writer.write()
    added = [n for n in writer.manifest["drafters"] if n not in before]
    return added


def write_standin(src: str, out: str, hidden: int = 1024, intermediate: int = 4096, kv_heads: int = 8,
                  depth: Optional[int] = None, heads: bool = True) -> int:
    """Write the widened (and, with `depth`, deepened) HF checkpoint of `src` (config.json, model.safetensors fp32,
    tokenizer.json) to `out`, and with `heads` the zoo's Medusa heads beside it. Returns its parameter count."""
    ckpt = read_hf_checkpoint(src)
    weights, cfg = widen(ckpt.weights, ckpt.config, hidden, intermediate, kv_heads)
    if depth is not None:
        weights, cfg = deepen(weights, cfg, depth)
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), weights, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    if ckpt.tokenizer_file:
        shutil.copyfile(ckpt.tokenizer_file, os.path.join(out, "tokenizer.json"))
    medusa = os.path.join(os.path.dirname(os.path.abspath(src)), "medusa")
    if heads and os.path.isfile(os.path.join(medusa, "medusa_lm_head.safetensors")):  # the zoo's heads, widened beside it
        write_standin_medusa(medusa, os.path.join(out, "medusa"), hidden)
    return sum(w.size for w in weights.values())


def write_standin_eagle(src: str, out: str, hidden: int = 1024, intermediate: int = 4096, kv_heads: int = 8,
                        layers: Optional[Tuple[list, int]] = None) -> str:
    """The widened EAGLE head of checkpoint dir `src` (config.json, model.safetensors) at `out`, in the head's
    own float dtype (the padding is exact: zeros, and norm weights x sqrt(H/H'), a power of two here)."""
    from export.bundle.hf_reader import read_weights

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    raw = read_weights(src)
    weights, cfg = widen_eagle(raw, config, hidden, intermediate, kv_heads)
    if layers is not None:  # a deepened target: its taps renamed through the layer map
        cfg = remap_taps(cfg, layers[0], layers[1], eagle3=raw["fc.weight"].shape[1] == 3 * config["hidden_size"])
    dtype = {str(v.dtype) for k, v in raw.items() if v.dtype.kind == "f"}
    cfg["torch_dtype"] = "float16" if dtype == {"float16"} else "float32"
    keep = np.float16 if cfg["torch_dtype"] == "float16" else np.float32
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"),
                      {k: v.astype(keep) if v.dtype.kind == "f" else v for k, v in weights.items()}, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return out


def add_standin_eagle_heads(zoo: str, out: str, bundle_dir: str, hidden: int, intermediate: int, kv_heads: int,
                            layers: Optional[Tuple[list, int]] = None) -> list:
    """Pad the zoo's EAGLE heads (zoo/eagle1, zoo/eagle3, where present) into `out` and add them to the stand-in
    bundle under the zoo bundle's drafter names (eagle, eagle2, eagle3, eagle3_chain). Returns the names added."""
    from export.drafters.eagle import ZOO_TREE, add_eagle_to_bundle

    added = []
    for src, kind, drafters in (("eagle1", "eagle", {"eagle": None, "eagle2": ZOO_TREE}),
                                ("eagle3", "eagle3", {"eagle3": ZOO_TREE, "eagle3_chain": None})):
        if os.path.isfile(os.path.join(zoo, src, "model.safetensors")):
            head = write_standin_eagle(os.path.join(zoo, src), os.path.join(out, src), hidden, intermediate, kv_heads,
                                       layers)
            added += add_eagle_to_bundle(bundle_dir, head, kind, drafters=drafters)
    return added
