"""The n-gram drafter: its index proposes exactly what a scan of the context proposes, as the context grows and when
a new request replaces it; a proposal carries its match's confidence, and the adaptive rule's per-node rule cuts
a weak match's chain while keeping a strong one."""
import numpy as np
import pytest

from runtime.drafters.base import DraftContext
from runtime.drafters.ngram import NgramDrafter, NgramIndex, find_continuations
from runtime.sampling import SamplingParams
from runtime.speculation import Calibration, CostModel, NodeRule


@pytest.mark.parametrize("seed", range(4))
def test_the_index_proposes_what_the_scan_proposes_at_every_length_and_across_requests(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        vocab, length = int(rng.integers(2, 8)), int(rng.integers(1, 70))
        max_n = int(rng.integers(1, 5))
        min_n, k, branches = int(rng.integers(1, max_n + 1)), int(rng.integers(1, 6)), int(rng.integers(1, 4))
        index = NgramIndex(max_n, min_n)
        for request in range(2):  # the second request is another sequence: the index starts over
            seq = [int(x) for x in rng.integers(0, vocab, length)]
            for n in range(1, length + 1):
                assert index.continuations(seq[:n], k, branches)[0] == find_continuations(seq[:n], max_n, min_n, k,
                                                                                          branches)


def test_a_proposal_reports_its_match_length_as_confidence():
    drafter = NgramDrafter(num_tokens=3, max_n=3)
    tokens = [4, 5, 6, 7, 8, 9, 4, 5, 6]  # the suffix (4 5 6) matched whole: confidence 3 / 4 a token
    tree = drafter.propose(DraftContext(tokens, SamplingParams(), None, 8, record_confidence=True))
    assert tree.tokens.tolist() == [7, 8, 9]
    assert tree.confidence.tolist() == pytest.approx([0.75, 0.75 ** 2, 0.75 ** 3])
    weak = drafter.propose(DraftContext([4, 5, 1, 2, 3, 9, 5], SamplingParams(), None, 8, record_confidence=True))
    assert weak.tokens.tolist() == [1, 2, 3] and weak.confidence[0] == pytest.approx(0.25)  # (5) alone matched


def test_the_per_node_rule_cuts_a_weak_match_and_keeps_a_strong_one():
    calibration = Calibration(prior_weight=0.0)  # learnt: 3-token matches accepted, 1-token ones not
    calibration.observe([0.75, 0.5625, 0.25, 0.0625], [True, True, False, False])
    rule = NodeRule(CostModel(((1, 1.0), (2, 1.2), (4, 1.4))), calibration, rate=1.2)
    drafter = NgramDrafter(num_tokens=3, max_n=3)
    strong = drafter.propose(DraftContext([4, 5, 6, 7, 8, 9, 4, 5, 6], SamplingParams(), None, 8, stop=rule))
    weak = drafter.propose(DraftContext([4, 5, 1, 2, 3, 9, 5], SamplingParams(), None, 8, stop=rule))
    assert len(strong) >= 2 and len(weak) == 0
