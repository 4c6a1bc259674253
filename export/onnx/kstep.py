"""The K-step draft graph: K draft-model steps, the logits processing and the sampling in ONE ONNX Runtime run.

A step-wise draft chain costs one ORT run per drafted token, and on a small draft model each run is mostly fixed
cost (the zoo: ~1.3 ms a run, four per cycle). This graph unrolls K steps of the draft model's step graph
(export/onnx/graph.py's DecoderGraph, whose weights it shares) with `process_logits` (runtime/sampling.py) and an
inverse-CDF draw from caller-supplied uniforms between them. Unrolled rather than an ONNX Loop: the draft's K/V
rows grow by one per step, which an unrolled graph joins with a small concat of the chain's own rows and a Loop
would have to carry as a scan state.

Graph contract (bundle: the draft model's backends.onnx entry, params kstep_graph / kstep_steps):
  inputs   input_ids          int64   (T,)        the rows the draft cache lacks; the last is the chain's root
           position_ids       int64   (T,)        their positions (consecutive)
           temperature        float32 (1,)        0 = greedy (argmax of the masked, penalised logits)
           top_k              int64   (1,)        0 = off
           top_p              float32 (1,)        1 = off
           min_p              float32 (1,)        0 = off
           repetition_penalty float32 (1,)        1 = off
           logit_mask         float32 (V,)        0 = allowed, -inf = not (SamplingParams.allowed_tokens)
           seen               bool    (V,)        tokens of the history (the repetition penalty's set)
           uniforms           float64 (K,)        one U[0, 1) per drafted token (float64, and the draw's cumulative
                                                  mass too: a float32 CDF over a large vocabulary draws a mass
                                                  off the q it reports and leaves some tokens undrawable)
           past_key_{i}       kv      (P, nkv, d) as the step graph: rows [0, P) of layer i, bound by pointer
           past_value_{i}     kv      (P, nkv, d)
  outputs  tokens             int64   (K,)        the drafted chain
           q                  float32 (K, V)      the processed distribution each token was drawn from
           confidence         float32 (K,)        each token's own confidence, as runtime/drafters/shared.py's
                                                  node_confidence: q[token] when sampled; greedy (q one-hot) the
                                                  token's probability at temperature 1 after mask and penalty
           new_key_{i}        kv      (T+K-1, nkv, d) the rows of the T inputs and the first K-1 drafted tokens
           new_value_{i}      kv      (T+K-1, nkv, d) (the K-th token is not run, as in the step-wise chain)
The attention is causal over the past and the new rows: no mask input (a chain, never a tree). The confidences
let an adaptive shape cut the chain after the run by the same per-node rule as the step-wise path
(runtime.speculation.NodeRule.keep_chain) and learn its calibration; a graph exported without them is taken only
by requests that use neither."""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np
import torch

from export.library_logs import quiet_library
from export.onnx.graph import (OPSET, PRECISIONS, DecoderGraph, check_against_reference, rms_norm,
                               save_program, share_initializers)
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.backends.onnx import OnnxTarget
from runtime.backends.onnx_kstep import OnnxKStep
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams, process_logits_batch
from runtime.model.spec import ModelSpec

# The top-p mass comparison's tolerance, as runtime/sampling.py's _TOP_P_TOLERANCE.
TOP_P_TOLERANCE = 1e-9
# Partial sorts: a top-k up to TOP_K_CAP, and a top-p set within the TOP_P_CAP most probable tokens, need no sort
# of the whole vocabulary (measured on the zoo's 3072: a full TopK ~0.25 ms a step on one loaded core).
TOP_K_CAP, TOP_P_CAP = 64, 256
PARAM_INPUTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "logit_mask", "seen", "uniforms")


def input_names(num_layers: int) -> list:
    return (["input_ids", "position_ids", *PARAM_INPUTS] + [f"past_key_{i}" for i in range(num_layers)]
            + [f"past_value_{i}" for i in range(num_layers)])


def output_names(num_layers: int) -> list:
    return ["tokens", "q", "confidence"] + [f"new_key_{i}" for i in range(num_layers)] + [f"new_value_{i}" for i in range(num_layers)]


