"""Peers for `edgespec bench --peers`: other runtimes' own speculative decoding, run on the same weights
and prompts in the same process, so that edgespec's numbers stand next to what a user would otherwise pick.

A peer is greedy only (its output must equal plain decoding token for token, which the bench checks):

    peer = open_peer("ortgenai_draft", PeerModels(target="zoo/target", draft="zoo/draft"), cache_dir)
    peer.generate(prompt_ids, max_tokens=64)  # -> (token ids up to the first EOS, excluded; {stat: value})

Peers (each needs the workstation packages; one that cannot run raises PeerUnavailable with the reason):
  hf, hf_assisted, hf_lookup          transformers `generate`: plain, `assistant_model=` the draft model,
                                      `prompt_lookup_num_tokens=10` (n-gram lookup), torch on the CPU
  ortgenai, ortgenai_draft, ortgenai_ngram
                                      onnxruntime-genai: plain, its draft-model speculative decoding
                                      (max_draft_tokens 4), its n-gram decoding (ngram_size 3, 4 drafts);
                                      models built from the HF folders by its own model builder (cached)
  llamacpp, llamacpp_draft, llamacpp_ngram (+ llamacpp_eagle3/_mtp/_dflash, rows saying why not)
                                      llama.cpp's own tools on the bundle's GGUF files (export/peers/llamacpp.py:
                                      built once from the vendored source, cached)
Workstation side: this module may import torch; the runtime never imports it."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from typing import Callable, Dict

from export.peers.base import Peer, PeerModels, PeerUnavailable, cut_at_eos  # noqa: F401 (re-exported)

PEER_NAMES = ("hf", "hf_assisted", "hf_lookup", "ortgenai", "ortgenai_draft", "ortgenai_ngram",
              "llamacpp", "llamacpp_draft", "llamacpp_ngram", "llamacpp_eagle3", "llamacpp_mtp", "llamacpp_dflash")
GGUF_PEERS = tuple(n for n in PEER_NAMES if n.startswith("llamacpp"))  # these read the bundle's GGUF files
ORTGENAI_DRAFT_TOKENS = 4
ORTGENAI_NGRAM_SIZE = 3
HF_LOOKUP_TOKENS = 10


def _need_draft(models: PeerModels, name: str) -> str:
    if not models.draft:
        raise PeerUnavailable(f"{name} needs a draft model: give --peer-draft DIR (an HF folder)")
    return models.draft


class HFPeer(Peer):
    """transformers' own `generate` (greedy), optionally with its assisted generation."""

    def __init__(self, name: str, models: PeerModels):
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise PeerUnavailable(f"transformers/torch not installed ({exc}); pip install -e '.[export]'")
        self.name, self.torch = name, torch
        load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
        self.model = load(models.target)
        self.eos = list(models.eos_ids)
        self.kwargs: Dict[str, object] = {}
        if name == "hf_assisted":
            self.kwargs["assistant_model"] = load(_need_draft(models, name))
            self.label = "HF assisted (draft)"
        elif name == "hf_lookup":
            self.kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
            self.label = f"HF prompt lookup {HF_LOOKUP_TOKENS}"
        else:
            self.label = "HF generate"

    def generate(self, prompt_ids, max_tokens):
        torch = self.torch
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.eos or None,
                                      pad_token_id=self.eos[0] if self.eos else None, **self.kwargs)
        return cut_at_eos(out[0, ids.shape[1]:].tolist(), self.eos), {}


def builder_misreads(config: dict) -> str:
    """Why onnxruntime-genai's builder would convert this HF config wrongly, or "". Its module walk takes EVERY
    Linear with vocab_size outputs for the LM head (builders/base.py `has_lm_head`), so an MLP exactly as wide as the
    vocabulary wires the logits to a layer's norm: a peer that answers, wrongly (seen on a 3072-wide stand-in).

    >>> builder_misreads({"vocab_size": 3072, "intermediate_size": 3200})
    ''
    >>> builder_misreads({"vocab_size": 3072, "intermediate_size": 3072})[:40]
    'intermediate_size 3072 = vocab_size: onn'"""
    vocab, inter = config.get("vocab_size"), config.get("intermediate_size")
    if vocab is not None and inter == vocab:
        return (f"intermediate_size {inter} = vocab_size: onnxruntime-genai's builder takes every {vocab}-output "
                "Linear for the LM head, so its model's logits would come from a layer's MLP input; not compared")
    return ""


