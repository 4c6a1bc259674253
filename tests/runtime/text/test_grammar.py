"""Grammar-constrained decoding (runtime/text/grammar.py, llguidance) stays exact under speculation.

The reference is plain constrained decoding: each token drawn from the target masked by the grammar state
its path reaches, renormalised. Speculative decoding must emit exactly that law, for every drafter, with
chains and trees, whether or not the drafter masks its own q (masking q only saves verify rows).

Setting: tiny random numpy Llamas (V = 97; target with a DeepSeek-V3 MTP module; draft model = the target
with noise and three times sharper logits) and a real byte-level BPE tokenizer trained here on strings of
letters a-h / i-p / q-z, digits and brackets. The grammar GRAMMAR allows only alternating letters (a-h then
i-p, at least three pairs), so after a letter a-h only 8 of the 97 tokens may follow and the masks change
along every path. Statistical tests: alpha = 0.001, DRAWS draws per configuration, fixed seeds; first token
(V bins) and first two tokens (V*V bins, pooled where expected < 5); each wrong rule must be rejected.
"""
import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from export.zoo.model import LlamaConfig, LlamaLM, hf_state_dict
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import MemoModel
from runtime.drafters.base import Drafter
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.drafters.ngram import NgramDrafter
from runtime.decode.engine import Engine, StopCheck
from runtime.errors import RequestError
from runtime.text.grammar import Grammar, GrammarState, GrammarTokenizer
from runtime.memory.kv import KVArena
from runtime.model.spec import ModelSpec
from runtime.sampling import SamplingParams
from runtime.certify.stat_tests import chi_square_gof
from runtime.tree import DraftTree
from tests.runtime.certify.test_certify_trees import overconfident

