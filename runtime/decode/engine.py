"""The batch-1 decode loop.

    prefill -> [ drafter proposes a tree -> target verifies the flattened tree in ONE forward
                 -> accept (exact rule) -> keep only the accepted path's KV rows, contiguous
                 -> drafter is told what was accepted ] -> until EOS / stop / max tokens / deadline

The last emitted token (the "root") has not been run by the target yet: each cycle runs it together
with the draft tree, so a cycle with an empty tree is exactly one step of plain decoding."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from runtime.backends.base import PREFILL_CHUNK, TargetBackend, forward_in_chunks
from runtime.drafters.base import DraftContext, Drafter, common_prefix_len
from runtime.errors import RequestError
from runtime.text.grammar import Grammar, GrammarState
from runtime.sampling import (SamplingParams, greedy_choices, plain_greedy, process_logits, process_logits_batch,
                              sample)
from runtime.speculation import AdaptivePolicy, Calibration
from runtime.tree import DraftTree, verify_inputs
from runtime.verify import verify_greedy, verify_greedy_choices, verify_sampled

FINISH_REASONS = ("eos", "stop", "max_tokens", "deadline", "cancelled")
# The draft of a cycle that drafts nothing (plain decoding, a skipped cycle): read, never written, so one for all
NO_DRAFT = DraftTree(tokens=np.zeros(0, np.int64), parents=np.zeros(0, np.int64))


@dataclass
class DecodeStats:
    tokens: int = 0  # tokens emitted (EOS excluded)
    target_forwards: int = 0  # the prefill's (one per chunk of memory.prefill_chunk tokens) included
    cycles: int = 0  # verify forwards after the prefill
    # tau: mean tokens committed per verify forward = sum over cycles of (accepted drafts + 1) / cycles; 1.0 =
    # plain decoding. It measures the drafter, not the answer: the prefill's first token is not counted, and
    # tokens a cycle verified after an EOS or past max_tokens are (so tokens <= 1 + tau * cycles).
    tau: float = 0.0
    acceptance_by_depth: List[float] = field(default_factory=list)  # P(accepted length >= d | drafted depth >= d)
    tokens_per_s: float = 0.0
    # The time split: prefill_s + draft_s + verify_s + other_s == wall_s (each instant in exactly one).
    ttft_s: float = 0.0  # = prefill_s: the first token is sampled from the prefill's logits
    prefill_s: float = 0.0  # prompt forward + sampling the first token
    draft_s: float = 0.0  # drafter: begin, propose, accept
    verify_s: float = 0.0  # target forwards of the cycles
    other_s: float = 0.0  # the rest of wall_s: verification maths, sampling, callbacks, stop checks
    # Computing grammar masks (and advancing the matcher); NOT a slice of its own: it lies inside
    # prefill_s, draft_s (a drafter masking q) and other_s (the verify rows' masks). 0 without a grammar.
    grammar_s: float = 0.0
    wall_s: float = 0.0  # engine.generate, end to end
    memory_bytes: int = 0
    # Prefix cache (Engine.prefix_cache): prompt tokens whose K/V rows were kept from the previous request
    # (same tokens at the same positions) and the ones the prefill ran; the session's running hit/miss counts.
    prefix_tokens: int = 0
    prefill_tokens: int = 0
    prefix_hits: int = 0  # requests, this one included, that reused at least one row
    prefix_misses: int = 0  # requests that prefilled their whole prompt
    drafter: str = "none"
    backend: str = ""
    # Draft shape: "fixed" (the drafter's own every cycle) or "adaptive" (runtime/speculation.py picks each
    # cycle's node budget from the cost model; "adaptive (tuned)" when that model was measured by `edgespec tune`).
    shape: str = "fixed"
    skipped_cycles: int = 0  # cycles the adaptive rule drafted nothing in (plain steps: drafting did not pay)
    mean_budget: float = 0.0  # mean node budget the adaptive rule gave the drafter per cycle
    # Proposals of this request per drafting path (Drafter.draft_paths: "kstep" / "stepwise"); {} for one path.
    draft_paths: Dict[str, int] = field(default_factory=dict)
    mean_nodes: float = 0.0  # mean nodes drafted per cycle (the per-node rule may stop below the budget)
    # Acceptance against the drafter's confidence (runtime.speculation.Calibration.to_dict: counts per bin of
    # path confidence), where the drafter reports confidences (adaptive shapes, or Engine.record_confidence).
    calibration: Dict[str, List[float]] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        return dict(self.__dict__)


@dataclass
class DecodeOutput:
    tokens: List[int]
    finish_reason: str
    stats: DecodeStats


class StopCheck:
    """What may end a request besides EOS and max tokens: a deadline and a caller's check (cancel,
    stop strings), polled once per cycle and after each emitted batch."""

    def __init__(self, deadline: Optional[float] = None, should_stop: Optional[Callable[[], Optional[str]]] = None):
        self.deadline = deadline  # time.monotonic() value
        self.should_stop = should_stop

    def reason(self) -> Optional[str]:
        if self.should_stop is not None:
            why = self.should_stop()
            if why:
                return why
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        return None


@dataclass
class PlainRun:
    """Plain steps the adaptive rule has already decided for a request's template (AdaptivePolicy.plain_run): the
    engine runs them without asking the rule or telling the drafter each cycle, then tells both once (`flush`):
    the rule through AdaptivePolicy.skip, a drafter that reads the target's taps through ONE accept of the run's
    committed tokens and their tap rows (a drafter reading the context alone catches up when it next proposes).
    Every cycle outside a run flushes first, so the drafter hears of committed rows in context order."""
    left: int = 0  # cycles of the run still to go
    verify_s: List[float] = field(default_factory=list)  # seconds of each cycle run since the policy was last told
    tokens: List[int] = field(default_factory=list)  # the roots those cycles committed, in order
    taps: List[Dict[str, np.ndarray]] = field(default_factory=list)  # ... and the target's taps at each (1, H)

    def flush(self, policy: Optional[AdaptivePolicy], key: str, drafter: Optional[Drafter]) -> None:
        if not self.verify_s:  # no run since the last flush (every drafting cycle asks): nothing to tell
            return
        verify_s, tokens, taps = self.verify_s, self.tokens, self.taps
        self.verify_s, self.tokens, self.taps = [], [], []
        if policy is not None:
            policy.skip(key, verify_s)
        if drafter is not None and taps:
            drafter.accept((), tokens, {name: np.concatenate([t[name] for t in taps]) for name in taps[0]})


class Engine:
    """`prefix_cache`: a request keeps the target's K/V rows of the longest prefix its prompt shares with
    what the cache holds from the previous request (prompt + output, in the same arena) and prefills only
    the rest. Exact by construction: a row's K/V depend only on the tokens at and before its position, and
    the kept rows are those tokens at those positions. Drafters that keep state opt in through
    `Drafter.reusable_prefix`; the others make the target recompute the whole prompt.

    `prefill_chunk`: the prompt runs as forwards of at most this many tokens (backends/base.forward_in_chunks),
    so a long prompt's scratch is that of one chunk; exact for the same reason (each chunk sees the rows before it)."""

    def __init__(self, target: TargetBackend, drafter: Optional[Drafter], eos_ids: Sequence[int] = (),
                 sampled_verifier: Callable = verify_sampled, prefix_cache: bool = True,
                 policy: Optional[AdaptivePolicy] = None, shape: str = "adaptive",
                 prefill_chunk: int = PREFILL_CHUNK):
        self.target = target
        self.drafter = drafter
        # Adaptive draft shapes (runtime/speculation.py): each cycle's node budget comes from the history of
        # acceptance and the cost model only, never from this cycle's target outputs, so exactness is untouched.
        self.policy = policy if drafter is not None else None
        self._shape = shape
        self.eos = set(int(e) for e in eos_ids)
        # verify_sampled (exact) unless the config asks for the LOSSY typical acceptance by name; `certify`
        # swaps in wrong rules to prove it catches them, and refuses a lossy one.
        self.sampled_verifier = sampled_verifier
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        if drafter is not None:  # its catch-up on a new prompt runs in the same chunks (Drafter.prefill_chunk)
            drafter.prefill_chunk = prefill_chunk
        self._cached: List[int] = []  # the tokens of the target's cache rows 0 .. len-1, after the last request
        self._cached_by: Optional[TargetBackend] = None  # ... in this backend (certify swaps in a wrapper)
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.record_confidence = False  # drafters report confidences even with fixed shapes (edgespec tune)

    @property
    def shape(self) -> str:
        """What stats call the draft shape: "fixed", or the adaptive rule's label."""
        if self.policy is None or self.drafter is None:
            return "fixed"
        return self._shape if self._shape != "fixed" else "adaptive"

    def check_request(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams) -> None:
        if len(prompt) == 0:
            raise RequestError("prompt", "is empty; give at least one token of text")
        room = self.target.max_cache_len
        if len(prompt) >= room:  # the prompt alone leaves no room for one token, whatever max_tokens says
            raise RequestError("prompt", f"is {len(prompt)} tokens; the context budget of {room} positions holds at "
                                         f"most {room - 1} prompt tokens plus one generated; shorten it or raise max_context")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise RequestError("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
        if len(prompt) + max_tokens > room:
            raise RequestError("max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                             f"context budget of {room} positions; shorten one or raise max_context")
        params.validate(self.target.spec.vocab_size)

    def generate(self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int = 0,
                 on_tokens: Optional[Callable[[List[int]], None]] = None,
                 stop: Optional[StopCheck] = None, first_token: Optional[int] = None,
                 grammar: Optional[Grammar] = None, template: Optional[str] = None) -> DecodeOutput:
        """Decode up to `max_tokens` after `prompt`. `on_tokens` receives each batch of accepted tokens.
        `first_token`, if given, is emitted instead of sampling the first token (certify fixes the root).
        `grammar`, if given, constrains the answer: every token is drawn from the target masked by the
        grammar state its path reaches, also inside speculation (see `_cycle`).
        `template`: what kind of request this is ("planner", "action", ...) for the adaptive rule, which keeps
        its acceptance per template and temperature class; default: the prompt's first tokens name it."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, max_tokens, params)
        stop = stop or StopCheck()
        rng = np.random.default_rng([seed, 0])  # the target's own sampling / verification stream
        draft_rng = np.random.default_rng([seed, 1])
        stats = DecodeStats(drafter=self.drafter.kind if self.drafter else "none", backend=self.target.name,
                            shape=self.shape)
        key = policy_key(template, prompt, params)
        budgets: List[int] = []
        nodes: List[int] = []  # drafted per cycle
        calibration = Calibration()
        plain = PlainRun()
        emitted_by_cycles = 0  # accepted + 1 per cycle, before EOS / max_tokens cut the output
        depth_tried: List[int] = []
        depth_hit: List[int] = []
        t0 = time.perf_counter()
        state = grammar.start() if grammar is not None else None

        first, taps, start, chunks = self._prefill(prompt, params, rng, state.allowed(()) if state else None)
        if first_token is not None:
            first = int(first_token)
            if not 0 <= first < self.target.spec.vocab_size or (state is not None and not state.allowed(())[first]):
                raise RequestError("first_token", f"{first} is not a token the {'grammar allows here' if state else 'vocabulary has'}; "
                                                  "give one the request could have sampled")
        if state is not None:
            state.commit([first])
        stats.prefill_s = stats.ttft_s = time.perf_counter() - t0
        stats.target_forwards = chunks
        stats.prefix_tokens, stats.prefill_tokens = start, len(prompt) - start
        context = prompt + [first]
        out: List[int] = []
        finish = self._emit([first], out, max_tokens, on_tokens)
        paths_before = self.drafter.draft_paths if self.drafter is not None else {}
        if self.drafter is not None:
            td = time.perf_counter()
            self.drafter.begin(prompt, taps, start=start)
            stats.draft_s += time.perf_counter() - td

        while finish is None:
            finish = stop.reason()
            if finish:
                break
            try:
                cycle = self._cycle(context, params, rng, draft_rng, max_tokens - len(out), stats, state, key,
                                    budgets, calibration, plain)
            except BaseException:
                plain.flush(self.policy, key, None)  # the template's idle count stays true; the drafter starts afresh
                raise
            nodes.append(cycle["nodes"])
            stats.cycles += 1
            stats.target_forwards += 1
            emitted_by_cycles += len(cycle["emitted"])
            tree_depth, accepted = cycle["drafted_depth"], cycle["accepted"]
            for d in range(1, tree_depth + 1):
                while len(depth_tried) < d:
                    depth_tried.append(0)
                    depth_hit.append(0)
                depth_tried[d - 1] += 1
                depth_hit[d - 1] += int(accepted >= d)
            context.extend(cycle["emitted"])
            finish = self._emit(cycle["emitted"], out, max_tokens, on_tokens)
            if state is not None and finish is None:
                state.commit(cycle["emitted"])
            if finish is None:
                finish = stop.reason()

        td = time.perf_counter()
        plain.flush(self.policy, key, self.drafter)
        if self.drafter is not None:
            stats.draft_s += time.perf_counter() - td
        stats.wall_s = time.perf_counter() - t0
        stats.tokens = len(out)
        stats.tau = emitted_by_cycles / stats.cycles if stats.cycles else 0.0
        stats.acceptance_by_depth = [h / n for h, n in zip(depth_hit, depth_tried)]
        stats.skipped_cycles = sum(1 for b in budgets if b == 0)
        stats.mean_budget = float(np.mean(budgets)) if budgets else 0.0
        if self.drafter is not None:
            stats.draft_paths = {k: n - paths_before.get(k, 0) for k, n in self.drafter.draft_paths.items()}
        stats.mean_nodes = float(np.mean(nodes)) if nodes else 0.0
        stats.calibration = calibration.to_dict() if sum(calibration.drafted) else {}
        stats.tokens_per_s = len(out) / stats.wall_s if stats.wall_s > 0 else 0.0
        stats.other_s = stats.wall_s - stats.prefill_s - stats.draft_s - stats.verify_s  # spans never overlap
        stats.grammar_s = state.seconds if state is not None else 0.0
        # The cache's tokens, for the next request's prefix (left unset when a request fails midway: the next
        # one then prefills in full and the drafter starts afresh).
        self._cached, self._cached_by = context[:self.target.cache_len], self.target
        stats.prefix_hits, stats.prefix_misses = self.prefix_hits, self.prefix_misses
        return DecodeOutput(tokens=out, finish_reason=finish, stats=stats)

    def _reusable(self, prompt: List[int]) -> int:
        """Rows of the target's cache to keep for `prompt`: the common prefix with the previous request's
        tokens, at least one prompt token left to run (its logits give the first token), and no more than
        the drafter can start from."""
        cached, cached_by = self._cached, self._cached_by
        self._cached, self._cached_by = [], None  # until this request ends
        if not self.prefix_cache or cached_by is not self.target:
            return 0
        n = min(common_prefix_len(cached, prompt), len(prompt) - 1, self.target.cache_len)
        if n > 0 and self.drafter is not None:
            n = max(0, min(n, self.drafter.reusable_prefix(n)))
        return n

    def _prefill(self, prompt: List[int], params: SamplingParams, rng: np.random.Generator,
                 mask: Optional[np.ndarray] = None):
        """Returns (first token, taps of the rows run, start, forwards): rows [0, start) were kept, [start, len)
        run in `forwards` chunks."""
        start = self._reusable(prompt)
        if start:
            self.target.keep(start, [])
            self.prefix_hits += 1
        else:
            self.target.reset()
            self.prefix_misses += 1
        taps = self.drafter.target_taps if self.drafter else ()
        res = forward_in_chunks(self.target, np.asarray(prompt[start:], np.int64), np.arange(start, len(prompt)), taps,
                                self.prefill_chunk, all_logits=False)
        p = process_logits(res.logits[-1], params, prompt, mask)
        first = int(np.argmax(p)) if params.greedy else sample(p, rng)
        return first, res.taps, start, -(-(len(prompt) - start) // self.prefill_chunk)

    def _cycle(self, context: List[int], params: SamplingParams, rng, draft_rng, remaining: int, stats: DecodeStats,
               grammar: Optional[GrammarState] = None, key: str = "", budgets: Optional[List[int]] = None,
               calibration: Optional[Calibration] = None, plain: Optional[PlainRun] = None):
        """One draft -> verify -> accept cycle. Returns the emitted tokens and what was drafted/accepted.

        In a `plain` run (steps the adaptive rule decided to draft nothing in) the cycle is a plain step that
        neither the rule nor the drafter hears of until the run ends (PlainRun.flush).

        Under a grammar, verify row r (root, then node i) is masked by the grammar state after the root +
        node i's path, so the verifier compares against exactly the distribution plain constrained decoding
        would sample at that point; the drafter gets the same masks through DraftContext.mask (cached)."""
        target = self.target
        base = target.cache_len  # rows before the root
        tree = NO_DRAFT
        draft_s = 0.0
        in_run = plain is not None and plain.left > 0 and remaining > 1
        if in_run:
            plain.left -= 1
            budgets.append(0)
        elif self.drafter is not None:
            td = time.perf_counter()
            if plain is not None:  # a run ended: the rule and the drafter hear of it before anything else
                plain.left = 0
                plain.flush(self.policy, key, self.drafter)
            if remaining > 1:
                tree = self._propose(context, params, draft_rng, remaining, grammar, key, budgets)
            draft_s = time.perf_counter() - td
            stats.draft_s += draft_s
        tokens, positions, mask = verify_inputs(tree, context[-1], base, base)  # mask None: a chain, causal
        tv = time.perf_counter()
        taps_wanted = self.drafter.target_taps if self.drafter else ()
        res = target.forward(tokens, positions, mask, taps_wanted)
        verify_s = time.perf_counter() - tv
        stats.verify_s += verify_s
        if in_run:
            plain.verify_s.append(verify_s)
        masks = grammar.row_masks(tree) if grammar is not None else None
        if plain_greedy(params, masks):  # the raw logits' argmax: no (T, V) distribution is built
            result = verify_greedy_choices(tree, greedy_choices(res.logits))
        else:
            histories = self._histories(context, tree) if params.repetition_penalty != 1.0 else ()
            p = process_logits_batch(res.logits, params, histories, masks)
            result = verify_greedy(tree, p) if params.greedy else self.sampled_verifier(tree, p, rng)
        rows = [base] + [base + 1 + i for i in result.accepted]
        target.keep(base, rows)
        committed = [context[-1]] + [int(tree.tokens[i]) for i in result.accepted]
        if in_run:
            if taps_wanted:
                plain.tokens.append(committed[0])
                plain.taps.append(res.taps)
            return {"emitted": committed[1:] + [result.next_token], "accepted": 0, "drafted_depth": 0, "nodes": 0}
        if self.drafter is not None:
            td = time.perf_counter()
            self.drafter.accept(result.accepted, committed, accepted_rows(res.taps, rows, base))
            stats.draft_s += time.perf_counter() - td
        depth = int(tree.depths().max()) if len(tree) else 0
        if tree.confidence is not None and len(tree):  # acceptance against confidence, for the per-node rule
            hit = np.zeros(len(tree), bool)
            hit[list(result.accepted)] = True
            if calibration is not None:
                calibration.observe(tree.confidence, hit)
            if self.policy is not None:
                self.policy.observe_nodes(key, tree.confidence, hit)
        if self.policy is not None and budgets:
            self.policy.observe(key, depth, len(result.accepted), len(tokens), verify_s, draft_s)
            if plain is not None and not len(tree):
                plain.left = self.policy.plain_run(key)
        return {"emitted": committed[1:] + [result.next_token], "accepted": len(result.accepted), "drafted_depth": depth,
                "nodes": len(tree)}

    def _propose(self, context: List[int], params: SamplingParams, draft_rng, remaining: int,
                 grammar: Optional[GrammarState], key: str, budgets: List[int]) -> DraftTree:
        """The cycle's draft: at most the rows left in the context, the request's remaining tokens but one, and the
        adaptive rule's budget; its per-node rule comes from past cycles and the cost model only, and is not even
        built for a plain step (that must stay ~free)."""
        max_nodes = min(self.target.max_cache_len - self.target.cache_len - 1, remaining - 1)
        stop = None
        if self.policy is not None:
            max_nodes = min(max_nodes, self.policy.budget(key))
            budgets.append(max_nodes)
            stop = self.policy.node_rule(key) if max_nodes > 0 else None
        if max_nodes <= 0:
            return NO_DRAFT
        allowed = grammar.allowed if grammar is not None else None
        record = self.record_confidence or self.policy is not None
        return self.drafter.propose(DraftContext(context, params, draft_rng, max_nodes, allowed, stop, record))

    @staticmethod
    def _histories(context: List[int], tree: DraftTree) -> List[List[int]]:
        """Token history of each verify row (root, then each node): what the repetition penalty sees."""
        rows = [list(context)]
        for i in range(len(tree)):
            rows.append(list(context) + [int(tree.tokens[a]) for a in tree.path(i)])
        return rows

    def _emit(self, tokens: List[int], out: List[int], max_tokens: int, on_tokens) -> Optional[str]:
        """Append accepted tokens up to EOS / max_tokens, stream them, and say whether to finish."""
        batch: List[int] = []
        finish = None
        for t in tokens:
            if t in self.eos:
                finish = "eos"
                break
            batch.append(t)
            if len(out) + len(batch) >= max_tokens:
                finish = "max_tokens"
                break
        out.extend(batch)
        if batch and on_tokens is not None:
            on_tokens(batch)
        return finish


def accepted_rows(taps: Dict[str, np.ndarray], rows: Sequence[int], base: int) -> Dict[str, np.ndarray]:
    """The taps' rows of the committed positions (`rows`: cache rows from base on, the root's first, rising): the
    taps themselves, or a view of their first n = len(rows) rows, where those are the first n verify rows (a plain
    step, a chain accepted from its start: most cycles); else a copy of the rows picked. Backends return fresh tap
    arrays each forward, so a view is never overwritten.

    >>> t = {"h": np.arange(6.0).reshape(3, 2)}
    >>> accepted_rows(t, [10, 11], 10)["h"].tolist(), accepted_rows(t, [10, 12], 10)["h"].tolist()
    ([[0.0, 1.0], [2.0, 3.0]], [[0.0, 1.0], [4.0, 5.0]])"""
    n = len(rows)
    if rows[-1] - base == n - 1:  # rising from base, the last is base + n - 1 only when they are base .. base + n - 1
        return taps if all(len(v) == n for v in taps.values()) else {k: v[:n] for k, v in taps.items()}
    sel = [r - base for r in rows]
    return {k: v[sel] for k, v in taps.items()}


def policy_key(template: Optional[str], prompt: Sequence[int], params: SamplingParams) -> str:
    """The adaptive rule's key for a request: its template (or, unnamed, its first four prompt tokens, which a
    prompt template fixes) and whether it is greedy, since acceptance differs by both.

    >>> policy_key("action", [1, 9, 9], SamplingParams())
    'action/greedy'
    >>> policy_key(None, [1, 5, 7, 7, 2], SamplingParams(temperature=1.0))
    'prefix 1,5,7,7/sampled'"""
    name = template if template else "prefix " + ",".join(str(int(t)) for t in prompt[:4])
    return f"{name}/{'greedy' if params.greedy else 'sampled'}"
