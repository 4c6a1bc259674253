"""The distillation loss every drafter kind trains on (export/drafters/trainer.py): the target's distribution cut
to its top k (what the feature cache keeps) still says how much mass lies outside those k, and the loss makes
the drafter leave that mass there. Cut and renormalised over its top k, as before, the target taught the zoo's
heads to put nothing outside it: at T = 1 a sampled draft can then never match the 6 % (action) to 26 % (text)
of the target's mass that lies there."""
import doctest

import pytest
import torch

from export.drafters import heldout, trainer
from export.drafters.heldout import evaluate
from export.drafters.trainer import depth_tally, keep_top_k, soft_cross_entropy, target_argmax


def test_the_cut_keeps_the_top_k_in_place_and_the_rests_mass_in_one_more_column():
    logits = torch.randn(5, 40)
    cut = keep_top_k(logits, 8)
    assert cut.shape == (5, 41) and int(torch.isfinite(cut[:, :40]).sum(-1).max()) == 8
    p = logits.softmax(-1)
    q = cut.softmax(-1)  # the k named tokens and the rest, normalised together
    top = torch.isfinite(cut[:, :40])
    torch.testing.assert_close(q[:, :40][top], p[top])
    torch.testing.assert_close(q[:, 40], p.masked_fill(top, 0).sum(-1))
    assert torch.equal(target_argmax(cut, 40), logits.argmax(-1))  # the rest is never the target's token


def test_the_loss_is_the_kl_over_the_k_tokens_and_the_rest_as_one_outcome():
    logits, drafter = torch.randn(4, 30), torch.randn(4, 30)
    cut = keep_top_k(logits, 5)
    top = torch.isfinite(cut[:, :30])
    lump = lambda x: torch.cat([x.masked_fill(~top, 0), x.masked_fill(top, 0).sum(-1, keepdim=True)], -1)
    p, q = lump(logits.softmax(-1)), lump(drafter.softmax(-1))
    kl = torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(drafter, cut), kl)
    # whole, the same function is the full KL
    full = (logits.softmax(-1) * (logits.log_softmax(-1) - drafter.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(drafter, logits), full)


def test_a_drafter_that_leaves_the_rest_nothing_is_charged_for_it_where_the_old_cut_was_not():
    """Power: the renormalised cut (no rest column) scores a drafter with no mass outside the top k as perfect;
    the loss with the rest column does not, and prefers the drafter that leaves the rest its share."""
    target = torch.tensor([[3.0, 2.0, 1.5, 1.5, 1.5, 1.5]])  # 44 % of the mass outside its top 2
    cut = keep_top_k(target, 2)
    greedy_only = torch.tensor([[3.0, 2.0, -30.0, -30.0, -30.0, -30.0]])  # all its mass on the top 2
    renormalised = cut[:, :6]  # the old cut: -inf outside the top 2, no rest column
    assert float(soft_cross_entropy(greedy_only, renormalised)) < 1e-6  # the old loss: perfect
    assert float(soft_cross_entropy(greedy_only, cut)) > 1.0  # now: charged for the rest it starves
    assert float(soft_cross_entropy(target, cut)) < 1e-6  # and the target itself is perfect


def test_the_worked_examples_in_the_loss_and_evaluation_docstrings_hold():
    assert doctest.testmod(trainer).failed == 0
    assert doctest.testmod(heldout).failed == 0


def test_sampled_acceptance_is_sum_min_p_q_and_a_cut_target_brackets_it():
    """At T = 1 a drafted token is accepted with probability sum_x min(p, q). Against the whole target the tally
    is that number; against the cut the true value lies between its two bounds."""
    torch.manual_seed(0)
    target, drafter = torch.randn(6, 50) * 2, torch.randn(6, 50) * 2
    exact = torch.minimum(target.softmax(-1), drafter.softmax(-1)).sum(-1)
    hits, n, lo, hi = depth_tally(drafter, target)
    assert n == 6 and lo == pytest.approx(float(exact.sum()), rel=1e-5) and hi == lo
    assert hits == float((drafter.argmax(-1) == target.argmax(-1)).sum())
    for k in (1, 5, 20):
        _, _, lo, hi = depth_tally(drafter, keep_top_k(target, k))
        assert lo - 1e-5 <= float(exact.sum()) <= hi + 1e-5
        if k == 1:  # the rest's term is needed: the sum over the top k alone falls short of the truth
            assert float(exact.sum()) > lo + 0.1
    # power: against the old renormalised cut (no rest column) a drafter that copies the top k and leaves the rest
    # nothing reads as accepted always; the cut with its rest column says how often it truly is
    cut = keep_top_k(target, 5)
    copy = cut[:, :50]
    truth = float(torch.minimum(target.softmax(-1), copy.softmax(-1)).sum())
    assert depth_tally(copy, cut[:, :50])[2] == pytest.approx(6.0)
    _, _, lo, hi = depth_tally(copy, cut)
    assert lo == pytest.approx(truth, rel=1e-5) and hi == pytest.approx(truth, rel=1e-5) and truth < 5.5
    assert depth_tally(drafter, target, sampled=False)[2:] == (0.0, 0.0)  # a training step skips the softmaxes


def test_held_out_tau_at_t1_chains_the_mean_sampled_acceptance_of_each_depth():
    class Fixed(torch.nn.Module):
        def forward(self, _batch):
            self.tally = [(8, 10, 7.0, 9.0), (5, 10, 6.0, 6.0)]  # depth 1: a = 0.8 greedy, 0.7 .. 0.9 at T = 1
            return torch.zeros(()), {}

    got = evaluate(Fixed(), [None, None])
    assert got["tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert got["per_depth_t1"] == pytest.approx([0.7, 0.6])
    assert got["tau_t1"] == pytest.approx(1 + 0.7 + 0.7 * 0.6)
    assert got["tau_t1_hi"] == pytest.approx(1 + 0.9 + 0.9 * 0.6)
