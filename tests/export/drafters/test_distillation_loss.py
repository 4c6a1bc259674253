"""The distillation loss every drafter kind trains on (export/drafters/trainer.py): the target's distribution cut
to its top k (what the feature cache keeps) still says how much mass lies outside those k, and the loss makes
the drafter leave that mass there. Cut and renormalised over its top k, as before, the target taught the zoo's
heads to put nothing outside it: at T = 1 a sampled draft can then never match the 6 % (action) to 26 % (text)
of the target's mass that lies there."""
import torch

from export.drafters.trainer import keep_top_k, soft_cross_entropy, target_argmax


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
