"""Size limits on a request's text, checked before any work: a 16 MB instruction held a node for 34 s while it
was tokenized, only to be refused by the context budget afterwards. Counting characters costs nothing, so a
request over a limit is refused at once, naming its field and the limit (a node parameter) to raise.

    RequestLimits(instruction_chars=10).check({"instruction": "bring me the cup"})
      -> RequestError(field="instruction"): is 16 characters; ... at most 10 (parameter max_instruction_chars)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from runtime.errors import RequestError

# request field -> the limit that bounds it
LIMIT_OF = {"instruction": "instruction_chars", "context": "context_chars", "observation": "context_chars",
            "observation_text": "context_chars", "prompt": "prompt_chars", "schema": "schema_chars"}


@dataclass(frozen=True)
class RequestLimits:
    instruction_chars: int = 8192  # a spoken or typed instruction is a few hundred
    context_chars: int = 32768  # context, observation, observation_text: a scene description
    prompt_chars: int = 65536  # a Generate prompt (the model's context is the real bound; this one is cheap)
    schema_chars: int = 65536  # a JSON Schema (configs/plan_schema.json is ~2 kB)

    def check(self, fields: Mapping[str, str]) -> None:
        """Refuse the first field longer than its limit (RequestError naming it)."""
        for name, value in fields.items():
            limit = getattr(self, LIMIT_OF[name])
            if len(value) > limit:
                raise RequestError(name, f"is {len(value)} characters; this node takes at most {limit} "
                                         f"(parameter max_{LIMIT_OF[name]}): shorten it or raise the parameter")
