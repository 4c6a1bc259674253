"""Draft tree structure, Medusa choices, and the one-forward verify layout (tokens, positions, mask)."""

import numpy as np
import pytest

from runtime.tree import DraftTree, chain, empty_tree, flatten, from_choices, verify_inputs

# root ── 0 ── 3 ── 5
#      ├─ 1
#      └─ 2 ── 4
THREE_BRANCH = DraftTree(tokens=np.array([10, 11, 12, 13, 14, 15]), parents=np.array([-1, -1, -1, 0, 2, 3]))


def test_depths_children_and_paths_follow_parent_links():
    t = THREE_BRANCH
    assert len(t) == 6
    np.testing.assert_array_equal(t.depths(), [1, 1, 1, 2, 2, 3])
    assert t.depth(5) == 3 and t.depth(1) == 1
    assert t.children(-1) == [0, 1, 2]
    assert t.children(0) == [3] and t.children(1) == [] and t.children(2) == [4]
    assert t.children_lists() == [[0, 1, 2], [3], [], [4], [5], [], []]
    assert t.path(5) == [0, 3, 5] and t.path(4) == [2, 4] and t.path(1) == [1]
    with pytest.raises(IndexError):
        t.path(6)


def test_flatten_lays_out_root_and_nodes_with_ancestor_mask():
    tokens, positions, mask = flatten(THREE_BRANCH, root_token=99, cache_len=3, root_position=3)
    np.testing.assert_array_equal(tokens, [99, 10, 11, 12, 13, 14, 15])
    np.testing.assert_array_equal(positions, [3, 4, 4, 4, 5, 5, 6])
    assert mask.shape == (7, 3 + 7) and mask.dtype == bool
    assert mask[:, :3].all()
    want = np.array([
        # r  0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # 0
        [1, 0, 1, 0, 0, 0, 0],  # 1
        [1, 0, 0, 1, 0, 0, 0],  # 2
        [1, 1, 0, 0, 1, 0, 0],  # 3
        [1, 0, 0, 1, 0, 1, 0],  # 4
        [1, 1, 0, 0, 1, 0, 1],  # 5
    ], dtype=bool)
    np.testing.assert_array_equal(mask[:, 3:], want)


def test_flatten_of_a_chain_is_causal():
    tokens, positions, mask = flatten(chain([4, 5, 6]), 7, cache_len=0, root_position=10)
    np.testing.assert_array_equal(tokens, [7, 4, 5, 6])
    np.testing.assert_array_equal(positions, [10, 11, 12, 13])
    np.testing.assert_array_equal(mask, np.tril(np.ones((4, 4), dtype=bool)))


def test_flatten_of_the_empty_tree_is_plain_decoding():
    tokens, positions, mask = flatten(empty_tree(), 5, cache_len=2, root_position=2)
    np.testing.assert_array_equal(tokens, [5])
    np.testing.assert_array_equal(positions, [2])
    np.testing.assert_array_equal(mask, [[True, True, True]])


def test_chain_links_each_node_to_the_previous_and_marks_sampling():
    c = chain([3, 1, 2])
    np.testing.assert_array_equal(c.parents, [-1, 0, 1])
    assert c.tokens.dtype == np.int64 and c.deterministic.all() and c.q is None
    q = np.full((3, 4), 0.25)
    s = chain([3, 1, 2], q=q)
    assert not s.deterministic.any()
    s.validate()


def test_empty_tree_has_no_nodes():
    t = empty_tree()
    assert len(t) == 0 and t.children(-1) == []
    t.validate()


def test_from_choices_sorts_parents_before_children_and_reads_candidates_per_depth():
    cands = [np.array([7, 9, 8]), np.array([4, 5])]
    t = from_choices([[1], [0, 1], [0], [0, 0], [1, 0]], cands)
    # sorted: [0], [1], [0,0], [0,1], [1,0]
    np.testing.assert_array_equal(t.tokens, [7, 9, 4, 5, 4])
    np.testing.assert_array_equal(t.parents, [-1, -1, 0, 0, 1])
    assert t.deterministic.all() and t.q is None
    t.validate()


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], [0]], "twice"),
        ([[0, 1]], "no parent"),
        ([[3]], "picks index 3"),
        ([[0], [0, 0], [0, 0, 0]], "deeper"),
        ([[]], "root is implicit"),
    ],
)
def test_from_choices_rejects_malformed_choices(choices, message):
    with pytest.raises(ValueError, match=message):
        from_choices(choices, [np.array([1, 2]), np.array([3, 4])])


