"""The numpy reference model equals transformers (torch CPU) on tiny random models of every family,
for prefill, step-by-step decode and a tree-masked forward; and a tree-masked forward equals the
sequential forwards along each of its branches."""
import numpy as np
import pytest
import torch

from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.memory.kv import KVArena
from tests.support.hf_tiny import FAMILY_CONFIGS, rel_err, tiny_hf_model

TOL = 1e-4
FAMILIES = list(FAMILY_CONFIGS)


def make_target(spec, weights, positions=128):
    arena = KVArena.for_context({"target": cache_shape(spec)}, positions)
    return NumpyTarget(spec, weights, arena.allocate("target", cache_shape(spec), positions))


def hf_forward(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return tiny_hf_model(request.param, seed=FAMILIES.index(request.param))


def test_prefill_logits_and_hidden_taps_match_transformers(family_model):
    model, spec, weights = family_model
    tokens = list(np.random.default_rng(1).integers(0, spec.vocab_size, 70))  # long enough for llama3 rope bands
    ref_logits, ref_hidden = hf_forward(model, tokens)
    n = spec.num_layers
    taps = [f"layer_in.{i}" for i in range(n)] + [f"layer_out.{i}" for i in range(n - 1)] + ["final_norm"]
    out = make_target(spec, weights).forward(np.array(tokens), np.arange(len(tokens)), taps=taps)
    assert rel_err(out.logits, ref_logits) <= TOL
    for i in range(n):
        assert rel_err(out.taps[f"layer_in.{i}"], ref_hidden[i]) <= TOL  # HF hidden_states[i] enters layer i
    for i in range(n - 1):
        assert rel_err(out.taps[f"layer_out.{i}"], ref_hidden[i + 1]) <= TOL
    assert rel_err(out.taps["final_norm"], ref_hidden[n]) <= TOL  # HF's last hidden state is final-normed


def test_step_by_step_decode_matches_transformers(family_model):
    model, spec, weights = family_model
    tokens = list(np.random.default_rng(2).integers(0, spec.vocab_size, 24))
    ref_logits, _ = hf_forward(model, tokens)
    target = make_target(spec, weights)
    target.forward(np.array(tokens[:8]), np.arange(8))
    for i in range(8, len(tokens)):
        out = target.forward(np.array([tokens[i]]), np.array([i]))
        assert rel_err(out.logits[0], ref_logits[i]) <= TOL


def tree_case(spec, seed=3):
    """A prefix and a flattened tree: root r, children a, b of r; c child of a. Rows: r a b c."""
    rng = np.random.default_rng(seed)
    prefix = list(rng.integers(0, spec.vocab_size, 10))
    r, a, b, c = (int(x) for x in rng.integers(0, spec.vocab_size, 4))
    tokens = np.array([r, a, b, c])
    p = len(prefix)
    positions = np.array([p, p + 1, p + 1, p + 2])
    ancestors = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    mask = np.concatenate([np.ones((4, p), bool), ancestors], axis=1)
    branches = {(0, 1, 3): [r, a, c], (0, 2): [r, b]}
    return prefix, tokens, positions, mask, branches


def test_tree_masked_forward_matches_transformers_on_each_branch(family_model):
    model, spec, weights = family_model
    prefix, tokens, positions, mask, branches = tree_case(spec)
    target = make_target(spec, weights)
    target.forward(np.array(prefix), np.arange(len(prefix)))
    out = target.forward(tokens, positions, mask, taps=["final_norm"])
    for rows, branch in branches.items():
        ref_logits, ref_hidden = hf_forward(model, prefix + branch)
        assert rel_err(out.logits[list(rows)], ref_logits[len(prefix):]) <= TOL
        assert rel_err(out.taps["final_norm"][list(rows)], ref_hidden[-1][len(prefix):]) <= TOL


def test_tree_masked_forward_equals_sequential_forwards_along_each_branch(family_model):
    _, spec, weights = family_model
    prefix, tokens, positions, mask, branches = tree_case(spec, seed=4)
    tree_target = make_target(spec, weights)
    tree_target.forward(np.array(prefix), np.arange(len(prefix)))
    tree_logits = tree_target.forward(tokens, positions, mask).logits
    for rows, branch in branches.items():
        seq = make_target(spec, weights)
        seq.forward(np.array(prefix), np.arange(len(prefix)))
        for j, tok in enumerate(branch):
            step = seq.forward(np.array([tok]), np.array([len(prefix) + j])).logits[0]
            np.testing.assert_allclose(tree_logits[rows[j]], step, rtol=0, atol=1e-4 * np.abs(step).max())


def test_keeping_the_accepted_branch_equals_having_decoded_it(family_model):
    """After a tree verify, keep() compacts the accepted rows; the next step matches a plain decode."""
    _, spec, weights = family_model
    prefix, tokens, positions, mask, _ = tree_case(spec, seed=5)
    p = len(prefix)
    tree_target = make_target(spec, weights)
    tree_target.forward(np.array(prefix), np.arange(p))
    tree_target.forward(tokens, positions, mask)
    tree_target.keep(p, [p + 0, p + 1, p + 3])  # accept r -> a -> c
    assert tree_target.cache_len == p + 3
    nxt = 7
    after_tree = tree_target.forward(np.array([nxt]), np.array([p + 3])).logits[0]
    full = make_target(spec, weights).forward(np.array(prefix + [int(tokens[0]), int(tokens[1]), int(tokens[3]), nxt]), np.arange(p + 4)).logits[-1]
    np.testing.assert_allclose(after_tree, full, rtol=0, atol=1e-4 * np.abs(full).max())


def test_forward_stays_float32(family_model):
    _, spec, weights = family_model
    out = make_target(spec, weights).forward(np.array([1, 2, 3]), np.arange(3), taps=["final_norm"])
    assert out.logits.dtype == np.float32 and out.taps["final_norm"].dtype == np.float32