def penalise(x, repetition_penalty, logit_mask, seen):
    """(V,) logits -> the masked, repetition-penalised logits every processing branch starts from."""
    x = x + logit_mask
    return torch.where(seen, torch.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)


def process(x, temperature, top_k, top_p, min_p, repetition_penalty, logit_mask, seen):
    """(V,) float32 logits -> (V,) float32 q, runtime.sampling.process_logits' rule in torch ops: mask ->
    repetition penalty -> greedy one-hot | temperature -> top-k -> top-p -> min-p -> renormalise. The scalar
    parameters are (1,) tensors (graph inputs), so one graph serves every request; the greedy, top-k and top-p
    parts are torch.cond branches (ONNX If nodes), so a request runs only the parts it uses (the sort over the
    vocabulary costs more than a small draft model's step).

    Example: x (2, 1, 0), temperature 1, top_k 2 -> (0.731, 0.269, 0)."""
    return processed(penalise(x, repetition_penalty, logit_mask, seen), temperature, top_k, top_p, min_p)


def processed(x, temperature, top_k, top_p, min_p):
    """`process` after `penalise`."""
    return torch.cond(temperature[0] > 0, _sampled, _greedy, (x, temperature, top_k, top_p, min_p))


def confidence(x, q, token, temperature):
    """The drafted token's own confidence (runtime/drafters/shared.py's node_confidence) from the penalised logits
    x (V,), its q and the token (1,): q[token] when sampled; greedy, where q is one-hot, softmax(x)[token] (the
    distribution a greedy chain ranks by: temperature 1, no truncation).

    Example: x (0, ln 3), greedy, token 1 -> 0.75."""
    return torch.where(temperature[0] > 0, q[token], torch.softmax(x, dim=0)[token])


def _greedy(x, temperature, top_k, top_p, min_p):
    """The one-hot at the argmax (ties -> lowest id, as np.argmax)."""
    return torch.nn.functional.one_hot(torch.argmax(x), x.shape[0]).to(x.dtype)


def _sampled(x, temperature, top_k, top_p, min_p):
    # Shifting by the max before dividing leaves the softmax as it is and keeps x / T finite at a tiny T.
    z = (x - x.max()) / temperature
    z = torch.cond(top_k[0] > 0, _top_k, _same, (z, top_k))
    probs = torch.softmax(z, dim=0)
    probs = torch.cond(top_p[0] < 1.0, _top_p, _same, (probs, top_p))
    probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs / probs.sum()


def _same(x, param):
    return x.clone()  # (a cond branch may not return its input itself)


def _top_k(z, top_k):
    """-inf below the k-th largest value; ties at it are all kept. A k up to TOP_K_CAP takes it from a partial
    TopK of TOP_K_CAP values (the same k-th value: the rest of the order does not matter), a larger one sorts all."""
    return torch.cond(top_k[0] <= min(TOP_K_CAP, z.shape[0]), _top_k_head, _top_k_full, (z, top_k))


def _top_k_head(z, top_k):
    kth = torch.topk(z, min(TOP_K_CAP, z.shape[0])).values[top_k - 1]  # (1,)
    return torch.where(z < kth, torch.full_like(z, float("-inf")), z)


def _top_k_full(z, top_k):
    v = z.shape[0]
    kth = torch.topk(z, v).values[torch.clamp(top_k, 1, v) - 1]  # (1,); k >= V keeps every token
    return torch.where(z < kth, torch.full_like(z, float("-inf")), z)


def _top_p(probs, top_p):
    """The smallest most-probable set (ties -> lower id first) whose mass reaches top_p, renormalised. When the
    TOP_P_CAP most probable tokens already hold that mass the set lies among them (mass before a token only
    grows down the order), so only they are sorted; otherwise the whole vocabulary is."""
    head_p, head_ids = torch.topk(probs, min(TOP_P_CAP, probs.shape[0]))  # ONNX TopK: ties -> lower id first
    mass = torch.cumsum(head_p, dim=0)
    fits = mass[-1] - head_p[-1] >= top_p[0] - TOP_P_TOLERANCE  # the head's last token is already outside the set
    return torch.cond(fits, _top_p_head, _top_p_full, (probs, top_p, head_p, head_ids))


def _top_p_keep(probs, top_p, sorted_p, order):
    """probs with the set of the first len(order) tokens in descending order kept (the rest of `order` dropped)."""
    mass_before = torch.cumsum(sorted_p, dim=0) - sorted_p
    keep_sorted = (mass_before < top_p - TOP_P_TOLERANCE) | (torch.arange(sorted_p.shape[0]) == 0)
    keep = torch.zeros(probs.shape[0], dtype=torch.bool).scatter(0, order, keep_sorted)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def _top_p_head(probs, top_p, head_p, head_ids):
    return _top_p_keep(probs, top_p, head_p, head_ids)


def _top_p_full(probs, top_p, head_p, head_ids):
    sorted_p, order = torch.topk(probs, probs.shape[0])
    return _top_p_keep(probs, top_p, sorted_p, order)


def draw(q, u):
    """Inverse-CDF draw from (V,) q with one uniform u (1,): the first id whose cumulative mass exceeds u * total,
    as runtime.sampling.sample; u rounded up to the total takes the last id of positive mass. The mass is summed in
    float64 as runtime.sampling.sample sums it, so a token is drawn with exactly the probability of the (float32) q
    returned beside it: a float32 cumulative sum over V = 4096 ids is off by ~2e-5 in total variation a token, over
    128k by ~6e-4, and rounds the smallest ids' mass away.

    Example: q (0.2, 0, 0.8): u < 0.2 -> 0, otherwise -> 2."""
    v = q.shape[0]
    cdf = torch.cumsum(q.to(torch.float64), dim=0)
    u = u.to(torch.float64)
    idx = (cdf <= u * cdf[-1]).sum()
    last = v - 1 - torch.argmax(torch.flip(q > 0, (0,)).to(torch.int64))
    return torch.minimum(idx, last)


def draft_step(logits, u, temperature, top_k, top_p, min_p, repetition_penalty, logit_mask, seen):
    """One drafted token of a K-step graph from (V,) float32 logits and its uniform u (1,): -> (token (1,), the q it
    was drawn from (V,), its confidence (1,), `seen` with the token added for the repetition penalty)."""
    x = penalise(logits, repetition_penalty, logit_mask, seen)
    q = processed(x, temperature, top_k, top_p, min_p)
    tok = draw(q, u).reshape(1)
    return tok, q, confidence(x, q, tok, temperature), seen | (torch.arange(seen.shape[0]) == tok)


def unroll(logits, pos, steps: int, uniforms, processing, seen, advance):
    """The K drafted tokens of a K-step graph: `draft_step` on (V,) `logits` with uniform j, then, but after the
    last, `advance(token (1,), its position (1,))` -> the next logits (the drafter runs the token one position on
    from `pos`, the root's). `processing`: (temperature, top_k, top_p, min_p, repetition_penalty, logit_mask).
    -> tokens (K,), q (K, V), confidence (K,). The draft model's and the heads' graphs unroll this loop."""
    tokens, qs, confs = [], [], []
    for j in range(steps):
        tok, q, conf, seen = draft_step(logits, uniforms[j:j + 1], *processing, seen)
        tokens.append(tok)
        qs.append(q)
        confs.append(conf)
        if j + 1 == steps:
            break
        pos = pos + 1
        logits = advance(tok, pos)
    return torch.cat(tokens), torch.stack(qs), torch.cat(confs)


class KStepDraftGraph(torch.nn.Module):
    """K steps of a draft model with processing and sampling between them (see the module docstring)."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], steps: int, precision: str = "fp32"):
        super().__init__()
        self.dec = DecoderGraph(spec, weights, (), precision)
        self.spec, self.steps, self.dtype = spec, steps, PRECISIONS[precision]

    def _attention(self, q, k, v, past_k, past_v, causal):
        """q (T, nh, d); k/v (S, nkv, d): the chain's new rows so far (S >= T, the last T are q's own); past (P, nkv, d);
        causal (T, S) additive over the new rows (the past is always visible) -> (T, nh*d)."""
        s = self.spec
        t, n, nkv, g, d = q.shape[0], k.shape[0], s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        p = past_k.shape[0]
        qg = q.reshape(t, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * t, d)  # (nkv, g*T, d)
        scores = torch.cat([qg @ past_k.permute(1, 2, 0), qg @ k.permute(1, 2, 0)], dim=-1).float()
        scores = scores * (1.0 / float(np.sqrt(d)))
        mask = torch.cat([torch.zeros(t, p), causal], dim=-1)  # (T, P+S)
        scores = scores.reshape(nkv, g, t, p + n) + mask
        probs = torch.softmax(scores, dim=-1).to(q.dtype).reshape(nkv, g * t, p + n)
        out = probs[..., :p] @ past_v.permute(1, 0, 2) + probs[..., p:] @ v.permute(1, 0, 2)  # (nkv, g*T, d)
        return out.reshape(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, s.num_heads * d)

    def _layer(self, i, x, cos, sin, past_k, past_v, chain_k, chain_v, causal):
        """Decoder layer i on x (T, H) with the chain's earlier new rows chain_k/v (S0, nkv, d) -> x', k, v (T, nkv, d)."""
        dec, p = self.dec, f"model.layers.{i}."
        q, k, v = dec.attention_inputs(p, x, cos, sin)
        k_all = k if chain_k is None else torch.cat([chain_k, k])
        v_all = v if chain_v is None else torch.cat([chain_v, v])
        return dec.after_attention(p, x, self._attention(q, k_all, v_all, past_k, past_v, causal)), k, v

    def _step(self, ids, positions, past_keys, past_values, chain_k, chain_v, causal):
        """One forward of the draft on ids (T,) -> the last row's logits (V,) float32; chain_k/v grow by T rows."""
        s, dec = self.spec, self.dec
        cos, sin = dec.rope(positions)
        x = dec.w("model.embed_tokens.weight")[ids]  # (T, H)
        for i in range(s.num_layers):
            x, k, v = self._layer(i, x, cos, sin, past_keys[i], past_values[i], chain_k[i], chain_v[i], causal)
            chain_k[i] = k if chain_k[i] is None else torch.cat([chain_k[i], k])
            chain_v[i] = v if chain_v[i] is None else torch.cat([chain_v[i], v])
        h = rms_norm(x[-1:], dec.w("model.norm.weight"), s.rms_norm_eps)
        head = dec.w("model.embed_tokens.weight") if s.tie_word_embeddings else dec.w("lm_head.weight")
        return (h @ head.t()).float()[0]  # (V,)

    def forward(self, input_ids, position_ids, temperature, top_k, top_p, min_p, repetition_penalty, logit_mask,
                seen, uniforms, past_keys, past_values):
        n = self.spec.num_layers
        chain_k, chain_v = [None] * n, [None] * n
        t = input_ids.shape[0]
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)  # (T, T)
        logits = self._step(input_ids, position_ids, past_keys, past_values, chain_k, chain_v, causal)

        def advance(tok, pos):  # one new row: it sees the past and every new row (no causal mask needed)
            return self._step(tok, pos, past_keys, past_values, chain_k, chain_v, torch.zeros(1, chain_k[0].shape[0] + 1))

        processing = (temperature, top_k, top_p, min_p, repetition_penalty, logit_mask)
        chain = unroll(logits, position_ids[-1:], self.steps, uniforms, processing, seen, advance)
        return (*chain, *chain_k, *chain_v)


def export_kstep_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str, steps: int,
                      precision: str = "fp32") -> str:
    """Export the K-step draft graph of a draft model to `out_path` (+ .data). Returns out_path."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    module = KStepDraftGraph(spec, weights, steps, precision).eval()
    dt = PRECISIONS[precision]
    shape = cache_shape(spec)
    t, p, v = 3, 5, spec.vocab_size
    layers = range(spec.num_layers)
    kv = (p, shape.num_kv_heads, shape.head_dim)
    args = (torch.zeros(t, dtype=torch.int64), torch.arange(p, p + t), torch.ones(1), torch.zeros(1, dtype=torch.int64),
            torch.ones(1), torch.zeros(1), torch.ones(1), torch.zeros(v), torch.zeros(v, dtype=torch.bool),
            torch.full((steps,), 0.5, dtype=torch.float64), [torch.zeros(kv, dtype=dt) for _ in layers],
            [torch.zeros(kv, dtype=dt) for _ in layers])
    T, P = torch.export.Dim("T"), torch.export.Dim("P")
    dynamic = {"input_ids": {0: T}, "position_ids": {0: T}, "temperature": None, "top_k": None, "top_p": None,
               "min_p": None, "repetition_penalty": None, "logit_mask": None, "seen": None, "uniforms": None,
               "past_keys": [{0: P} for _ in layers], "past_values": [{0: P} for _ in layers]}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():
        # strict tracing at once: torch.onnx's first, non-strict attempt fails on torch.cond and logs that as an error
        exported = torch.export.export(module, args, dynamic_shapes=dynamic, strict=True)
        program = torch.onnx.export(exported, dynamo=True, opset_version=OPSET, input_names=input_names(spec.num_layers),
                                    output_names=output_names(spec.num_layers), verbose=False)
    return save_program(program, out_path)


def kstep_rel(name: str, precision: str, steps: int) -> str:
    """The bundle path of drafter `name`'s K-step graph, e.g. onnx/drafter.draft_model.kstep4.fp32.onnx."""
    return f"onnx/drafter.{name}.kstep{steps}.{precision}.onnx"


def validate_kstep(spec: ModelSpec, weights: Mapping[str, np.ndarray], path: str, step_graph: str, steps: int,
                   precision: str = "fp32", seed: int = 0) -> float:
    """Run the K-step graph at `path` (over the cache of the draft's step graph `step_graph`) after a short context,
    and the numpy reference on the same context + the drafted tokens; return the max relative error of the graph's
    q rows against process_logits of the reference's logits, and of its confidences against the reference's at the
    drafted tokens. Twice: at temperature 1 without truncation (q is then the plain softmax, the most sensitive to
    the logits) and greedy (the confidence is then the temperature-1 softmax at the argmax)."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, spec.vocab_size, 9)
    n, shape = len(context) + steps, cache_shape(spec)
    kv_dtype = np.float16 if precision == "fp16" else np.float32
    worst = 0.0
    for params in (SamplingParams(temperature=1.0), SamplingParams()):
        draft = OnnxTarget(spec, step_graph, KVArena.for_context({"d": shape}, n, kv_dtype).allocate("d", shape, n),
                           tap_names=())
        draft.forward(context[:5], np.arange(5))  # a past of 5 rows, then 4 catch-up rows in the K-step run
        tokens, q, conf = OnnxKStep(draft, path, steps).run(context[5:], np.arange(5, len(context)), params, context,
                                                            rng.random(steps))
        ref = NumpyTarget(spec, weights, KVArena.for_context({"d": shape}, n).allocate("d", shape, n))
        chain = np.concatenate([context, tokens[:-1]])
        logits = ref.forward(chain, np.arange(len(chain))).logits[len(context) - 1:]  # (K, V): each drafted token's
        want = process_logits_batch(logits, params)
        ranked = process_logits_batch(logits, SamplingParams(temperature=1.0))  # what a greedy chain ranks by
        want_conf = (ranked if params.greedy else want)[np.arange(steps), tokens]
        scale = max(float(np.max(want)), 1e-12)
        # greedy q is one-hot: a near-tie the precision rounds the other way would read as an error of 1, so the
        # greedy pass checks the confidences only (the sampled pass has checked the same logits through q)
        q_err = 0.0 if params.greedy else float(np.max(np.abs(q - want))) / scale
        worst = max(worst, q_err, float(np.max(np.abs(conf - want_conf))) / scale)
    return worst


def export_and_check_kstep(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str, steps: int,
                           precision: str, step_graph: str, label: str, validate: bool = True) -> str:
    """Export the K-step graph beside the draft's step graph `step_graph` (sharing its weights' data), and check
    it against the numpy reference (ExportError over the precision's tolerance, as for every graph)."""
    export_kstep_onnx(spec, weights, out_path, steps, precision)
    share_initializers(out_path, step_graph)  # the draft's layers and vocab matrices are stored once
    if validate:
        err = validate_kstep(spec, weights, out_path, step_graph, steps, precision)
        print(f"{out_path}: max rel error of q vs numpy reference {err:.2e} ({precision})")
        check_against_reference(label, err, precision)
    return out_path
