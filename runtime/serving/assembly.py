"""The pieces a Session is assembled from, each checked at creation: the context its arena holds (the plan, held to
the target's window), the drafter's taps against what the target's backend produces, the prompt format and the
token ids that end an answer."""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from runtime.config import MemoryConfig
from runtime.drafters.base import Drafter
from runtime.errors import BundleError
from runtime.memory import plan as memory
from runtime.text.prompts import ZOO_PROMPTS, zoo_tokens_in
from runtime.text.templates import PromptFormat
from runtime.text.tokenizer import Tokenizer


def check_taps(target, drafter: Optional[Drafter], backend: str, bundle_root: str) -> None:
    """Refuse, at session creation, a drafter that reads a hidden tap the target's backend does not produce
    (an ONNX graph exports only the taps named at export time; the numpy reference has them all)."""
    have = getattr(target, "tap_names", None)
    if drafter is None or have is None:
        return
    missing = [t for t in drafter.target_taps if t not in have]
    if missing:
        raise BundleError(f"drafter {drafter.kind!r} reads the target's hidden tap {missing[0]!r}, which the {backend} "
                          f"graph does not export (it has {list(have)}); re-export the ONNX graphs with `edgespec export "
                          f"--to onnx --bundle {bundle_root} --taps {' '.join(sorted(set(have) | set(drafter.target_taps)))}`"
                          + (" and rebuild the engines from them" if backend == "tensorrt" else ""))


def context_positions(mem: MemoryConfig, inp: memory.PlanInputs) -> int:
    """memory.max_context, held to the target's max_position_embeddings: the default is cut to it, a larger value
    given is refused (a ConfigError naming the key, the flag, the limit and the override), unless
    memory.exceed_max_position_embeddings asks for more by name."""
    inp = replace(inp, exceed_max_positions=mem.exceed_max_position_embeddings)
    limit = memory.context_limit(inp)
    if mem.max_context > limit and mem.max_context == MemoryConfig.max_context:
        return limit  # not asked for: the default of a model with a shorter window
    memory.check_context(inp, mem.max_context, "memory.max_context (--max-context)")
    return mem.max_context


def prompt_format(bundle, tokenizer: Tokenizer) -> PromptFormat:
    """The bundle's prompt format; a bundle from before it was recorded gets the zoo's when its tokenizer has
    the zoo's task tokens, else none (a planner request then says what to add)."""
    if bundle.prompts is not None:
        return bundle.prompts
    if zoo_tokens_in(tokenizer):
        return ZOO_PROMPTS
    return PromptFormat(source=f"{bundle.path('bundle.yaml')}: prompts")


def eos_ids(bundle, prompts: PromptFormat, tokenizer: Tokenizer) -> List[int]:
    """Every token id that ends an answer: the config's eos_token_id(s) and the prompt format's eos_tokens."""
    eos = set(bundle.target.spec.eos_token_ids)
    for token in prompts.eos_tokens:
        tid = tokenizer.token_to_id(token)
        if tid is None:
            raise BundleError(f"{prompts.source}.eos_tokens: {token!r} is not a token of {bundle.tokenizer}; "
                              "rebuild the bundle (`edgespec bundle --target DIR --out DIR --prompts FILE`) "
                              "naming a token the tokenizer has")
        eos.add(int(tid))
    return sorted(eos)