def build_ortgenai_model(hf_dir: str, cache_dir: str) -> str:
    """onnxruntime-genai's model folder for an HF checkpoint, made by its own builder (fp32, CPU) once and
    cached under cache_dir, keyed on the checkpoint's bytes. Returns the folder; PeerUnavailable for a checkpoint
    the builder misreads (`builder_misreads`) or a failed build."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            why = builder_misreads(json.load(f))
    except (OSError, ValueError) as exc:
        raise PeerUnavailable(f"{hf_dir}/config.json: cannot be read ({exc})")
    if why:
        raise PeerUnavailable(f"{hf_dir}: {why}")
    h = hashlib.sha256()
    for f in sorted(os.listdir(hf_dir)):
        p = os.path.join(hf_dir, f)
        if os.path.isfile(p):
            h.update(f.encode())
            h.update(str(os.path.getsize(p)).encode())
            with open(p, "rb") as fh:
                h.update(fh.read(1 << 20))  # head of each file + sizes: enough to tell checkpoints apart
    out = os.path.join(cache_dir, "ortgenai", h.hexdigest()[:16])
    if os.path.isfile(os.path.join(out, "genai_config.json")):
        return out
    tmp = out + ".tmp"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", tmp, "-p", "fp32",
           "-e", "cpu", "-c", os.path.join(cache_dir, "ortgenai", "hf_cache")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not os.path.isfile(os.path.join(tmp, "genai_config.json")):
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise PeerUnavailable(f"onnxruntime-genai's builder failed on {hf_dir}: {' / '.join(tail)}")
    os.replace(tmp, out)
    return out


def compose_ortgenai_draft(target_dir: str, draft_dir: str, cache_dir: str) -> str:
    """A genai_config.json with the target's decoder and the draft's as `model.draft` (onnxruntime-genai's
    base speculative decoding). Its paths may not leave the folder, so the two models are linked in."""
    key = hashlib.sha256(f"{target_dir}|{draft_dir}".encode()).hexdigest()[:16]
    out = os.path.join(cache_dir, "ortgenai", f"spec-{key}")
    if os.path.isfile(os.path.join(out, "genai_config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    for name, src in (("target", target_dir), ("draft", draft_dir)):
        link = os.path.join(out, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(src), link)
    with open(os.path.join(target_dir, "genai_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(draft_dir, "genai_config.json")) as f:
        draft = json.load(f)["model"]["decoder"]
    config = copy.deepcopy(config)
    config["model"]["decoder"]["filename"] = "target/" + config["model"]["decoder"]["filename"]
    config["model"]["draft"] = dict(draft, filename="draft/" + draft["filename"])
    tmp = os.path.join(out, "genai_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(out, "genai_config.json"))
    return out


def thread_overlay(threads: int, draft: bool = False) -> dict:
    """The genai_config overlay giving onnxruntime-genai's sessions edgespec's intra-op thread count (0: one per
    CPU, as edgespec's onnx backend). Left to itself it took ONE thread on this 2-vCPU VM (stand-in: 36 tok/s
    against 81 at two), which measured edgespec against half a peer.

    >>> thread_overlay(2, draft=True)["model"]["draft"]["session_options"]
    {'intra_op_num_threads': 2, 'inter_op_num_threads': 1}"""
    opts = {"intra_op_num_threads": int(threads or os.cpu_count() or 1), "inter_op_num_threads": 1}
    model = {"decoder": {"session_options": dict(opts)}}
    if draft:
        model["draft"] = {"session_options": dict(opts)}
    return {"model": model}


class OrtGenAIPeer(Peer):
    """onnxruntime-genai's generator, greedy, plain or with its own speculative decoding."""

    def __init__(self, name: str, models: PeerModels, cache_dir: str):
        try:
            import numpy as np
            import onnxruntime_genai as og
        except ImportError as exc:
            raise PeerUnavailable(f"onnxruntime-genai not installed ({exc}); pip install onnxruntime-genai")
        self.name, self.og, self.np = name, og, np
        folder = build_ortgenai_model(models.target, cache_dir)
        self.options: Dict[str, object] = {}
        if name == "ortgenai_draft":
            draft = build_ortgenai_model(_need_draft(models, name), cache_dir)
            folder = compose_ortgenai_draft(folder, draft, cache_dir)
            self.options = {"max_draft_tokens": ORTGENAI_DRAFT_TOKENS}
            self.label = f"ORT-GenAI draft k={ORTGENAI_DRAFT_TOKENS}"
        elif name == "ortgenai_ngram":
            self.options = {"ngram_size": ORTGENAI_NGRAM_SIZE, "max_draft_tokens": ORTGENAI_DRAFT_TOKENS}
            self.label = f"ORT-GenAI n-gram {ORTGENAI_NGRAM_SIZE}"
        else:
            self.label = "ORT-GenAI"
        config = og.Config(folder)
        config.overlay(json.dumps(thread_overlay(models.threads, draft=name == "ortgenai_draft")))
        self.model = og.Model(config)
        self.eos = list(models.eos_ids)

    def generate(self, prompt_ids, max_tokens):
        og, np = self.og, self.np
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(prompt_ids) + max_tokens)
        if self.options:
            params.set_speculative_options(**self.options)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray([list(prompt_ids)], dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        ids = [int(t) for t in gen.get_sequence(0)][len(prompt_ids):]
        stats: Dict[str, float] = {}
        if self.options:
            s = gen.get_speculative_stats()
            if s.get("target_forward_passes"):
                stats["target_forwards"] = float(s["target_forward_passes"])
        return cut_at_eos(ids, self.eos)[:max_tokens], stats


FACTORIES: Dict[str, Callable[[str, PeerModels, str], Peer]] = {
    "hf": lambda n, m, c: HFPeer(n, m), "hf_assisted": lambda n, m, c: HFPeer(n, m),
    "hf_lookup": lambda n, m, c: HFPeer(n, m),
    "ortgenai": OrtGenAIPeer, "ortgenai_draft": OrtGenAIPeer, "ortgenai_ngram": OrtGenAIPeer,
}


def _llamacpp_peer(name: str, models: PeerModels, cache_dir: str) -> Peer:
    from export.peers.llamacpp import LlamaCppPeer
    return LlamaCppPeer(name, models, cache_dir, log=lambda m: print(m, file=sys.stderr, flush=True))


FACTORIES.update({n: _llamacpp_peer for n in GGUF_PEERS})


def open_peer(name: str, models: PeerModels, cache_dir: str) -> Peer:
    """The named peer, ready to generate, or PeerUnavailable saying why it cannot run here."""
    if name not in FACTORIES:
        raise PeerUnavailable(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")
    if name not in GGUF_PEERS and not os.path.isfile(os.path.join(models.target or "", "config.json")):
        raise PeerUnavailable(f"--peer-target {models.target}: no config.json there (an HF folder is needed)")
    try:
        return FACTORIES[name](name, models, cache_dir)
    except PeerUnavailable:
        raise
    except Exception as exc:  # a peer library's own failure is that peer's row, not the bench's end
        raise PeerUnavailable(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
