"""The bundle's tokenizer (an HF `tokenizer.json`, read with the `tokenizers` library — no torch)."""
from __future__ import annotations

import json
from typing import List, Optional, Sequence

from runtime.errors import BundleError, RequestError
from runtime.text.recent import Recent
from runtime.text.templates import RenderedPrompt


class Tokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - a packaging error on the robot image
            raise BundleError("the `tokenizers` package is missing; `pip install tokenizers`") from exc
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as exc:
            raise BundleError(f"{path}: cannot load tokenizer ({exc}); re-export the bundle") from exc
        self.path = path
        # Request text is tokenized by a twin that knows no added token (each one marked special, and special
        # tokens split as text): '<|sep|>' typed by a user becomes '<', '|', 'sep', ... never the control token.
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        for t in spec.get("added_tokens", []):
            t["special"] = True
        self._text_tok = _HFTokenizer.from_str(json.dumps(spec))
        self._text_tok.encode_special_tokens = True
        self.added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
        self._added_ids = set(self.added.values())
        self._text_cache = Recent(TEXT_CACHE)  # request text -> its ids as text
        self._piece_cache = Recent(256)  # a template piece -> its added tokens (start, end, id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return list(_encode(self._tok, text).ids)

    def encode_text(self, text: str) -> List[int]:
        """`text` as plain text: every added token's characters are tokenized like any other characters."""
        return list(_encode(self._text_tok, text).ids) if text else []

    def encode_prompt(self, prompt: RenderedPrompt) -> List[int]:
        """A rendered prompt's ids: the template's control tokens real, the request's text as text.

        The text is cut at the added tokens found in the template's own pieces (outside `user_spans`) and each
        stretch between them is tokenized as text, which is what tokenizing the whole string does (HF splits at
        added tokens before anything else) as long as the request text holds none: a prompt without forged
        tokens gets exactly `encode(prompt.text)`.
        Example (zoo, instruction 'go<|sep|>'): [<|bos|>, <|plan|>, 'go', '<|', 'sep', '|>', <|sep|>]."""
        if not prompt.exact:
            self.refuse_control_text(prompt.values)
            return self.encode(prompt.text)
        text, cuts, stretches, pos = prompt.text, list(self._template_tokens(prompt)), [], 0
        for start, end, _ in cuts:
            stretches.append(text[pos:start])
            pos = end
        stretches.append(text[pos:])
        encoded = self._encode_texts(stretches)
        ids: List[int] = []
        for stretch_ids, (_, _, tid) in zip(encoded, cuts):
            ids += stretch_ids
            ids.append(tid)
        return ids + encoded[-1]

    def _encode_texts(self, texts: Sequence[str]) -> List[List[int]]:
        """encode_text of each, in one call of the tokenizer for those not seen lately (a robot repeats its
        instructions; the short ones are kept, up to TEXT_CACHE entries)."""
        out: List[Optional[List[int]]] = [[] if not t else self._text_cache.get(t) for t in texts]
        todo = [i for i, ids in enumerate(out) if ids is None]
        if todo:
            for i, enc in zip(todo, self._text_tok.encode_batch([texts[i] for i in todo], add_special_tokens=False)):
                out[i] = list(enc.ids)
                if len(texts[i]) <= TEXT_CACHE_CHARS:
                    self._text_cache.put(texts[i], out[i])
        return [list(ids) for ids in out]

    def refuse_control_text(self, values) -> None:
        """Refuse a request value holding an added token's text (where the template hid the value's place)."""
        for field, value in values:
            hit = next((t for t in self.added if t in value), None)
            if hit is not None:
                raise RequestError(field, f"contains {hit!r}, a control token of this model; remove it "
                                          "(this bundle's template changes request text, so it cannot be kept as text)")

    def _template_tokens(self, prompt: RenderedPrompt):
        """(start, end, id) of each added token in the template's own text, in order."""
        text, edges, pos = prompt.text, [], 0
        for start, end in sorted(prompt.user_spans) + [(len(prompt.text), len(prompt.text))]:
            if start > pos:
                edges.append((pos, start))
            pos = max(pos, end)
        for a, b in edges:
            piece = text[a:b]
            found = self._piece_cache.get(piece)
            if found is None:  # the template's own text: a handful of distinct pieces per bundle
                enc = _encode(self._tok, piece)
                found = [(s, e, tid) for tid, (s, e) in zip(enc.ids, enc.offsets) if tid in self._added_ids]
                self._piece_cache.put(piece, found)
            for s, e, tid in found:
                yield a + s, a + e, tid

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(int(token_id))


TEXT_CACHE = 512  # request texts kept with their ids ...
TEXT_CACHE_CHARS = 2048  # ... when no longer than this


def _encode(tok, text: str):
    """One text's Encoding, tokenized with the GIL released (`encode` holds it throughout, `encode_batch` does
    not): a long request text must not stop the node's other threads (lifecycle, state, diagnostics)."""
    return tok.encode_batch([text], add_special_tokens=False)[0]


class StreamDecoder:
    """Turns a growing list of token ids into text deltas. Byte-level BPE can split a character over
    several tokens, so a delta is only released once it no longer ends in a partial character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: List[int] = []
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of a request, partial characters included."""
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta
