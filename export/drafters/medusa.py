"""Medusa heads on the workstation: read official head files, train Medusa-1 heads with the shared trainer,
write them in the official layout, tune a tree for them, and put them into a bundle.

Official files (FasterDecoding/Medusa):
  Medusa-1  `medusa_lm_head.safetensors` (or the older pickled `medusa_lm_head.pt`, read here only, with
            `torch.load(weights_only=True)`; the runtime never unpickles), keys `{h}.{l}.linear.weight|bias`
            for ResBlock l < L and `{h}.{L}.weight` for the head's vocabulary projection; `config.json` with
            `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path` (the head count there can be
            wrong: it is inferred from the keys).
  Medusa-2  the same keys under `medusa_head.` inside the full model checkpoint (whose body is the fine-tuned
            target: bundle the target from that same checkpoint).
"""
from __future__ import annotations

import heapq
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from runtime.drafters.medusa import medusa_layout, resolve_tree
from runtime.errors import BundleError

HEAD_FILE = "medusa_lm_head.safetensors"
PICKLED_HEAD_FILES = ("medusa_lm_head.pt", "medusa_lm_head.bin")
MEDUSA2_PREFIX = "medusa_head."
DEFAULT_TREE = "mc_sim_7b_63"


@dataclass
class MedusaHeads:
    weights: Dict[str, np.ndarray]  # official keys, no prefix; float32 or float16 as stored (bf16 widened)
    num_heads: int
    num_layers: int
    source: str  # the file read
    config: Dict = field(default_factory=dict)  # config.json beside it, if any
    bf16: Tuple[str, ...] = ()  # keys stored as bf16 (kept bf16 in the bundle, bit for bit)

    @property
    def tree(self) -> Optional[str]:
        """A shipped tree named for the heads (config key `medusa_tree`, a name in
        runtime/drafters/medusa_trees.json, e.g. the zoo's measured one), else None. BundleError if unknown."""
        name = self.config.get("medusa_tree")
        if name is not None:
            resolve_tree(str(name), self.num_heads)  # refuses a name the runtime would not know
        return None if name is None else str(name)

    @property
    def choices(self) -> Optional[List[List[int]]]:
        """A tree shipped with the heads (config key `medusa_choices`), else None."""
        c = self.config.get("medusa_choices")
        return [list(map(int, p)) for p in c] if c else None


def _read_pickled(path: str) -> Dict[str, np.ndarray]:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary objects: say so instead of a traceback
        raise BundleError(f"{path}: not a plain tensor checkpoint torch can load with weights_only=True ({exc}); "
                          "convert it to safetensors") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BundleError(f"{path}: expected a mapping of tensor names to tensors (a medusa_head state_dict)")
    out, bf16 = {}, []
    for k, v in state.items():
        if v.dtype == torch.bfloat16:
            bf16.append(k)
            v = v.float()
        out[k] = v.detach().cpu().numpy()
    return out


def _strip_medusa2(weights: Dict[str, np.ndarray], source: str) -> Dict[str, np.ndarray]:
    """Medusa-2 full checkpoint -> the head keys without their prefix (the model's own keys are left out)."""
    heads = {k[len(MEDUSA2_PREFIX):]: v for k, v in weights.items() if k.startswith(MEDUSA2_PREFIX)}
    if not heads:
        raise BundleError(f"{source}: no {MEDUSA2_PREFIX}* keys; a Medusa-2 checkpoint holds its heads under "
                          f"{MEDUSA2_PREFIX}, a Medusa-1 head file ({HEAD_FILE}) holds them unprefixed")
    return heads


