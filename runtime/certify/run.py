"""`edgespec certify`: a statistical proof, on the robot's own bundle and backend, that speculative
decoding does not change the target's distribution.

For each context, the real engine (real drafter, real verification, real models) is run many times
from the same state with different seeds; the empirical distribution of the first emitted token and of
the first two emitted tokens is compared with the exact target distribution, computed by enumeration,
by a chi-square goodness-of-fit test. Models are wrapped in `MemoModel`, which answers a forward from
a cache keyed by the token path each row sees — the numbers are the model's own, only never computed
twice — so tens of thousands of draws take seconds to minutes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.base import ForwardResult
from runtime.decode.engine import Engine, StopCheck
from runtime.errors import ConfigError
from runtime.sampling import SamplingParams, process_logits, sample
from runtime.siblings import Siblings
from runtime.tree import path_to
from runtime.certify.stat_tests import chi_square_gof
from runtime.verify import VerifyResult, residual


def dedup_siblings(q: np.ndarray, width: int, rng: np.random.Generator, exclude: Sequence[int] = ()) -> Siblings:
    """WRONG, for power controls only: `width` i.i.d. draws from q with duplicates dropped, each verified
    against the plain q (the rule issue 10 found biased where q is peaked). `certify` swaps it into the
    drafter to show that its test would catch a wrong sibling rule.

    Example: q = (0.8, 0.1, 0.1), width 2: draws (0, 0) give ONE child, token 0, with proposal q.
    """
    row = np.asarray(q, dtype=np.float64)
    picks: List[int] = []
    for _ in range(width):
        t = sample(row, rng)
        if t not in picks:
            picks.append(t)
    return Siblings(np.asarray(picks, np.int64), np.repeat(row[None, :], len(picks), axis=0))


def forget_residual(tree, probs: np.ndarray, rng: np.random.Generator) -> VerifyResult:
    """WRONG, for power controls only: the right acceptance test, but after a rejection the next child (or
    the correction) is tried against p itself instead of the residual norm(max(0, p - q))."""
    accepted: List[int] = []
    node = -1
    kids = tree.children_lists()
    while True:
        p = probs[node + 1]
        for c in kids[node + 1]:
            x = int(tree.tokens[c])
            qx = 1.0 if tree.deterministic[c] else tree.q[c][x]
            if rng.random() * qx < p[x]:
                accepted.append(c)
                node = c
                break
        else:
            return VerifyResult(accepted=accepted, next_token=sample(p, rng))


def unique_taps(taps: Sequence[str]) -> Tuple[str, ...]:
    """Tap names once each, in first-seen order: a tap is one array per name, however many readers name it
    (as the backends give it: a dict by name), so its rows are gathered once, not once per mention."""
    return tuple(dict.fromkeys(taps))


class MemoModel:
    """A TargetBackend wrapper that memoises each row's output by the token path it attends to.

    Exact by construction: a causal decoder's output at a position depends only on the tokens it can
    see, in position order; a miss runs the wrapped model on that whole path from an empty cache.
    Paths are interned in a trie (node = (parent node, token)), so a row costs a dict lookup, not a
    tuple of its whole context: the path a row sees is the path of the last row it attends to plus its
    own token, which holds for causal and tree masks (every visible row's ancestors are visible too;
    a mask where that fails is refused)."""

    def __init__(self, model, taps: Sequence[str] = ()):
        self.model = model
        self.spec = model.spec
        self.name = model.name
        self.taps = unique_taps(taps)
        self.rows: List[int] = []  # trie node of each virtual cache row
        self._node: Dict[Tuple[int, int], int] = {}  # (parent node, token) -> node; -1 = the empty path
        self._parent: List[int] = []
        self._token: List[int] = []
        self._depth: List[int] = []
        self.memo: Dict[int, Tuple[np.ndarray, Dict[str, np.ndarray]]] = {}  # node -> its row's output
        self.misses = 0
        self._prefill: Optional[Tuple[Tuple, ForwardResult]] = None  # the last forward from an empty cache

    @property
    def cache_len(self) -> int:
        return len(self.rows)

    @property
    def max_cache_len(self) -> int:
        return self.model.max_cache_len

    def _child(self, parent: int, token: int) -> int:
        node = self._node.get((parent, token))
        if node is None:
            node = self._node[(parent, token)] = len(self._token)
            self._parent.append(parent)
            self._token.append(token)
            self._depth.append(1 + (self._depth[parent] if parent >= 0 else 0))
        return node

    def _path(self, node: int) -> List[int]:
        return path_to(self._parent, node)

    def _compute(self, nodes: Sequence[int]) -> None:
        """Run the wrapped model once, from an empty cache, on the union of the paths of `nodes` laid out
        as one tree (each row sees its ancestors), and memoise every row of it."""
        self.misses += 1
        rows: set = set()
        for node in nodes:
            while node >= 0 and node not in rows:
                rows.add(node)
                node = self._parent[node]
        order = sorted(rows)  # a parent is created before its children, so ids order parents first
        at = {n: i for i, n in enumerate(order)}
        mask = np.zeros((len(order), len(order)), dtype=bool)
        for i, n in enumerate(order):
            par = self._parent[n]
            if par >= 0:
                mask[i] = mask[at[par]]
            mask[i, i] = True
        tokens = np.asarray([self._token[n] for n in order], np.int64)
        positions = np.asarray([self._depth[n] - 1 for n in order], np.int64)
        self.model.reset()
        res = self.model.forward(tokens, positions, mask, self.taps)
        for i, n in enumerate(order):
            if n not in self.memo:  # copies: a view would keep the whole (rows, V) output alive
                self.memo[n] = (res.logits[i].copy(), {k: v[i].copy() for k, v in res.taps.items()})
        self.model.reset()

    def forward(self, tokens, positions, mask=None, taps=(), all_logits: bool = True) -> ForwardResult:
        base = len(self.rows)
        ids = list(self.rows)
        for j, tok in enumerate(int(t) for t in tokens):
            if mask is None:
                parent = ids[-1] if ids else -1
            else:
                cols = np.flatnonzero(mask[j, :base + j])
                parent = ids[cols[-1]] if cols.size else -1
                if cols.size != (self._depth[parent] if parent >= 0 else 0):
                    raise ValueError(f"row {j} attends to rows that are not one causal path: not a tree mask")
            ids.append(self._child(parent, tok))
        taps = unique_taps(taps)  # EAGLE-3 on a shallow target names one tap twice ([2, 2, 1] on 4 layers)
        key = (tuple(ids), taps)
        if base == 0 and self._prefill is not None and self._prefill[0] == key:
            self.rows = ids  # every draw prefills the same prompt: reuse its stacked output
            out = self._prefill[1]
            return out if all_logits else ForwardResult(out.logits[-1:], out.taps)
        missing = [node for node in ids[base:] if node not in self.memo]
        if missing:
            self._compute(missing)
        logits, tap_rows = [], {k: [] for k in taps}
        for node in ids[base:]:
            row_logits, row_taps = self.memo[node]
            logits.append(row_logits)
            for k in taps:
                tap_rows[k].append(row_taps[k])
        self.rows = ids
        out = ForwardResult(np.stack(logits), {k: np.stack(v) for k, v in tap_rows.items()})
        if base == 0:
            self._prefill = (key, out)
        return out if all_logits else ForwardResult(out.logits[-1:], out.taps)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        self.rows = self.rows[:start] + [self.rows[r] for r in rows]

    def reset(self) -> None:
        self.rows = []

    def distribution(self, path: Sequence[int], params: SamplingParams) -> np.ndarray:
        node = -1
        for t in path:
            node = self._child(node, int(t))
        if node not in self.memo:
            self._compute([node])
        return process_logits(self.memo[node][0], params, [int(t) for t in path])


@dataclass
class ContextResult:
    context: str
    draws: int
    first_statistic: float
    first_p_value: float
    pair_statistic: float
    pair_p_value: float
    alpha: float
    tau: float

    @property
    def passed(self) -> bool:
        return self.first_p_value >= self.alpha and self.pair_p_value >= self.alpha


def exact_pair_distribution(target: MemoModel, prefix: Sequence[int], params: SamplingParams, min_mass: float):
    """p(t1) and the joint p(t1, t2) for every t1 with p(t1) >= min_mass; the other t1 share one bin."""
    p1 = target.distribution(prefix, params)
    heads = [int(t) for t in np.nonzero(p1 >= min_mass)[0]]
    joint = {t: p1[t] * target.distribution(list(prefix) + [t], params) for t in heads}
    return p1, joint


def run_until(engine: Engine, prompt: Sequence[int], params: SamplingParams, seed: int, root: int, tokens: int):
    """Decode after prompt + root until at least `tokens` tokens (root included) are out. max_tokens is left
    large, so every cycle drafts its full tree: a small max_tokens would cap the draft (the engine drafts at
    most max_tokens - emitted - 1 nodes) and leave the trees untested."""
    got: List[int] = []
    stop = StopCheck(should_stop=lambda: "stop" if len(got) >= tokens else None)
    room = min(64, engine.target.max_cache_len - len(prompt))
    return engine.generate(prompt, params, max_tokens=room, seed=seed, on_tokens=got.extend, stop=stop,
                           first_token=root)


def certify_context(engine: Engine, target: MemoModel, prompt: Sequence[int], params: SamplingParams, draws: int,
                    alpha: float, seed: int, label: str, min_mass: float = 1e-4,
                    on_draw: Optional[Callable[[int], None]] = None) -> ContextResult:
    root = int(np.argmax(target.distribution(prompt, SamplingParams())))  # a natural continuation to start from
    prefix = list(prompt) + [root]
    p1, joint = exact_pair_distribution(target, prefix, params, min_mass)
    vocab = p1.shape[0]
    heads = sorted(joint)
    head_index = {t: i for i, t in enumerate(heads)}
    first_counts = np.zeros(vocab)
    pair_counts = np.zeros(len(heads) * vocab + 1)  # last bin: t1 outside the enumerated heads
    emitted = cycles = 0
    for i in range(draws):
        out = run_until(engine, prompt, params, seed + i, root, 3)
        t1, t2 = out.tokens[1], out.tokens[2]
        first_counts[t1] += 1
        pair_counts[head_index[t1] * vocab + t2 if t1 in head_index else -1] += 1
        emitted += len(out.tokens) - 1
        cycles += out.stats.cycles
        if on_draw:
            on_draw(i + 1)
    pair_probs = np.concatenate([joint[t] for t in heads] + [[max(0.0, 1.0 - sum(p1[t] for t in heads))]])
    pair_probs /= pair_probs.sum()
    g1 = chi_square_gof(first_counts, p1)
    g2 = chi_square_gof(pair_counts, pair_probs)
    return ContextResult(label, draws, g1.statistic, g1.p_value, g2.statistic, g2.p_value, alpha,
                         emitted / cycles if cycles else 0.0)


def memoise_session(session) -> MemoModel:
    """Swap the session's target (and draft model) for memoising wrappers; returns the target's.
    Idempotent: a session already memoised keeps its wrappers (and what they have cached)."""
    if isinstance(session.engine.target, MemoModel):
        return session.engine.target
    taps = session.drafter.target_taps if session.drafter else ()
    target = MemoModel(session.target, taps)
    session.engine.target = target
    if session.drafter is not None:
        session.drafter.wrap_models(MemoModel)
    return target


Context = Tuple[str, List[int]]  # (label, prompt token ids)


def first_proposal(session, target: MemoModel, prompt: Sequence[int], params: SamplingParams):
    """(p, q) where certify draws its first token after `prompt`: p the target's processed distribution after
    prompt + root (root = the target's argmax after prompt, as in `certify_context`), q the proposal the
    drafter recorded for the first child it put there (one-hot for a point mass); q is None when the
    drafter proposed nothing. Runs the real engine and drafter for one cycle."""
    engine, drafter = session.engine, session.drafter
    root = int(np.argmax(target.distribution(prompt, SamplingParams())))
    trees = []
    propose = drafter.propose
    drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    try:
        run_until(engine, prompt, params, 0, root, 2)
    finally:
        del drafter.propose
    p = target.distribution(list(prompt) + [root], params)
    if not trees or len(trees[0]) == 0:
        return p, None
    tree = trees[0]
    first = tree.children(-1)[0]
    q = np.eye(p.shape[0])[tree.tokens[first]] if tree.deterministic[first] else tree.q[first]
    return p, q


def control_bias(p: np.ndarray, q: np.ndarray, width: int) -> np.ndarray:
    """law(power-control rule) - p at one node, in closed form, for a drafter proposal q against target p.

    width 1 (a chain; control: sample p instead of the residual after a rejection):
        bias = (1 - beta) (p - r1),   beta = sum min(p, q),  r1 = norm(max(0, p - q)).
    width >= 2 (control: drop duplicate siblings; computed for the first two siblings): the rules differ
    only when both draws are the same token a and it is rejected, where the right rule rejects the
    duplicate too and corrects from r2 = norm(max(0, r1 - q)), the wrong one from r1:
        bias = c (r1 - r2),   c = sum_a q(a)^2 (1 - min(1, p(a) / q(a))).
    Example: p = (0.2, 0.5, 0.3), q = (0.8, 0.1, 0.1), width 2: r1 = (0, 2/3, 1/3), r2 = (0, 0.708, 0.292),
    c = 0.64 * 0.75 = 0.48 -> bias (0, -0.02, 0.02): the law (0.2, 0.48, 0.32) of tests/runtime/test_siblings.py.
    """
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    r1 = residual(p, q)
    if width <= 1:
        return (1.0 - np.minimum(p, q).sum()) * (p - r1)
    accept = np.minimum(1.0, np.divide(p, q, out=np.ones_like(p), where=q > 0))
    return float((q ** 2 * (1.0 - accept)).sum()) * (r1 - residual(r1, q))


def sensitivity(p: np.ndarray, q: np.ndarray, width: int) -> float:
    """Expected chi-square statistic per draw of the power control at this node (its non-centrality /
    draws): sum bias^2 / p. N draws detect the control when N * sensitivity is well above the dof."""
    bias = control_bias(p, q, width)
    keep = p > 0
    return float((bias[keep] ** 2 / p[keep]).sum())


def choose_contexts(session, seeds: Sequence[Tuple[str, str]], params: SamplingParams, horizon: int = 32,
                    rollouts: int = 2, near_certain: float = 0.99, seed: int = 0) -> List[Context]:
    """Deterministic search for contexts where a wrong rule would show. For each (domain, seed prompt),
    follow `rollouts` continuations of `horizon` tokens (the target's greedy one, then samples from the
    target at temperature 1 with fixed seeds); at each prefix run the real drafter for one cycle and score
    its first proposal by `sensitivity` (the power control's expected chi-square per draw). Per domain
    keep the best prefix, and the best one whose next token (the root) is near-certain (p >= near_certain)
    — where the target barely hesitates before the token the drafter branches on."""
    target = memoise_session(session)
    width = max(1, session.drafter.branching)
    rng = np.random.default_rng([seed, 7])
    best: Dict[Tuple[str, str], Tuple[float, List[int]]] = {}
    for domain, text in seeds:
        for rollout in range(rollouts):
            path = session.tokenizer.encode(text)
            for _ in range(horizon):
                p_root = target.distribution(path, SamplingParams(temperature=1.0))
                p, q = first_proposal(session, target, path, params)
                if q is not None:
                    score = sensitivity(p, q, width)
                    kinds = ["most sensitive"] + (["near-certain root"] if p_root.max() >= near_certain else [])
                    for kind in kinds:
                        if score > best.get((domain, kind), (-1.0, None))[0]:
                            best[(domain, kind)] = (score, list(path))
                nxt = int(np.argmax(p_root)) if rollout == 0 else sample(p_root, rng)
                if nxt in session.engine.eos:
                    break  # past the end of an answer the model is off its data: not a context a robot sees
                path = path + [nxt]
    chosen: List[Context] = []
    for (domain, kind), (score, prompt) in best.items():
        tail = session.tokenizer.decode(prompt[-6:]).replace("\n", " ")
        chosen.append((f"{domain}, {kind} (control chi2/draw {score:.4f}): ...{tail}", prompt))
    return chosen


LOSSY_REFUSAL = ("decoding.lossy_typical_acceptance: typical acceptance is a LOSSY rule (it changes the output "
                 "distribution by design); certify proves exactness and refuses it. Turn the option off (drop "
                 "--lossy-typical-acceptance) to certify the exact rule")


def certify(session, contexts: Sequence, params: SamplingParams, draws: int = 20000, alpha: float = 1e-3,
            seed: int = 0, verifier: Optional[Callable] = None, sibling_rule: Optional[Callable] = None,
            progress: Optional[Callable[[ContextResult], None]] = None,
            on_draw: Optional[Callable[[int, int, int, int], None]] = None) -> List[ContextResult]:
    """Run `certify_context` on each context (a text, or a (label, token ids) pair from `choose_contexts`).
    `verifier` / `sibling_rule` replace the verification rule / the drafter's sibling rule for this call
    only: power controls that feed a wrong rule and must be rejected. `progress` gets each context's result,
    `on_draw(context index, contexts, draws done, draws)` is called after every draw (progress lines)."""
    if getattr(session.engine.sampled_verifier, "lossy", False):
        raise ConfigError(LOSSY_REFUSAL)
    target = memoise_session(session)
    eos, session.engine.eos = session.engine.eos, set()  # EOS is one more outcome here, not the end of the draw
    drafter = session.drafter
    if sibling_rule is not None:
        drafter.sibling_rule = sibling_rule
    configured = session.engine.sampled_verifier
    if verifier is not None:
        session.engine.sampled_verifier = verifier
    results = []
    try:
        for k, ctx in enumerate(contexts):
            label, prompt = (ctx, session.tokenizer.encode(ctx)) if isinstance(ctx, str) else ctx
            tick = (lambda i, k=k: on_draw(k, len(contexts), i, draws)) if on_draw else None
            res = certify_context(session.engine, target, prompt, params, draws, alpha, seed + 1_000_003 * k, label,
                                  on_draw=tick)
            results.append(res)
            if progress:
                progress(res)
    finally:
        session.engine.eos = eos
        session.engine.sampled_verifier = configured
        if sibling_rule is not None:
            del drafter.sibling_rule
    return results
