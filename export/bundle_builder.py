"""Write a runtime bundle from HF checkpoints: the target (+ its MTP module if it has one), an optional
separate draft model, the n-gram drafter (no files), the tokenizer and the generation defaults."""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, Optional

import numpy as np

from export.hf_reader import read_hf_checkpoint
from runtime.bundle import BundleWriter
from runtime.errors import BundleError
from runtime.tensors import write_safetensors

MTP_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def split_mtp(weights: Dict[str, np.ndarray], num_layers: int):
    """DeepSeek-V3 style MTP modules live at model.layers.{N+k}: split them from the target's weights."""
    body, mtp = {}, {}
    for name, w in weights.items():
        m = MTP_KEY.match(name)
        (mtp if m and int(m.group(1)) >= num_layers else body)[name] = w
    return body, mtp


def build_bundle(target_dir: str, out: str, draft_dir: Optional[str] = None, name: Optional[str] = None,
                 default_drafter: Optional[str] = None, overwrite: bool = True) -> str:
    """Write `out` as a numpy_ref bundle (other backends are added by their exporters). Returns `out`."""
    target = read_hf_checkpoint(target_dir)
    if target.tokenizer_file is None:
        raise BundleError(f"{target_dir}: no tokenizer.json; the bundle needs the tokenizer the model was trained with")
    if overwrite and os.path.isdir(out):
        shutil.rmtree(out)
    w = BundleWriter(out, name or os.path.basename(os.path.normpath(out)))
    spec = target.spec
    body, mtp = split_mtp(target.weights, spec.num_layers)
    w.set_target(spec)
    write_safetensors(w.path("target/model.safetensors"), body)
    w.add_target_backend("numpy_ref", ["target/model.safetensors"])
    shutil.copyfile(target.tokenizer_file, w.path("tokenizer.json"))
    w.set_tokenizer("tokenizer.json")
    w.add_drafter("ngram", "ngram", params={"max_n": 3, "min_n": 1})
    if mtp:
        modules = sorted({int(MTP_KEY.match(k).group(1)) for k in mtp})
        write_safetensors(w.path("mtp/mtp.safetensors"), mtp)
        w.add_drafter("mtp", "mtp", files=["mtp/mtp.safetensors"],
                      params={"num_modules": len(modules), "first_layer_index": spec.num_layers,
                              "layout": "deepseek_v3"},
                      target_taps=[f"layer_out.{spec.num_layers - 1}"])
    chosen = default_drafter or "ngram"
    if draft_dir:
        draft = read_hf_checkpoint(draft_dir)
        if draft.spec.vocab_size != spec.vocab_size:
            raise BundleError(f"{draft_dir}: vocab size {draft.spec.vocab_size} differs from the target's "
                              f"{spec.vocab_size}; a draft model must share the target's tokenizer")
        dbody, _ = split_mtp(draft.weights, draft.spec.num_layers)
        write_safetensors(w.path("draft/model.safetensors"), dbody)
        w.add_drafter("draft_model", "draft_model", files=["draft/model.safetensors"], spec=draft.spec,
                      params={"num_tokens": 4})
        chosen = default_drafter or "draft_model"
    w.manifest["default_drafter"] = chosen
    w.set_generation(max_tokens=128, temperature=0.0)
    w.write()
    return out
