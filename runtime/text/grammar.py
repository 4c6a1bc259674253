"""Token constraints: the one place that decides which tokens a request may emit next.

A `Grammar` is compiled once (a JSON Schema, a Lark grammar, or a fixed run of allowed tokens) by
**llguidance** (Rust; Earley parser over a token trie; the engine vLLM, SGLang and llama.cpp use). Its
tokenizer is built from the bundle's `tokenizer.json` by the `tokenizers` library underneath, no
transformers. `Grammar.start()` gives a `GrammarState`: the matcher of one request.

Exactness under speculation. The reference distribution is the target's, masked by the grammar state
reached along the tokens before it, then processed (temperature, top-k, ...) and renormalised. Each verify
row sees a different path (root, then each tree node), so each row needs the mask of ITS path:
`GrammarState.row_masks(tree)` advances the matcher along every node's path and rolls it back. The
drafter's q only has to be the distribution it actually drew from; masking q with `GrammarState.allowed`
(offered to drafters as `DraftContext.mask`) only keeps impossible tokens out of the tree.

    g = Grammar.from_json_schema(schema, tok)   state = g.start()
    state.allowed(())        -> (V,) bool: the first answer token      ('[' ...)
    state.allowed((5, 9))    -> after the committed tokens + 5, 9      (probe; the matcher is rolled back)
    state.commit([5, 9, 4])  -> the tokens are now part of the answer

A path that leaves the grammar (a drafter that ignored the mask) or that passes an EOS gets an all-True
mask: its parent row gives the node probability 0, so the row is never used, and an all-False row would
only make the logits processing fail.
"""
from __future__ import annotations

import json
import time
from typing import Dict, Sequence, Tuple

import numpy as np

from runtime.errors import BundleError, RequestError


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a packaging error on the robot image
        raise BundleError("the `llguidance` package is missing; `pip install llguidance` "
                          "(it is a runtime dependency of edgespec)") from exc
    return llguidance


class GrammarTokenizer:
    """llguidance's view of the bundle tokenizer: token bytes for the mask trie, and the EOS ids the grammar
    allows once it is complete. Building it costs ~0.1 s for a 3k vocabulary; build it once per model."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        try:
            with open(tokenizer_json, encoding="utf-8") as f:
                text = f.read()
            # n_vocab: the model's logits may be wider than the tokenizer (padding ids are never allowed).
            self.ll = llg.LLTokenizer(text, n_vocab=int(vocab_size), eos_token=[int(e) for e in sorted(eos_ids)])
        except (OSError, ValueError, RuntimeError) as exc:
            raise BundleError(f"{tokenizer_json}: llguidance cannot read this tokenizer ({exc})") from exc
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(sorted(int(e) for e in eos_ids))


MAX_SCHEMA_DEPTH = 64  # nesting of a JSON Schema's objects and arrays; json.loads recursed to death at 10,000
PROBE_TOKENS = 16  # answer tokens walked at compile time to meet llguidance's parser limits before a request does


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text (strings skipped), without parsing it.

    Example: '{"a": [1, {"b": "[["}]}' -> 3."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parser_limit(matcher) -> str:
    """llguidance's complaint when its Earley parser met a limit (e.g. 'Current row has 2500 items; max is
    2000'), else "": a grammar too large for it, not a wrong token."""
    if not matcher.is_error():
        return ""
    return _first_line([matcher.get_error()]).split(" | <state>")[0]


class GrammarLimit(RequestError):
    """The constraint is beyond what llguidance parses (found while decoding): the request's fault."""


