"""A separate draft model's export side (runtime/drafters/draft_model.py): `--draft DIR` writes it into the
bundle; its graphs are decoder graphs, exported by the target's own loop (export/onnx/bundle.py: the step-wise
graph, its K-step graph, GGUF beside the target's)."""
from __future__ import annotations

from export.drafters.registry import DrafterExport, Flag


def _add(writer, flag: str, path: str, spec):
    from export.bundle.builder import add_draft_model

    return [add_draft_model(writer, path, spec)]


EXPORT = DrafterExport(
    kinds=("draft_model",), decoder_graph=True, default=True, add=_add,
    flags=(Flag("--draft", "HF directory of a separate draft model (same tokenizer)"),))
