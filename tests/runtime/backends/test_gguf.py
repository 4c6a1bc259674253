"""GGUF export and the llama.cpp backend: the zoo target written as GGUF loads in llama.cpp and matches the
numpy reference; trees verify through sequence ids exactly as the mask says; greedy speculative decoding
on llama.cpp (f16 and q8_0 weights) is token-identical to plain decoding on the same weights; sampled
speculative decoding passes a short certify; export mistakes are one-line errors."""
from tests.support import REPO_ROOT
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from runtime.backends.llamacpp import LlamaCppTarget, _TreeRows, assign_sequences
from runtime.errors import BackendError

ROOT = REPO_ROOT
ZOO = os.path.join(ROOT, "build", "bundles", "zoo")
needs_llama = pytest.mark.skipif(not LlamaCppTarget.available(),
                                 reason="llama-cpp-python is not installed (scripts/bootstrap.sh llama_cpp builds it)")
needs_zoo = pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")),
                               reason="the zoo bundle is not built (make bundles)")
pytest.importorskip("gguf", reason="the `gguf` package (export extra) is not installed")

PROMPTS = ["<|bos|><|plan|>give the red box from the workshop to Carol in the bedroom<|sep|>",
           "<|bos|><|text|>To be, or not to be, that is the question:",
           "<|bos|><|act|>pick up the cup<|obs|>0.1 0.2 0.3 0.0 0.0 0.0 1.0 0.5<|sep|>"]


def _linked_copy(src: str, dst: str) -> str:
    """A bundle copy that shares the (never rewritten) data files; bundle.yaml is replaced atomically."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


@pytest.fixture(scope="module")
def gguf_bundles(tmp_path_factory):
    """The zoo bundle with GGUF entries: f16 and q8_0 (one bundle each, so each test runs one quant alone)."""
    from export.gguf.writer import add_gguf_to_bundle

    out = {}
    for quant in ("f16", "q8_0") if LlamaCppTarget.available() else ("f16",):  # q8_0 is llama.cpp's quantiser
        root = _linked_copy(ZOO, str(tmp_path_factory.mktemp("gguf") / f"zoo-{quant}"))
        add_gguf_to_bundle(root, quant, validate=False)
        out[quant] = root
    return out


# -- sequence ids for trees (pure: no llama.cpp needed) -----------------------------------------------

def test_a_tree_mask_maps_to_one_sequence_per_leaf_and_reproduces_the_mask():
    """The module docstring's example: root r, children a, b, a's child c; committed rows 0..4."""
    c = 5
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)  # r, a, b, c
    mask = np.concatenate([np.ones((4, c), bool), tree], axis=1)
    query, seqs, fresh = assign_sequences(np.array([5, 6, 6, 7]), mask, c, _TreeRows())
    assert seqs[0] == {0, 1} and seqs[2] == {0} and seqs[1] == seqs[3] == {1}  # leaves b, c: sequences 0, 1
    assert query == [0, 1, 0, 1] and fresh == [1]


def test_a_mask_sequences_cannot_express_is_refused_not_approximated():
    """Token 1 sees token 0 but not itself: no sequence assignment gives that, so no forward runs."""
    mask = np.array([[True, True, False], [True, True, False]])  # 1 committed row, 2 new tokens
    with pytest.raises(BackendError, match="own row is hidden|cannot be written"):
        assign_sequences(np.array([1, 2]), mask, 1, _TreeRows())
    hidden_prefix = np.array([[False, True]])
    with pytest.raises(BackendError, match="committed rows"):
        assign_sequences(np.array([1]), hidden_prefix, 1, _TreeRows())


# -- export errors ----------------------------------------------------------------------------------

def _edgespec(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, env=env)


@needs_zoo
def test_export_refuses_a_bad_quant_name_and_an_existing_output_without_force(tmp_path):
    root = _linked_copy(ZOO, str(tmp_path / "zoo"))
    bad = _edgespec("export", "--to", "gguf", "--bundle", root, "--quant", "q3_weird")
    assert bad.returncode == 2 and "--quant: got 'q3_weird'" in bad.stderr and "Traceback" not in bad.stderr
    os.makedirs(os.path.join(root, "gguf"))
    user_file = os.path.join(root, "gguf", "target.f16.gguf")
    with open(user_file, "w") as f:
        f.write("not ours")
    taken = _edgespec("export", "--to", "gguf", "--bundle", root, "--no-validate")
    assert taken.returncode == 2 and "already exists; pass --force" in taken.stderr
    assert open(user_file).read() == "not ours"
    assert not [n for n in os.listdir(os.path.join(root, "gguf")) if n.endswith(".tmp")]
    wrong = _edgespec("export", "--to", "onnx", "--bundle", root, "--quant", "q8_0")
    assert wrong.returncode == 2 and "GGUF only" in wrong.stderr


@needs_zoo
def test_exported_gguf_is_registered_in_the_bundle_with_its_quant(gguf_bundles):
    from runtime.model import bundle
    for quant, root in gguf_bundles.items():
        b = bundle.load(root)
        key = bundle.gguf_entry_key(quant)  # "gguf" (f16) or "gguf.q8_0": quants sit side by side
        assert b.target.backends[key].files == (f"gguf/target.{quant}.gguf",)
        assert b.target.backends[key].params["quant"] == quant
        assert b.drafters["draft_model"].backends[key].files == (f"gguf/drafter.draft_model.{quant}.gguf",)


# -- llama.cpp ---------------------------------------------------------------------------------------

@needs_zoo
@needs_llama
def test_gguf_f16_zoo_target_matches_the_numpy_reference(gguf_bundles):
    """Prefill, one decode step and a 4-node tree (export.onnx.graph.reference_cases): the zoo's weights are
    fp16 already, so only llama.cpp's f16 K/V and accumulation order differ from the float32 oracle."""
    from export.gguf.writer import validate_gguf
    from runtime.model import bundle
    from runtime.backends.factory import load_weights

    b = bundle.load(gguf_bundles["f16"])
    weights = load_weights(b, b.target_files("numpy_ref").files)
    err = validate_gguf(b.target.spec, weights, b.path("gguf/target.f16.gguf"), "f16", verbose=False)
    assert err is not None and err < 1e-2, err