def read_medusa(path: str, hidden: Optional[int] = None, vocab: Optional[int] = None) -> MedusaHeads:
    """Medusa heads from a head file, a directory holding one, or a Medusa-2 checkpoint directory/file.
    Raises BundleError naming the file and the first key that does not fit the official layout."""
    from export.bundle.hf_reader import shard_files
    from runtime.model.tensors import read_safetensors, safetensors_dtypes

    config: Dict = {}
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    cfg_path = os.path.join(folder, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    if os.path.isdir(path):
        for name in (HEAD_FILE,) + PICKLED_HEAD_FILES:
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
    if os.path.isdir(path):  # no head file: a Medusa-2 checkpoint (heads inside the full model)
        weights, dtypes = {}, {}
        for full in shard_files(path):
            dtypes.update(safetensors_dtypes(full))
            weights.update(read_safetensors(full))
        dtypes = {k[len(MEDUSA2_PREFIX):]: v for k, v in dtypes.items()}
        weights = _strip_medusa2(weights, path)
    elif not os.path.isfile(path):
        raise BundleError(f"{path}: no such file or directory; give a Medusa head file ({HEAD_FILE}), its "
                          "directory, or a Medusa-2 checkpoint directory")
    elif path.endswith(".safetensors"):
        weights, dtypes = read_safetensors(path), safetensors_dtypes(path)
        if any(k.startswith(MEDUSA2_PREFIX) for k in weights):
            weights = _strip_medusa2(weights, path)
            dtypes = {k[len(MEDUSA2_PREFIX):]: v for k, v in dtypes.items()}
    elif path.endswith((".pt", ".bin", ".pth")):
        weights, dtypes = _read_pickled(path), {}
        if any(k.startswith(MEDUSA2_PREFIX) for k in weights):
            weights = _strip_medusa2(weights, path)
    else:
        raise BundleError(f"{path}: not a Medusa head file; expected {HEAD_FILE} (or {PICKLED_HEAD_FILES[0]})")
    heads, layers = medusa_layout(weights, path, hidden, vocab)
    said = config.get("medusa_num_heads")
    if said is not None and int(said) != heads:
        print(f"medusa: {cfg_path} says medusa_num_heads {said}, the weights hold {heads} heads; using {heads}")
    return MedusaHeads(weights, heads, layers, path, config, tuple(k for k, d in dtypes.items() if d == "BF16"))


def write_medusa(out_dir: str, weights: Dict[str, np.ndarray], config: Dict) -> List[str]:
    """Write `medusa_lm_head.safetensors` (fp16) + `config.json` into out_dir, each atomically. -> paths."""
    from runtime.model.bundle import give_normal_mode, write_atomically
    from runtime.model.tensors import write_safetensors

    num_heads, num_layers = medusa_layout(weights, "the heads to write")
    os.makedirs(out_dir, exist_ok=True)
    head_path = os.path.join(out_dir, HEAD_FILE)
    fd, tmp = tempfile.mkstemp(prefix=f".{HEAD_FILE}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        write_safetensors(tmp, {k: np.asarray(v, np.float16) for k, v in weights.items()}, metadata={"format": "pt"})
        give_normal_mode(tmp)  # mkstemp made it 0o600
        os.replace(tmp, head_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    cfg = {**config, "medusa_num_heads": num_heads, "medusa_num_layers": num_layers}
    cfg_path = os.path.join(out_dir, "config.json")
    write_atomically(cfg_path, json.dumps(cfg, indent=1) + "\n")
    return [head_path, cfg_path]


def add_medusa_to_bundle(writer, source: str, spec) -> List[str]:
    """Copy Medusa heads into a bundle being written (`runtime.model.bundle.BundleWriter`) as two drafters over one
    file: `medusa` (a tree: the one the heads' config names (`medusa_tree`), else their own `medusa_choices`,
    else the published mc_sim_7b_63) and `medusa_chain` (the top-1 chain). Returns the drafter names."""
    from runtime.model.tensors import write_safetensors

    heads = read_medusa(source, spec.hidden_size, spec.vocab_size)
    rel = f"medusa/{HEAD_FILE}"
    write_safetensors(writer.path(rel), heads.weights, metadata={"format": "pt"}, bf16=list(heads.bf16))
    common = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "layout": "medusa1"}
    tree = heads.tree or heads.choices or DEFAULT_TREE
    writer.add_drafter("medusa", "medusa", files=[rel], params={**common, "tree": tree}, target_taps=["final_norm"])
    writer.add_drafter("medusa_chain", "medusa", files=[rel], params={**common, "tree": "chain"},
                       target_taps=["final_norm"])
    return ["medusa", "medusa_chain"]


# ---- training (Medusa-1: the target frozen, only the heads learn) -------------------------------------------------

def tune_tree(accuracy: np.ndarray, max_nodes: int = 32, min_gain: float = 0.01) -> Tuple[List[List[int]], float]:
    """Medusa's tree search on measured accuracies. accuracy[d, i] = how often candidate i of head d is the
    target's token at depth d+1 (given the path above was right). A node's value is the product of the
    accuracies along its path (the chance greedy verification accepts it); nodes are added best first, a
    node only after its parent, until max_nodes or until the best left adds less than min_gain.
    Returns (choices, expected tokens per cycle = 1 + sum of the chosen values).

    Example: accuracy [[0.6, 0.2], [0.5, 0.1]], max_nodes 3 -> [0] 0.6, [0, 0] 0.3, [1] 0.2 -> tau 2.1."""
    depth, width = accuracy.shape
    frontier = [(-float(accuracy[0, i]), (i,)) for i in range(width)]
    heapq.heapify(frontier)
    chosen, total = [], 1.0
    while frontier and len(chosen) < max_nodes:
        neg, path = heapq.heappop(frontier)
        if -neg < min_gain:
            break
        chosen.append(list(path))
        total += -neg
        if len(path) < depth:
            for i in range(width):
                heapq.heappush(frontier, (neg * float(accuracy[len(path), i]), path + (i,)))
    return sorted(chosen, key=lambda p: (len(p), p)), total


def _torch_task():
    """The training module, defined lazily so that reading head files needs no torch import."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from export.drafters.trainer import DrafterTask, TargetBatch, depth_tally, soft_cross_entropy

    class ResBlock(nn.Module):
        """x + SiLU(W x + b), W zero-initialised: a new head starts as the identity (official Medusa)."""

        def __init__(self, hidden: int):
            super().__init__()
            self.linear = nn.Linear(hidden, hidden)
            nn.init.zeros_(self.linear.weight)

        def forward(self, x):
            return x + F.silu(self.linear(x))

    class MedusaTask(DrafterTask):
        """K heads; state_dict keys `heads.{h}.{l}...`, exported without `heads.` = the official keys.
        Loss: sum over heads of decay^k * KL(target's distribution at t+k+1 || head k at t), per position."""
        kind = "medusa"
        taps = ("final_norm",)

        def __init__(self, hidden: int, vocab: int, num_heads: int = 4, num_layers: int = 1,
                     init_head: Optional[torch.Tensor] = None, decay: float = 0.8):
            super().__init__()
            self.heads = nn.ModuleList([nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                                                      nn.Linear(hidden, vocab, bias=False))
                                        for _ in range(num_heads)])
            if init_head is not None:  # official Medusa-1 starts every head from the target's LM head
                for head in self.heads:
                    head[-1].weight.data.copy_(init_head)
            self.decay = decay

        def forward(self, batch: TargetBatch):
            h = batch.taps["final_norm"]  # (B, T, H)
            B, T, _ = h.shape
            loss = h.new_zeros(())
            numbers = {}
            self.tally = []
            for k, head in enumerate(self.heads):
                shift = k + 1
                valid = batch.same_doc(shift)  # (B, T): t and t+k+1 in one document
                logits = head(h)  # (B, T, V): guesses for the token after position t+k+1
                want = batch.logits[:, shift:][valid[:, :T - shift]]  # (n, V) the target's own prediction there
                got = logits[valid]
                kl = soft_cross_entropy(got, want)
                loss = loss + self.decay ** k * kl.sum() / (B * T)
                with torch.no_grad():
                    self.tally.append(depth_tally(got, want, sampled=not self.training))
                    numbers[f"top1_{k}"] = self.tally[-1][0] / len(want) if len(want) else 0.0
            return loss, numbers

        def official_weights(self) -> Dict[str, np.ndarray]:
            return {k[len("heads."):]: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}

        def export(self, out_dir: str, config: Optional[Dict] = None) -> List[str]:
            return write_medusa(out_dir, self.official_weights(), config or {})

    return MedusaTask


def medusa_task(target, num_heads: int, num_layers: int):
    """A Medusa-1 training task for the zoo target (export.zoo.model.LlamaLM), heads initialised from its head."""
    task_cls = _torch_task()
    head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    return task_cls(target.cfg.hidden_size, target.cfg.vocab_size, num_heads, num_layers, head.detach().clone())


def top_k_accuracy(by_rank: np.ndarray) -> np.ndarray:
    """Top-k accuracy (how often the target's token is among a head's k best) from accuracy by rank (how often
    it is exactly the rank-i candidate, as `measure_accuracy` gives and the tree search needs): the ranks are
    disjoint events, so top-k is their running sum. Example: by rank [0.23, 0.12, 0.08] -> top-k [0.23, 0.35, 0.43]."""
    return np.cumsum(by_rank, axis=-1)


def accuracy_report(by_rank: np.ndarray, k: int = 5) -> List[str]:
    """The training log's lines: per head, top-1..k accuracy and the accuracy of each rank's candidate."""
    top = top_k_accuracy(by_rank)
    return [f"head {d}: top-1..{k} accuracy " + " ".join(f"{a:.2f}" for a in top[d, :k])
            + "; rank-1..{} candidate alone ".format(k) + " ".join(f"{a:.2f}" for a in by_rank[d, :k])
            for d in range(by_rank.shape[0])]


def measure_accuracy(task, batches, width: int = 10):
    """accuracy[d, i]: how often candidate i (rank i of head d) is the target's own argmax token at depth
    d+1, measured teacher-forced on held-out batches (TargetBatch, on the fly or from the feature cache)."""
    import torch

    from export.drafters.trainer import target_argmax

    hits = np.zeros((len(task.heads), width))
    count = np.zeros(len(task.heads))
    with torch.no_grad():
        for b in batches:
            h = b.taps["final_norm"]
            T = h.shape[1]
            for k, head in enumerate(task.heads):
                valid = b.same_doc(k + 1)
                want = target_argmax(b.logits[:, k + 1:][valid[:, :T - k - 1]], b.head.shape[0])  # (n,)
                top = head(h)[valid].topk(width, -1).indices  # (n, width)
                hits[k] += (top == want[:, None]).sum(0).cpu().numpy()
                count[k] += len(want)
    return hits / np.maximum(count, 1)[:, None]