class Grammar:
    """A compiled constraint; immutable and shared by requests (each request takes its own `start()`)."""

    # Replaceable on a copy only so that tests can show a wrong masking rule is caught (power controls).
    state_type: type = None  # set to GrammarState below

    def __init__(self, grammar: str, tokenizer: GrammarTokenizer, field: str, source: str):
        llg = _llguidance()
        bad, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.ll)
        if bad:
            raise RequestError(field, f"is not a usable {source}: {_first_line(messages)}")
        self._template = llg.LLMatcher(tokenizer.ll, grammar, log_level=0)
        if self._template.is_error():
            raise RequestError(field, f"is not a usable {source}: {_first_line([self._template.get_error()])}")
        self.tokenizer = tokenizer
        self.source = source
        self.field = field
        self._probe_limits()

    def _probe_limits(self) -> None:
        """Walk a few answer tokens on a copy (the lowest allowed non-EOS id each step): llguidance checks its
        parser limits only as tokens arrive, so a schema with 2,500 anyOf branches compiled and then failed
        its first token mid-request."""
        m = self._template.deep_copy()
        eos = set(self.tokenizer.eos_ids)
        for _ in range(PROBE_TOKENS):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            ids = [int(t) for t in np.flatnonzero(bits[:self.tokenizer.vocab_size]) if int(t) not in eos]
            if parser_limit(m) or not ids:
                break
            m.try_consume_tokens(ids[:1])
            if parser_limit(m) or m.is_accepting():
                break
        why = parser_limit(m)
        if why:
            raise RequestError(self.field, f"is beyond what the grammar engine can parse ({why}); simplify it "
                                           "(fewer alternatives per anyOf / enum of objects, less nesting)")

    @classmethod
    def from_json_schema(cls, schema, tokenizer: GrammarTokenizer, field: str = "json_schema") -> "Grammar":
        """`schema`: a dict, or JSON text. llguidance options may ride in the schema's "x-guidance" key
        (e.g. {"whitespace_flexible": false} for compact JSON)."""
        llg = _llguidance()
        text = schema if isinstance(schema, str) else json.dumps(schema) if not isinstance(schema, bool) else ""
        if json_depth(text) > MAX_SCHEMA_DEPTH:
            raise RequestError(field, f"nests objects/arrays {json_depth(text)} deep; at most {MAX_SCHEMA_DEPTH} "
                                      "levels are accepted")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise RequestError(field, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                                          "send a JSON Schema object") from None
        if schema is True:  # the boolean schema that allows every value (JSON Schema 2019+): as {}
            schema = {}
        if schema is False:
            raise RequestError(field, "is `false`, the schema no value satisfies; send `true` or a JSON Schema object")
        if not isinstance(schema, dict):
            raise RequestError(field, f"must be a JSON Schema object, got {type(schema).__name__}")
        try:
            text = llg.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise RequestError(field, f"is not a usable JSON Schema: {exc}") from None
        return cls(text, tokenizer, field, "JSON Schema")

    @classmethod
    def from_lark(cls, lark: str, tokenizer: GrammarTokenizer, field: str = "grammar") -> "Grammar":
        """A Lark grammar in llguidance's dialect (`start:` rule; `<[id]>` / `<|name|>` for special tokens)."""
        if not isinstance(lark, str) or not lark.strip():
            raise RequestError(field, "is empty; send a Lark grammar with a `start:` rule")
        return cls(_llguidance().LLMatcher.grammar_from_lark(lark), tokenizer, field, "Lark grammar")

    @classmethod
    def token_run(cls, token_ids: Sequence[int], count: int, tokenizer: GrammarTokenizer,
                  field: str = "allowed_tokens") -> "Grammar":
        """Exactly `count` tokens, each one of `token_ids`, then EOS: the action-token answer as a grammar.

        Example: token_ids 9..264 (the 256 action bins), count 56 -> `start: t{56}` / `t: <[9-264]>`."""
        ids = sorted(set(int(t) for t in token_ids))
        if not ids or count < 1:
            raise RequestError(field, "needs at least one token id and a count >= 1")
        return cls.from_lark(f"start: t{{{int(count)}}}\nt: <[{_ranges(ids)}]>\n", tokenizer, field)

    def start(self) -> "GrammarState":
        return self.state_type(self._template.deep_copy(), self.tokenizer, self.field)


