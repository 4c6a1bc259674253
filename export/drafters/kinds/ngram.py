"""The n-gram drafter's export side: every bundle gets it (it has no files; runtime/drafters/ngram.py)."""
from __future__ import annotations

from export.drafters.registry import DrafterExport


def _always(writer, spec) -> None:
    writer.add_drafter("ngram", "ngram", params={"max_n": 3, "min_n": 1})


EXPORT = DrafterExport(kinds=("ngram",), always=_always)
