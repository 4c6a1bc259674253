"""What every bench peer is: a runtime that generates from prompt ids on the same weights (export/peers/registry.py
opens them by name; export/peers/llamacpp.py is llama.cpp's own tools)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


class PeerUnavailable(Exception):
    """This peer cannot run here; the message says why (shown as the peer's row)."""


@dataclass(frozen=True)
class PeerModels:
    target: str  # HF folder of the target (config.json + safetensors + tokenizer.json)
    draft: Optional[str] = None  # HF folder of the draft model, for the draft-model peers
    eos_ids: Tuple[int, ...] = ()  # the bundle's EOS ids: a peer's output is cut at the first
    gguf_target: Optional[str] = None  # the bundle's target GGUF (the llama.cpp peers)
    gguf_draft: Optional[str] = None  # the bundle's draft model GGUF (llama.cpp draft-simple)
    threads: int = 0  # edgespec's backend.threads, which the llama.cpp peers are given too (0 = cores)


class Peer:
    name: str = ""
    label: str = ""  # what the bench prints

    def generate(self, prompt_ids: Sequence[int], max_tokens: int) -> Tuple[List[int], Dict[str, float]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def cut_at_eos(ids: Sequence[int], eos: Sequence[int]) -> List[int]:
    """The generated ids up to the first EOS (excluded), as edgespec reports its output.

    >>> cut_at_eos([5, 6, 2, 7], [2])
    [5, 6]"""
    out: List[int] = []
    for t in ids:
        if int(t) in eos:
            break
        out.append(int(t))
    return out