@needs_zoo
@needs_llama
def test_final_norm_tap_and_tree_rows_equal_their_paths_run_alone(gguf_bundles):
    """A 5-node tree in one forward gives, row for row, the logits and final-normed hidden state of
    running each node's path as a plain chain; keeping one branch then decoding on equals decoding that
    branch from scratch (the rollback leaves exactly the accepted rows)."""
    from runtime.model import bundle
    from runtime.backends.numpy_ref import cache_shape
    from runtime.memory.kv import KVArena

    b = bundle.load(gguf_bundles["f16"])
    spec = b.target.spec
    shape = cache_shape(spec)

    def model():
        cache = KVArena.for_context({"t": shape}, 64, np.float16).allocate("t", shape, 64)
        return LlamaCppTarget(spec, b.path("gguf/target.f16.gguf"), cache, tap_names=("final_norm",))

    prefix = np.array([1, 6, 300, 301, 302, 17, 900])
    p = len(prefix)
    parents = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each
    tokens = np.array([40, 41, 42, 43, 44])
    depth = [0, 1, 1, 2, 2]
    tree = np.zeros((5, 5), bool)
    for i, par in enumerate(parents):
        tree[i] = tree[par] if par >= 0 else False
        tree[i, i] = True
    lc = model()
    lc.forward(prefix, np.arange(p))
    res = lc.forward(tokens, p + np.array(depth), np.concatenate([np.ones((5, p), bool), tree], 1), ("final_norm",))
    for i in range(5):
        path = [j for j in range(5) if tree[i, j]]
        solo = model()
        ref = solo.forward(np.concatenate([prefix, tokens[path]]), np.arange(p + len(path)), None, ("final_norm",))
        np.testing.assert_allclose(res.logits[i], ref.logits[-1], rtol=0, atol=1e-4)
        np.testing.assert_allclose(res.taps["final_norm"][i], ref.taps["final_norm"][-1], rtol=0, atol=1e-4)
        solo.close()
    lc.keep(p, [p, p + 2, p + 4])  # root, second child, its child
    nxt = lc.forward(np.array([45]), np.array([p + 3])).logits[-1]
    alone = model()
    want = alone.forward(np.concatenate([prefix, tokens[[0, 2, 4]], [45]]), np.arange(p + 4)).logits[-1]
    other = model()
    wrong = other.forward(np.concatenate([prefix, tokens[[0, 1, 3]], [45]]), np.arange(p + 4)).logits[-1]
    # The kept K/V rows were computed in a 5-token batch, the reference's in one prefill: f16 K/V rounding
    # differs by ~1e-4 relative; keeping the other branch (the control) moves the logits by far more.
    assert np.max(np.abs(nxt - want)) < 2e-3 < 0.05 < np.max(np.abs(wrong - want))
    assert lc.cache_len == p + 4