def test_default_deterministic_flags_follow_q():
    assert DraftTree(np.array([1]), np.array([-1])).deterministic.tolist() == [True]
    assert DraftTree(np.array([1]), np.array([-1]), q=np.array([[0.5, 0.5]])).deterministic.tolist() == [False]


@pytest.mark.parametrize(
    "tree, message",
    [
        (DraftTree(np.array([1, 2]), np.array([-1])), "parents has shape"),
        (DraftTree(np.array([1, 2]), np.array([1, -1])), "node 0 has parent 1"),
        (DraftTree(np.array([1, 2]), np.array([-1, 1])), "node 1 has parent 1"),
        (DraftTree(np.array([1, 2]), np.array([-1, -2])), "node 1 has parent -2"),
        (DraftTree(np.array([-1]), np.array([-1])), "negative token"),
        (DraftTree(np.array([1]), np.array([-1]), deterministic=np.array([False])), "needs its q row"),
        (DraftTree(np.array([1]), np.array([-1]), q=np.full((2, 3), 1 / 3)), "q has shape"),
        (DraftTree(np.array([5]), np.array([-1]), q=np.full((1, 3), 1 / 3)), "outside q's vocabulary"),
        (DraftTree(np.array([1]), np.array([-1]), q=np.array([[0.5, 0.6, 0.0]])), "sums to"),
        (DraftTree(np.array([2]), np.array([-1]), q=np.array([[0.5, 0.5, 0.0]])), "probability 0"),
        (DraftTree(np.array([1]), np.array([-1]), q=np.array([[1.5, -0.5, 0.0]])), "non-negative"),
        (DraftTree(np.array([1]), np.array([-1]), deterministic=np.array([True, True])), "deterministic has shape"),
    ],
)
def test_validate_names_the_inconsistency(tree, message):
    with pytest.raises(ValueError, match=message):
        tree.validate()


def test_validate_ignores_q_rows_of_deterministic_nodes():
    DraftTree(np.array([2]), np.array([-1]), q=np.array([[0.5, 0.5, 0.0]]), deterministic=np.array([True])).validate()


def test_verify_inputs_leave_a_chains_mask_to_the_backend_as_causal():
    """A chain's flattened mask is exactly the causal one, so the verify passes None (no (T, P+T) array per cycle);
    a branching tree keeps flatten's mask; tokens and positions are flatten's either way."""
    empty = empty_tree()
    branching = DraftTree(tokens=np.array([4, 5, 6]), parents=np.array([-1, -1, 0]))
    for tree in (empty, chain([7, 8, 9])):
        tokens, positions, mask = verify_inputs(tree, 3, 5, 5)
        want_tokens, want_positions, want_mask = flatten(tree, 3, 5, 5)
        assert mask is None and (tokens == want_tokens).all() and (positions == want_positions).all()
        t = len(tokens)
        assert (want_mask == np.concatenate([np.ones((t, 5), bool), np.tri(t, dtype=bool)], axis=1)).all()
    got, want = verify_inputs(branching, 3, 5, 5), flatten(branching, 3, 5, 5)
    assert all((a == b).all() for a, b in zip(got, want))


def test_a_plain_steps_verify_inputs_are_the_root_alone_as_flatten_lays_it_out():
    tokens, positions, mask = verify_inputs(empty_tree(), 7, 5, 5)
    want_tokens, want_positions, _ = flatten(empty_tree(), 7, 5, 5)
    assert tokens.tolist() == want_tokens.tolist() == [7] and tokens.dtype == np.int64
    assert positions.tolist() == want_positions.tolist() == [5] and positions.dtype == np.int64
    assert mask is None  # causal: the backend needs no mask array for it