class GrammarState:
    """One request's matcher. It has consumed exactly the committed answer tokens, plus a probe path that
    `allowed` moves along (rolling back to the common prefix first, so walking a tree in node order costs
    about one token consumed per node). `seconds` is the time spent here: the request's grammar_s."""

    def __init__(self, matcher, tokenizer: GrammarTokenizer, field: str = "grammar"):
        self.m = matcher
        self.field = field
        self.vocab = tokenizer.vocab_size
        self.eos = set(tokenizer.eos_ids)
        self._probe: list = []  # tokens consumed beyond the committed ones
        self._cache: Dict[Tuple[int, ...], np.ndarray] = {}  # path -> mask, until the next commit
        self._everything = np.ones(self.vocab, dtype=bool)
        self.seconds = 0.0

    def allowed(self, path: Sequence[int] = ()) -> np.ndarray:
        """(V,) bool: the tokens allowed after the committed tokens + `path` (all True if `path` is
        impossible or passes an EOS: no emitted token can follow it)."""
        key = tuple(int(t) for t in path)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        if any(t in self.eos for t in key) or not self._goto(key):
            mask = self._everything
        else:
            bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
            mask = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
            if not mask.any():  # a matcher error state: refuse rather than decode unconstrained
                raise RuntimeError(f"grammar: no token allowed after path {key} ({self.m.get_error()})")
        self._cache[key] = mask
        self.seconds += time.perf_counter() - t0
        return mask

    def row_masks(self, tree) -> np.ndarray:
        """(n+1, V) bool, one row per verify row: row 0 after the root (path ()), row i+1 after node i's path.

        Example: chain (5, 7) -> rows allowed(()), allowed((5,)), allowed((5, 7))."""
        masks = np.empty((len(tree) + 1, self.vocab), dtype=bool)
        masks[0] = self.allowed(())
        tokens = tree.tokens.tolist()
        for i in range(len(tree)):
            masks[i + 1] = self.allowed([tokens[a] for a in tree.path(i)])
        return masks

    def commit(self, tokens: Sequence[int]) -> None:
        """Make `tokens` part of the answer (the engine commits what it emits, never an EOS)."""
        t0 = time.perf_counter()
        self._goto(())
        toks = [int(t) for t in tokens if int(t) not in self.eos]
        if toks:
            n = self.m.try_consume_tokens(toks)
            self._check_limits()
            if n != len(toks):
                raise RuntimeError(f"grammar: emitted token {toks[n]} is not allowed here "
                                   f"(a mask was not applied to the distribution it was drawn from)")
        self._cache.clear()
        self.seconds += time.perf_counter() - t0

    def is_complete(self) -> bool:
        """True when the committed tokens form a complete answer (EOS is allowed)."""
        self._goto(())
        return bool(self.m.is_accepting())

    def _goto(self, path: Tuple[int, ...]) -> bool:
        """Move the matcher to committed + path; False (matcher at the longest valid prefix) if path leaves
        the grammar."""
        probe = self._probe
        common = 0
        while common < len(probe) and common < len(path) and probe[common] == path[common]:
            common += 1
        if len(probe) > common:
            self.m.rollback(len(probe) - common)
            del probe[common:]
        rest = list(path[common:])
        if not rest:
            return len(probe) == len(path)
        n = self.m.try_consume_tokens(rest)
        self._check_limits()
        probe.extend(rest[:n])
        return n == len(rest)

    def _check_limits(self) -> None:
        why = parser_limit(self.m)
        if why:
            raise GrammarLimit(self.field, f"is beyond what the grammar engine can parse ({why}); simplify it")


Grammar.state_type = GrammarState


def _ranges(ids: Sequence[int]) -> str:
    """Sorted ids -> llguidance's token-range list. Example: (3, 4, 5, 9) -> '3-5,9'."""
    parts, start, prev = [], ids[0], ids[0]
    for t in list(ids[1:]) + [None]:
        if t is not None and t == prev + 1:
            prev = t
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if t is not None:
            start = prev = t
    return ",".join(parts)


def _first_line(messages) -> str:
    text = " ".join(str(m) for m in messages).strip()
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return " | ".join(lines[:3]) if lines else "llguidance refused it"


def load_schema_file(path: str, field: str = "schema") -> dict:
    """A JSON Schema file -> dict, with errors that name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise RequestError(field, f"{path}: cannot read ({exc.strerror})") from None
    except RecursionError:
        raise RequestError(field, f"{path}: nests deeper than Python's JSON reader goes; at most "
                                  f"{MAX_SCHEMA_DEPTH} levels are accepted") from None
    except json.JSONDecodeError as exc:
        raise RequestError(field, f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def read_text_file(path: str, field: str) -> str:
    """A grammar file's text, with errors that name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(field, f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