@needs_zoo
@needs_llama
def test_llamacpp_prefill_in_chunks_gives_one_forwards_logits_and_final_norm(gguf_bundles):
    """A 100-token prompt in chunks of 16 (runtime/backends/base.forward_in_chunks) against one forward (llama.cpp
    batches it itself, 512 at a time): the same logits and final_norm rows within f16 K/V rounding, and a
    different prompt (the control) is far from them."""
    from runtime.backends.base import forward_in_chunks
    from runtime.backends.numpy_ref import cache_shape
    from runtime.memory.kv import KVArena
    from runtime.model import bundle

    b = bundle.load(gguf_bundles["f16"])
    spec = b.target.spec
    shape = cache_shape(spec)

    def model():
        cache = KVArena.for_context({"t": shape}, 128, np.float16).allocate("t", shape, 128)
        return LlamaCppTarget(spec, b.path("gguf/target.f16.gguf"), cache, tap_names=("final_norm",), threads=1)

    prompt = np.random.default_rng(0).integers(3, spec.vocab_size, 100)
    one, chunked = model(), model()
    ref = one.forward(prompt, np.arange(100), None, ("final_norm",))
    got = forward_in_chunks(chunked, prompt, np.arange(100), ("final_norm",), 16)
    assert got.logits.shape == ref.logits.shape and chunked.cache_len == 100
    scale = np.abs(ref.logits).max()
    np.testing.assert_allclose(got.logits, ref.logits, rtol=0, atol=2e-3 * scale)
    np.testing.assert_allclose(got.taps["final_norm"], ref.taps["final_norm"], rtol=0, atol=2e-3 * scale)
    other = np.roll(prompt, 1)
    one.reset()
    assert np.abs(one.forward(other, np.arange(100)).logits - ref.logits).max() > 0.05 * scale
    one.close()
    chunked.close()


@needs_zoo
@needs_llama
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_greedy_speculative_decoding_on_llamacpp_equals_plain_decoding(gguf_bundles, quant):
    """The quantised GGUF is the target: draft model (chain and a branching-2 tree, the draft also on
    llama.cpp) and n-gram drafts leave greedy output token-identical to plain decoding of that GGUF. f16:
    identical on every prompt. q8_0: llama.cpp's multi-token and one-token q8_0 kernels round differently,
    so an output may leave plain decoding only at a near-tie of plain decoding's own logits (checked)."""
    from runtime.config import RuntimeConfig
    from runtime.serving.session import GenerationParams, Session

    def session(drafter, branching=1):
        cfg = RuntimeConfig(bundle=gguf_bundles[quant])
        # One llama.cpp thread: on a shared 2-core test machine two spinning threads are ~10x slower.
        return Session(replace(cfg, backend=replace(cfg.backend, kind="gguf", threads=1),
                               drafter=replace(cfg.drafter, kind=drafter, branching=branching),
                               memory=replace(cfg.memory, max_context=256)))

    plain = session("none")
    assert plain.target.name == "gguf"
    want = [plain.generate(p, GenerationParams(max_tokens=48)).token_ids for p in PROMPTS]
    plain_ref, near_ties = plain.target, []
    for drafter, branching in (("draft_model", 1), ("draft_model", 2), ("ngram", 1)):
        spec = session(drafter, branching)
        if drafter == "draft_model":
            assert spec.drafter.model.name == "gguf"
        for prompt, ids in zip(PROMPTS, want):
            out = spec.generate(prompt, GenerationParams(max_tokens=48))
            if quant == "f16" or out.token_ids == ids:
                assert out.token_ids == ids, (drafter, branching, prompt)
            else:  # q8_0: a multi-token verify and a one-token step may round a near-tie differently
                _assert_divergence_is_a_near_tie(plain_ref, spec.tokenizer.encode(prompt), ids, out.token_ids)
                near_ties.append((drafter, branching, prompt))
            assert out.stats.cycles < len(ids)  # drafts were accepted: the check is not vacuous
        spec.close()
    # Measured here: 2 of the 9 q8_0 runs, at gaps of 5e-4 and 3.2e-3 (logits of magnitude ~2); f16: none.
    assert len(near_ties) <= 3, near_ties


