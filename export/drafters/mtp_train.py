"""Training a DeepSeek-V3-style MTP module for a frozen target with the shared trainer (export/drafters/trainer.py),
for a target that ships none (Llama, Qwen2, Qwen3 as `edgespec bundle` reads them; the zoo trains its own with the
target in export/zoo/train.py).

What the runtime drafter (runtime/drafters/mtp.py) computes for module 0, trained here teacher-forced:

    h'_t  = eh_proj(concat[enorm(emb(x_{t+1})), hnorm(h_t)])      h_t = the target's last layer output, pre-norm
    h''_t = decoder_layer(h'_t) at rotary position t              the TARGET family's layer (q/k norms, biases)
    q(x_{t+2}) = head(shared_head.norm(h''_t))                    head = the target's (tied or not)

Its label at t is the target's own distribution at t+1 (KL). The layer starts as a copy of the target's last
layer and the out norm as the target's final norm. Exported as model.safetensors (fp16) with the DeepSeek-V3
keys model.layers.{N}.* (N = the target's layer count) + config.json; `edgespec bundle --mtp DIR` adds it."""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from export.drafters.target import DecoderLayer
from export.drafters.trainer import DrafterTask, TargetBatch, depth_tally, soft_cross_entropy, write_checkpoint
from export.zoo.model import RMSNorm


class MTPTask(DrafterTask):
    kind = "mtp"

    def __init__(self, target):
        super().__init__()
        cfg = target.cfg
        h, n = cfg.hidden_size, cfg.num_hidden_layers
        self.cfg, self.family = cfg, cfg.family
        self.taps = (f"layer_out.{n - 1}",)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=0.02)
        self.layer = DecoderLayer(cfg)
        self.layer.load_state_dict({k: v.detach().float().cpu() for k, v in target.layers[-1].state_dict().items()})
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head_norm.weight.data.copy_(target.norm.weight.detach().float())
        self.register_buffer("inv_freq", target.inv_freq.detach().float().cpu().clone(), persistent=False)

    def forward(self, batch: TargetBatch, collect: list = None):
        """-> (loss, numbers); `collect`, if given, receives the (B, T, V) logits (for tests)."""
        B, T = batch.ids.shape
        h = batch.taps[self.taps[0]]  # (B, T, H)
        nxt = torch.zeros_like(batch.ids)
        nxt[:, :-1] = batch.ids[:, 1:]
        emb = F.embedding(nxt, batch.embed)  # (B, T, H) emb(x_{t+1})
        freqs = batch.positions.float()[..., None] * self.inv_freq  # (B, T, d/2)
        ang = torch.cat([freqs, freqs], -1)
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
        out = self.shared_head_norm(self.layer(x, cos, sin, batch.attn_mask))  # (B, T, H)
        valid = batch.same_doc(1)  # t and t+1 in one document: x_{t+1} is the module's input
        logits = out @ batch.head.detach().T  # (B, T, V) guesses for x_{t+2}
        if collect is not None:
            collect.append(logits.detach())
        got = logits[valid]
        want = batch.logits[:, 1:][valid[:, :T - 1]]  # the target's own distribution at t+1
        loss = soft_cross_entropy(got, want).sum() / (B * T)
        with torch.no_grad():
            self.tally = [depth_tally(got, want, sampled=not self.training)]
        return loss, {"top1_0": self.tally[0][0] / len(got) if len(got) else 0.0}

    def official_weights(self) -> Dict[str, np.ndarray]:
        """DeepSeek-V3 keys: model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm} + the decoder layer's."""
        p = f"model.layers.{self.cfg.num_hidden_layers}."
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("layer."):
                name = name[len("layer."):]
            elif name.startswith("shared_head_norm."):
                name = "shared_head.norm." + name[len("shared_head_norm."):]
            out[p + name] = t.detach().float().cpu().numpy()
        return out

    def export(self, out_dir: str, config: Dict = None) -> List[str]:
        """model.safetensors (fp16) + config.json naming the module's place (num_nextn_predict_layers: 1)."""
        c = self.cfg
        cfg = {"model_type": c.family, "num_nextn_predict_layers": 1, "num_hidden_layers": c.num_hidden_layers,
               "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "torch_dtype": "float16",
               "layout": "deepseek_v3", **(config or {})}
        os.makedirs(out_dir, exist_ok=True)
        return write_checkpoint(out_dir, {k: v.astype(np.float16) for k, v in self.official_weights().items()}, cfg)