V = 97
EOS = 2
GRAMMAR = "start: /([a-h][i-p]){3,}/"
COMPLETE = re.compile(r"([a-h][i-p]){3,}")
PREFIX = re.compile(r"([a-h][i-p])*[a-h]?")
ALPHA = 1e-3
DRAWS = 2000  # per exactness configuration; controls use DRAWS // 4 (their errors are gross)
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = np.random.default_rng(0)
    pairs = ["".join(rng.choice(list("abcdefgh")) + rng.choice(list("ijklmnop")) for _ in range(8)) for _ in range(200)]
    other = ["".join(rng.choice(list("qrstuvwxyz0123456789{}[]"))for _ in range(12)) for _ in range(100)]
    hf = Tokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(pairs + other, trainers.BpeTrainer(vocab_size=90, show_progress=False,
                                                              special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"]))
    path = str(tmp_path_factory.mktemp("grammar") / "tokenizer.json")
    hf.save(path)
    return hf, GrammarTokenizer(path, V, [EOS])  # ids 90..96: padding of the model's vocabulary


@pytest.fixture(scope="module")
def weights():
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = LlamaLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    w = {k: v.detach().numpy().copy() for k, v in hf_state_dict(model).items()}
    return ModelSpec.from_hf_config(cfg.hf_dict()), w


class IgnoresGrammar(Drafter):
    """A drafter that never looks at the grammar: proposes from its unmasked q (exact all the same)."""

    def __init__(self, inner):
        self.inner, self.kind, self.branching = inner, inner.kind + " (ignores grammar)", getattr(inner, "branching", 1)

    def begin(self, prompt, taps, start=0):
        self.inner.begin(prompt, taps, start)

    def propose(self, ctx):
        return self.inner.propose(dataclasses.replace(ctx, allowed=None))

    def accept(self, accepted_nodes, committed, taps):
        self.inner.accept(accepted_nodes, committed, taps)


def engine(weights, kind: str, branching: int = 1, k: int = 3, memo: bool = False, noise: float = 0.5) -> Engine:
    spec, w = weights
    shapes = {"t": cache_shape(spec), "d": cache_shape(spec), "m": mtp_cache_shape(spec)}
    arena = KVArena.for_context(shapes, 96)
    target = NumpyTarget(spec, w, arena.allocate("t", shapes["t"], 80))
    base = kind.split("/")[0]
    if base == "none":
        drafter = None
    elif base == "draft_model":
        model = NumpyTarget(spec, overconfident(w, noise), arena.allocate("d", shapes["d"], 80))
        drafter = DraftModelDrafter(MemoModel(model) if memo else model, num_tokens=k, branching=branching)
    elif base == "ngram":
        drafter = NgramDrafter(num_tokens=k, max_n=2, branching=branching)
    else:
        embed = target.w["model.embed_tokens.weight"]
        drafter = MTPDrafter(spec, w, embed, embed, arena.allocate("m", shapes["m"], 88), k)
    if kind.endswith("/ignores"):
        drafter = IgnoresGrammar(drafter)
    return Engine(MemoModel(target, drafter.target_taps if drafter else ()) if memo else target, drafter, [EOS])


# --- the constraint itself ---------------------------------------------------------------------------------

def test_bad_schema_or_grammar_is_a_request_error_naming_the_field_and_the_problem(tok):
    _, gt = tok
    cases = [(lambda: Grammar.from_json_schema("{oops", gt), "json_schema", "not valid JSON"),
             (lambda: Grammar.from_json_schema({"type": "frobnicate"}, gt), "json_schema", "frobnicate"),
             (lambda: Grammar.from_json_schema([1, 2], gt, field="schema"), "schema", "JSON Schema object"),
             (lambda: Grammar.from_lark("start: undefined_rule", gt), "grammar", "undefined_rule"),
             (lambda: Grammar.from_lark("   ", gt), "grammar", "empty")]
    for make, field, words in cases:
        with pytest.raises(RequestError) as err:
            make()
        assert err.value.field == field and words in str(err.value), str(err.value)


def test_each_verify_row_is_masked_by_the_grammar_state_of_its_own_path(tok):
    hf, gt = tok
    ids = {t: hf.token_to_id(t) for t in ("a", "b", "c", "i", "k", "ck", "q")}
    state = Grammar.from_lark(GRAMMAR, gt).start()
    state.commit([ids["a"]])
    # root 'a' ── 'i' ── 'c' ;  root ── 'k' ;  root ── 'q' (impossible) ── 'b'
    tree = DraftTree(tokens=np.array([ids["i"], ids["k"], ids["q"], ids["c"], ids["b"]]),
                     parents=np.array([-1, -1, -1, 0, 2]))
    masks = state.row_masks(tree)
    letters = lambda m: sorted(hf.id_to_token(int(i)) for i in np.flatnonzero(m))
    assert letters(masks[0]) == list("ijklmnop")  # after 'a'
    assert "ck" in letters(masks[1]) and "i" not in letters(masks[1])  # after 'ai': a new pair starts
    assert masks[1].sum() == masks[2].sum() and masks[1].sum() > 8
    assert masks[3].all() and masks[5].all()  # below an impossible token: rows never used, left unmasked
    assert letters(masks[4]) == list("ijklmnop")  # after 'aic'
    for i in range(len(tree)):  # the probes rolled back: the same masks from a fresh state
        fresh = Grammar.from_lark(GRAMMAR, gt).start()
        fresh.commit([ids["a"]])
        assert (fresh.allowed([int(tree.tokens[a]) for a in tree.path(i)]) == masks[i + 1]).all()
    state.commit([ids["k"], ids["c"]])  # "akc"
    assert letters(state.allowed(())) == list("ijklmnop") and state.seconds > 0


def test_action_answer_as_a_grammar_allows_exactly_n_bin_tokens_then_eos(tok):
    _, gt = tok
    state = Grammar.token_run(range(10, 20), 3, gt).start()
    for step in range(3):
        assert np.flatnonzero(state.allowed(())).tolist() == list(range(10, 20))
        state.commit([10 + step])
    assert np.flatnonzero(state.allowed(())).tolist() == [EOS] and state.is_complete()


# --- greedy identity -----------------------------------------------------------------------------------------

DRAFTERS = [("draft_model", 1), ("draft_model", 2), ("ngram", 1), ("ngram", 2), ("mtp", 1),
            ("draft_model/ignores", 2)]


@pytest.mark.parametrize("kind,branching", DRAFTERS, ids=[f"{k}-b{b}" for k, b in DRAFTERS])
def test_constrained_greedy_speculative_decoding_equals_constrained_plain_decoding(tok, weights, kind, branching):
    hf, gt = tok
    grammar = Grammar.from_lark(GRAMMAR, gt)
    rng = np.random.default_rng(5)
    cycles = tokens = 0
    for i in range(5):
        prompt = [1] + [int(t) for t in rng.integers(3, 90, 7)]
        plain = engine(weights, "none").generate(prompt, SamplingParams(), 20, grammar=grammar)
        free = engine(weights, "none").generate(prompt, SamplingParams(), 20)
        spec = engine(weights, kind, branching, noise=0.1).generate(prompt, SamplingParams(), 20, grammar=grammar)
        assert spec.tokens == plain.tokens
        text = hf.decode(plain.tokens)
        assert (COMPLETE if plain.finish_reason == "eos" else PREFIX).fullmatch(text), (text, plain.finish_reason)
        assert not PREFIX.fullmatch(hf.decode(free.tokens))  # the grammar did change the answer
        cycles += spec.stats.cycles
        tokens += len(spec.tokens)
        assert spec.stats.grammar_s > 0
    if kind.startswith("draft_model"):  # (n-gram matches and an untrained MTP module's guesses are rare here)
        assert tokens > 1.3 * cycles  # drafts were accepted: speculation really ran under the grammar


# --- the sampled law -------------------------------------------------------------------------------------

class RootMaskEverywhere(GrammarState):
    """WRONG (power control): every verify row masked by the root's state, as if the matcher were not
    advanced along each node's path. Commits leniently, so that the wrong tokens reach the counts."""

    def row_masks(self, tree):
        return np.repeat(self.allowed(())[None, :], len(tree) + 1, axis=0)

    def commit(self, tokens):
        try:
            super().commit(tokens)
        except RuntimeError:
            self._cache.clear()


class MaskOnQOnly(RootMaskEverywhere):
    """WRONG (power control): the drafter's q is masked, the target's p is not."""

    def row_masks(self, tree):
        return np.ones((len(tree) + 1, self.vocab), dtype=bool)


def first_two_counts(eng: Engine, grammar, prompt, root: int, draws: int, seed: int):
    first, pairs = np.zeros(V), np.zeros(V * V)
    emitted = cycles = 0
    for i in range(draws):
        got = []
        stop = StopCheck(should_stop=lambda: "stop" if len(got) >= 3 else None)
        out = eng.generate(prompt, SAMPLED, 16, seed + i, on_tokens=got.extend, stop=stop, first_token=root,
                           grammar=grammar)
        t1, t2 = (out.tokens + [EOS, EOS])[1:3]  # (EOS ends the output; only a wrong rule lets it out here)
        first[t1] += 1
        pairs[t1 * V + t2] += 1
        emitted += len(out.tokens) - 1
        cycles += out.stats.cycles
    return first, pairs, emitted / cycles


@pytest.fixture(scope="module")
def context(tok, weights):
    """A prompt and a root 'a' after which the grammar allows 8 tokens; the exact constrained laws."""
    hf, gt = tok
    grammar = Grammar.from_lark(GRAMMAR, gt)
    eng = engine(weights, "draft_model", 2, memo=True)
    prompt = [1, 40, 7, 63, 12, 33, 5]
    root = hf.token_to_id("a")
    state = grammar.start()
    state.commit([root])
    p1_free = eng.target.distribution(prompt + [root], SAMPLED)
    m1 = state.allowed(())
    p1 = p1_free * m1 / (p1_free * m1).sum()
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        p2 = eng.target.distribution(prompt + [root, int(t1)], SAMPLED) * state.allowed((int(t1),))
        joint[t1] = p1[t1] * p2 / p2.sum()
    return grammar, prompt, root, p1_free, m1, p1, joint.ravel()


def test_the_context_is_where_the_grammar_removes_most_of_the_targets_mass(context):
    _, _, _, p1_free, m1, _, _ = context
    assert m1.sum() == 8 and (p1_free * m1).sum() < 0.3


@pytest.mark.parametrize("kind,branching", [("draft_model", 2), ("draft_model/ignores", 2), ("draft_model", 1)],
                         ids=["tree-masked-q", "tree-unmasked-q", "chain-masked-q"])
def test_sampled_constrained_speculation_keeps_the_first_two_tokens_law(context, weights, kind, branching):
    grammar, prompt, root, _, _, p1, joint = context
    eng = engine(weights, kind, branching, memo=True)
    first, pairs, tau = first_two_counts(eng, grammar, prompt, root, DRAWS, seed=11)
    assert chi_square_gof(first, p1).p_value > ALPHA
    assert chi_square_gof(pairs, joint).p_value > ALPHA
    if "ignores" not in kind:  # (unmasked q mostly proposes impossible tokens: exact, but tau ~ 1)
        assert tau > 1.2  # drafts were made under the grammar and partly accepted


@pytest.mark.parametrize("wrong", [RootMaskEverywhere, MaskOnQOnly], ids=["root-mask-at-every-row", "mask-q-only"])
def test_control_a_wrong_masking_rule_is_rejected(context, weights, wrong):
    grammar, prompt, root, _, _, p1, joint = context
    bad = copy.copy(grammar)
    bad.state_type = wrong
    eng = engine(weights, "draft_model", 2, memo=True)
    first, pairs, _ = first_two_counts(eng, bad, prompt, root, DRAWS // 4, seed=12)
    assert min(chi_square_gof(first, p1).p_value, chi_square_gof(pairs, joint).p_value) < ALPHA


# --- action tokens: the trivial grammar ----------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_action_tokens_through_the_grammar_equal_the_fixed_allowed_set_mask(tiny_bundle, temperature):
    from runtime.text.prompts import action_prompt
    from runtime.serving.session import GenerationParams, Session

    session = Session.open(tiny_bundle, drafter="draft_model", max_context=256)
    obs = [0.1] * 8
    params = GenerationParams(temperature=temperature, seed=4)
    res = session.action_tokens("pick up the red cup", obs, num_actions=3, params=params)
    n = 3 * res.dims
    ids = session.tokenizer.encode(action_prompt("pick up the red cup", obs))
    allowed = tuple(int(t) for t in session.actions.allowed_token_ids())
    _, old, finish, _ = session.generate_ids(ids, dataclasses.replace(params, max_tokens=n), allowed_tokens=allowed)
    assert res.token_ids == old and len(old) == n and finish == res.finish_reason == "max_tokens"
    assert res.stats.grammar_s > 0  # it did go through the grammar
    session.close()