def _assert_divergence_is_a_near_tie(target, prompt, want, got, gap=1e-2):
    """The first token where speculative output `got` leaves plain output `want` is one where plain decoding's
    own one-token logits had the two tokens as its top two within `gap` (a rounding tie, not a wrong rule)."""
    k = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    target.reset()
    ctx = list(prompt) + list(want[:k])
    target.forward(np.asarray(ctx[:-1]), np.arange(len(ctx) - 1))
    row = target.forward(np.asarray(ctx[-1:]), np.array([len(ctx) - 1])).logits[0]
    top2 = set(np.argsort(row)[::-1][:2].tolist())
    assert {want[k], got[k]} == top2 and abs(row[want[k]] - row[got[k]]) < gap, (k, want[k], got[k])


@needs_zoo
@needs_llama
def test_a_drafter_reading_a_layer_tap_is_refused_when_the_session_opens(gguf_bundles):
    from runtime.serving.session import Session

    with pytest.raises(BackendError, match="tap 'layer_out.7' is not available"):
        Session.open(gguf_bundles["f16"], drafter="mtp", backend="gguf", max_context=64)


@needs_zoo
@needs_llama
def test_sampled_speculative_decoding_on_llamacpp_q8_0_passes_certify(gguf_bundles):
    """alpha = 0.001, 400 draws, fixed seed, draft model chain on the q8_0 GGUF; the power control (a
    wrong rule that always accepts the draft) must be rejected on the same context and backend."""
    from runtime.certify.run import certify
    from runtime.sampling import SamplingParams
    from runtime.serving.session import Session
    from tests.runtime.certify.test_certify import always_accept

    from runtime.config import RuntimeConfig

    context = ["<|bos|><|text|>Now is the winter of"]  # free text: high entropy, where a wrong rule shows
    cfg = RuntimeConfig(bundle=gguf_bundles["q8_0"])
    cfg = replace(cfg, backend=replace(cfg.backend, kind="gguf", threads=1),
                  drafter=replace(cfg.drafter, kind="draft_model"), memory=replace(cfg.memory, max_context=128))
    session = Session(cfg)  # one session: the control reuses the memoised target rows (certify.memoise_session)
    (res,) = certify(session, context, SamplingParams(temperature=1.0), draws=400, alpha=1e-3, seed=9)
    assert res.passed, res
    (bad,) = certify(session, context, SamplingParams(temperature=1.0), draws=400, alpha=1e-3, seed=9,
                     verifier=always_accept)
    assert not bad.passed and bad.first_p_value < 1e-3, bad


# -- the fast path: only the logits rows asked for leave llama.cpp; batches, threadpool ---------------------

def _target(bundle_dir, positions=128, threads=1, taps=()):
    from runtime.backends.numpy_ref import cache_shape
    from runtime.memory.kv import KVArena
    from runtime.model import bundle

    b = bundle.load(bundle_dir)
    shape = cache_shape(b.target.spec)
    cache = KVArena.for_context({"t": shape}, positions, np.float16).allocate("t", shape, positions)
    return LlamaCppTarget(b.target.spec, b.path("gguf/target.f16.gguf"), cache, tap_names=taps, threads=threads)


