"""Drafting pieces every tree-building drafter shares, so that no drafter imports another: the one pick (argmax or
sample), the one ranking rule, how the children of one node are picked (greedy top-k ranked at temperature 1, or
sampled through the sibling rule), the tree mask of drafted rows, the loop that grows chains split at the root, and
the rule that turns one K-step graph run (a whole chain drafted in ONE run: the draft model, EAGLE) into the chain
the step-wise loop would have kept. (A head with a KV cache of its own runs through runtime/drafters/heads.py.)"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, List, Mapping, Optional, Sequence

import numpy as np

from runtime.errors import BundleError
from runtime.sampling import SamplingParams, process_logits, sample
from runtime.siblings import Siblings, draw_siblings, top_k
from runtime.tree import DraftTree, path_to


def pick(q: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One drafted token from its proposal q: the argmax when greedy (q is then one-hot), else a draw from q,
    which the verifier gets as the node's q. Example: q = (0.1, 0.7, 0.2), greedy -> 1."""
    return int(np.argmax(q)) if params.greedy else int(sample(q, rng))


def ranking_params(params: SamplingParams) -> SamplingParams:
    """The processing a drafter ranks candidates by: greedy -> the request's (mask, penalty) at temperature 1 with
    no truncation (a greedy q is one-hot and ranks nothing); sampled -> the request's own. Greedy picks are point
    masses, so the ranking never affects exactness, only which tokens are tried."""
    if not params.greedy:
        return params
    return replace(params, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def pick_children(logits: np.ndarray, q: np.ndarray, params: SamplingParams, history: Sequence[int],
                  width: int, rng: np.random.Generator, rule: Callable = draw_siblings,
                  mask: Optional[np.ndarray] = None) -> Siblings:
    """Children of one node. Greedy -> the top-`width` tokens as point masses; sampled -> `rule` (the one
    sibling rule of `runtime.siblings`: distinct draws, each with the proposal it was drawn from).
    `mask`: the grammar's allowed tokens at this node (q is already masked by it)."""
    if params.greedy:
        if width == 1:
            return Siblings(np.asarray([int(np.argmax(q))], np.int64), None)
        # q is one-hot under greedy; rank by the masked, penalised distribution at temperature 1.
        return top_k(process_logits(logits, ranking_params(params), history, mask), width)
    return rule(q, width, rng)


def tree_mask(base: int, ancestor_rows: Sequence[Sequence[int]], start: int) -> np.ndarray:
    """(T, start + T) bool: drafted rows run at start.. each see the committed rows [0, base), the rows of their
    ancestors and themselves. Example: base 2, start 4, ancestor_rows [[], [4]] -> row 0 sees 0, 1, 4;
    row 1 sees 0, 1, 4, 5."""
    m = np.zeros((len(ancestor_rows), start + len(ancestor_rows)), bool)
    m[:, :base] = True
    for j, rows in enumerate(ancestor_rows):
        m[j, list(rows)] = True
        m[j, start + j] = True
    return m


def node_confidence(logits: np.ndarray, q: np.ndarray, token: int, params: SamplingParams, history: Sequence[int],
                    mask: Optional[np.ndarray] = None) -> float:
    """q's probability of the drafted token; greedy (q one-hot): that of the distribution it was ranked by
    (temperature 1), which says how sure the drafter was. Example: logits (0, ln 3), greedy, token 1 -> 0.75."""
    if not params.greedy:
        return float(q[token])
    return float(process_logits(logits, ranking_params(params), history, mask)[token])


def grow_chains(ctx, history: List[int], root_logits: np.ndarray, width: int, depth: int, rule: Callable,
                run: Callable[[List[int], List[int], List[int], int], np.ndarray]) -> DraftTree:
    """`width` chains split at the root by `pick_children`, each grown to `depth` tokens. Level d (1..depth-1) runs
    the frontier, one node per chain, in ONE call `run(frontier, tokens, parents, d)` -> (len(frontier), V) logits
    (the drafter puts those rows in its cache under a `tree_mask`), then extends every chain by one `pick` from its
    processed q (history + the chain's tokens, the grammar's mask at that path). ctx: the DraftContext.

    With `ctx.stop` (runtime.speculation.NodeRule) a chain ends at the first node that does not pay, and a level
    is not run at all when even a certain next token could not pay for any chain (the gain of a child is at most
    the calibrated acceptance of its parent's path, or a sampled chain's reach at that depth: NodeRule.gain_bound).

    Example, width 2, depth 2, greedy: the root's top-2 tokens a, b; one run over [a, b] -> their argmaxes c, d:
    tokens (a, b, c, d), parents (-1, -1, 0, 1)."""
    params, stop, want = ctx.params, ctx.stop, ctx.wants_confidence
    chain = int(width == 1)  # a sampled node's depth floors its gain (NodeRule.reach) in a chain only: siblings share it
    mask0 = ctx.mask(())  # the request's grammar, applied to q exactly as to p
    q0 = process_logits(root_logits, params, history, mask0)
    firsts = pick_children(root_logits, q0, params, history, width, ctx.rng, rule, mask0)
    deterministic = firsts.deterministic
    tokens: List[int] = []
    parents: List[int] = []
    qs: List[np.ndarray] = []
    conf: List[float] = []  # path confidence per node
    for j, t in enumerate(firsts.tokens.tolist()):
        q = q0 if deterministic else firsts.proposals[j]
        c = node_confidence(root_logits, q, t, params, history, mask0) if want else 1.0
        if stop is not None and not stop.pays(stop.fixed_gain(c) if deterministic else stop.drawn_gain(1.0, q, chain), j):
            break  # siblings come best first: the rest pay less
        tokens.append(t)
        parents.append(-1)
        qs.append(q)
        conf.append(c)
    frontier = list(range(len(tokens)))  # each chain's last node
    for d in range(1, depth):
        reach = 0 if deterministic else chain * (d + 1)  # a sampled chain node's depth floors its gain
        if stop is not None and not any(stop.pays(stop.gain_bound(conf[n], reach), len(tokens)) for n in frontier):
            break
        if not frontier:
            break
        logits = run(frontier, tokens, parents, d)
        new_frontier = []
        for j, node in enumerate(frontier):
            path = [tokens[a] for a in path_to(parents, node)]
            m = ctx.mask(path)
            q = process_logits(logits[j], params, history + path, m)
            if stop is not None and not deterministic and not stop.pays(stop.drawn_gain(conf[node], q, chain * (d + 1)),
                                                                              len(tokens)):
                continue  # decided before looking at the draw (exact)
            t = pick(q, params, ctx.rng)
            c = conf[node] * node_confidence(logits[j], q, t, params, history + path, m) if want else 1.0
            if stop is not None and deterministic and not stop.pays(stop.fixed_gain(c), len(tokens)):
                continue
            new_frontier.append(len(tokens))
            tokens.append(t)
            parents.append(node)
            qs.append(q)
            conf.append(c)
        frontier = new_frontier
    return DraftTree(tokens=np.asarray(tokens, np.int64), parents=np.asarray(parents, np.int64),
                     q=None if deterministic or not tokens else np.stack(qs),
                     deterministic=np.full(len(tokens), deterministic),
                     confidence=np.asarray(conf, np.float64) if want else None)



# -- K-step graphs: a whole chain in one run ------------------------------------------------------------------

KSTEP_MODES = ("auto", "on", "off")  # a drafter entry's params.kstep
STEPWISE, KSTEP = "stepwise", "kstep"  # the drafting paths a drafter with a K-step graph counts (draft_paths)


def kstep_mode(params: Mapping, where: str) -> str:
    """A drafter entry's params.kstep ("auto" when absent), or BundleError naming the field."""
    mode = str(params.get("kstep", "auto"))
    if mode not in KSTEP_MODES:
        raise BundleError(f"{where}: kstep {mode!r}: expected one of {', '.join(KSTEP_MODES)}")
    return mode


def kstep_runs(mode: str, backend) -> bool:
    """Whether a drafter entry's K-step graph is used on `backend` (a BackendConfig): "on" on ONNX, "off" never,
    "auto" only on a GPU execution provider (on the 2-core CPU a step is the model's own arithmetic, not a run's
    fixed cost, and the unrolled graph ran 0.55-0.66x the step-wise chain greedy; docs/drafters/draft_model.md).

    >>> from runtime.config import BackendConfig
    >>> kstep_runs("auto", BackendConfig(kind="onnx")), kstep_runs("on", BackendConfig(kind="onnx"))
    (False, True)"""
    if backend.kind != "onnx" or mode == "off":
        return False
    return mode == "on" or any(p != "CPUExecutionProvider" for p in backend.providers)


def kstep_memory(bundle, entry, backend: str) -> int:
    """Bytes of the weights a drafter entry's K-step graph holds on `backend`: ONNX Runtime loads it as a session of
    its own, so every weight it references is resident again, also those it shares on disk with the step graph
    and the target (export/onnx/graph.py share_initializers): the export records them (params
    kstep_weight_bytes, export/onnx/graph.py graph_weight_bytes); an entry exported before, the K-step graph's own
    files. 0: no K-step graph here. A lower bound of the session: the zoo's added 20-23 MiB resident for 5.8-10.0
    MiB of weights (BENCHMARKS run K2; ORT's per-session structures are the rest, which `memory profile --save`
    folds into the entry's overhead)."""
    files = entry.backends.get("onnx") if backend == "onnx" else None
    rel = files.params.get("kstep_graph") if files is not None else None
    if not rel:
        return 0
    if "kstep_weight_bytes" in files.params:
        return int(files.params["kstep_weight_bytes"])
    return sum(bundle.files[f].size for f in files.files if f.startswith(rel) and f in bundle.files)


def kstep_uniforms(ctx, steps: int) -> np.ndarray:
    """One uniform per drafted token of a K-step run, from the drafter's stream (a greedy chain draws none)."""
    return np.zeros(steps) if ctx.params.greedy else ctx.rng.random(steps)


def kstep_chain(ctx, tokens: np.ndarray, q: np.ndarray, own: Optional[np.ndarray], depth: int) -> DraftTree:
    """The chain of one K-step run (tokens (K,), the q (K, V) each was drawn from, each token's own confidence
    (K,) or None) as the step-wise loop (`grow_chains`) would have kept it: its first `depth` tokens, cut where the
    adaptive rule's nodes stop paying (ctx.stop: NodeRule.keep_chain, node t by the confidences before it and its
    own q, a point mass by its own confidence too), with path confidences when asked. A chain needing confidences
    the graph did not return is the caller's to avoid (`kstep_fits`).

    Example: greedy, depth 2 of tokens (5, 7, 9) -> tokens (5, 7), parents (-1, 0), q None."""
    greedy = ctx.params.greedy
    if not greedy:
        q = q[:depth].astype(np.float64)
        q /= q.sum(axis=1, keepdims=True)  # the draw's own normalisation (inverse CDF against the total mass)
    if ctx.stop is not None:
        depth = ctx.stop.keep_chain([None] * depth if greedy else q, own[:depth].tolist(), greedy)
    conf = np.cumprod(own[:depth].astype(np.float64)) if ctx.wants_confidence else None
    return DraftTree(tokens=tokens[:depth].astype(np.int64), parents=np.arange(-1, depth - 1, dtype=np.int64),
                     q=None if greedy or not depth else q[:depth], deterministic=np.full(depth, greedy),
                     confidence=conf)


def kstep_fits(ctx, kstep, branching: int, depth: int, catch_up: int, room: int, chunk: int) -> bool:
    """Whether a K-step graph (with .steps, .has_confidence) can draft this request's chain exactly as the step-wise
    path would: a chain (branching 1), no grammar (its masks follow the path), at most the graph's K tokens, a
    catch-up of 1 .. `chunk` rows, room for the K - 1 rows it writes beyond them, and, where the adaptive rule cuts
    the chain or records its confidences, a graph that returns them (an older export does not)."""
    return (kstep is not None and branching == 1 and ctx.allowed is None and 0 < depth <= kstep.steps
            and 0 < catch_up <= chunk and kstep.steps - 1 <= room and (kstep.has_confidence or not ctx.wants_confidence))