@needs_zoo
@needs_llama
def test_a_prefill_asking_for_the_last_logits_fetches_one_row_per_chunk_equal_to_the_full_forwards_last(gguf_bundles):
    """forward_in_chunks(all_logits=False), as the engine's prefill calls it: 100 tokens in chunks of 16 copy 7
    rows out of llama.cpp (one per chunk), not 100, and the row kept is the full forward's last row."""
    from runtime.backends.base import forward_in_chunks

    prompt = np.random.default_rng(1).integers(3, 3000, 100)
    full, last = _target(gguf_bundles["f16"]), _target(gguf_bundles["f16"])
    ref = full.forward(prompt, np.arange(100)).logits
    assert full.logit_rows_fetched == 100
    got = forward_in_chunks(last, prompt, np.arange(100), (), 16, all_logits=False).logits
    assert got.shape == (1, ref.shape[1]) and last.logit_rows_fetched == 7
    np.testing.assert_allclose(got[0], ref[-1], rtol=0, atol=2e-3 * np.abs(ref).max())
    one = last.forward(np.array([5]), np.array([100]), None, (), all_logits=False)
    assert one.logits.shape == (1, ref.shape[1]) and last.logit_rows_fetched == 8  # a step: its one row
    full.close()
    last.close()


@needs_zoo
@needs_llama
def test_a_tap_keeps_every_row_of_a_prefill_that_wants_only_its_last_logits(gguf_bundles):
    """llama.cpp outputs a row's hidden state only with its logits: asking for final_norm fetches all rows of
    both (the drafter reads every prefill row), while the logits returned are still the last row's."""
    t = _target(gguf_bundles["f16"], taps=("final_norm",))
    res = t.forward(np.arange(3, 23), np.arange(20), None, ("final_norm",), all_logits=False)
    assert res.logits.shape[0] == 1 and res.taps["final_norm"].shape[0] == 20 and t.logit_rows_fetched == 20
    t.close()


@needs_zoo
@needs_llama
def test_a_chain_after_a_tree_forward_is_back_in_sequence_zero(gguf_bundles):
    """The preallocated batch keeps a tree's sequence ids in its rows; the next chain batch (3 tokens after
    keeping one branch) must put every row back in sequence 0, so its logits equal decoding that branch from
    scratch (a stale sequence id on row 1 or 2 would hide the committed rows from it)."""
    prefix = np.array([1, 6, 300, 301, 302, 17, 900])
    p = len(prefix)
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # root, two children: leaves on sequences 0, 1
    lc = _target(gguf_bundles["f16"])
    lc.forward(prefix, np.arange(p))
    lc.forward(np.array([40, 41, 42]), p + np.array([0, 1, 1]), np.concatenate([np.ones((3, p), bool), tree], 1))
    lc.keep(p, [p, p + 2])  # root and the second child (sequence 1)
    got = lc.forward(np.array([45, 46, 47]), np.arange(p + 2, p + 5)).logits
    alone = _target(gguf_bundles["f16"])
    want = alone.forward(np.concatenate([prefix, [40, 42, 45, 46, 47]]), np.arange(p + 5)).logits[-3:]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
    lc.close()
    alone.close()


@needs_zoo
@needs_llama
def test_a_two_thread_backend_decodes_on_one_attached_threadpool_as_one_thread_does(gguf_bundles):
    """Two threads: a persistent pool is attached (as llama.cpp's tools attach theirs; without it ggml starts
    and joins threads inside every decode) and 12 greedy steps give one thread's tokens."""
    def steps(t):
        tok, out = 7, []
        t.forward(np.arange(3, 13), np.arange(10))
        for i in range(12):
            tok = int(np.argmax(t.forward(np.array([tok]), np.array([10 + i])).logits[-1]))
            out.append(tok)
        t.close()
        return out

    two = _target(gguf_bundles["f16"], threads=2)
    assert two.pool is not None
    assert steps(two) == steps(_target(gguf_bundles["f16"], threads=1))
