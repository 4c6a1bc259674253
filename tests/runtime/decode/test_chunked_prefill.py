"""Chunked prefill in the engine (`memory.prefill_chunk`): a prompt several chunks long runs as forwards of at most
the chunk, and changes nothing but the scratch: greedy output is token-identical to prefilling it in one forward,
and the drafters reading the prefill's taps (EAGLE-3: three layer taps, MTP: the last layer's) draft the same,
on the numpy reference and on ONNX Runtime. A bad chunk is a one-line ConfigError naming the key."""
import os
from dataclasses import replace

import numpy as np
import pytest

from runtime.config import RuntimeConfig, from_dict
from runtime.errors import ConfigError
from runtime.serving.session import GenerationParams, Session
from tests.support import REPO_ROOT

ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")
needs_zoo = pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")),
                               reason="the zoo bundle is not built (make bundles)")
CHUNK = 16
TEXT = "<|bos|><|text|>the robot picks up the red cup and places it on the table, then it waits by the door. "


def session(backend, drafter, chunk):
    cfg = RuntimeConfig(bundle=ZOO)
    return Session(replace(cfg, backend=replace(cfg.backend, kind=backend), drafter=replace(cfg.drafter, kind=drafter),
                           memory=replace(cfg.memory, max_context=256, prefill_chunk=chunk)))


@needs_zoo
@pytest.mark.parametrize("backend", ["numpy_ref", "onnx"])
@pytest.mark.parametrize("drafter", ["none", "eagle3", "mtp", "draft_model"])
def test_a_prefill_in_chunks_gives_the_tokens_and_drafts_of_one_forward(backend, drafter):
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    runs = {}
    for chunk in (CHUNK, 4096):
        s = session(backend, drafter, chunk)
        ids = s.tokenizer.encode(TEXT * 4)
        assert len(ids) > 4 * CHUNK  # several chunks, the last one short
        _, tokens, _, stats = s.generate_ids(ids, GenerationParams(max_tokens=24))
        runs[chunk] = (tokens, stats.cycles, stats.acceptance_by_depth, stats.target_forwards - stats.cycles)
    (chunked, c_cycles, c_acc, c_prefill), (one, o_cycles, o_acc, o_prefill) = runs[CHUNK], runs[4096]
    assert chunked == one
    assert (c_cycles, c_acc) == (o_cycles, o_acc)  # the drafter saw the same taps
    assert o_prefill == 1 and c_prefill == -(-len(ids) // CHUNK)


def test_a_prefill_chunk_below_one_token_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"runtime.yaml: memory.prefill_chunk: got 0, expected >= 1"):
        from_dict(RuntimeConfig, {"memory": {"prefill_chunk": 0}}, "runtime.yaml")
    assert RuntimeConfig().memory.prefill_chunk == 512


def test_the_engine_never_runs_a_prefill_forward_longer_than_the_chunk():
    from runtime.backends.numpy_ref import NumpyTarget, cache_shape
    from runtime.decode.engine import Engine
    from runtime.memory.kv import KVArena
    from runtime.sampling import SamplingParams
    from tests.support.hf_tiny import tiny_hf_model

    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=2)
    shape = cache_shape(spec)
    target = NumpyTarget(spec, weights, KVArena.for_context({"t": shape}, 128).allocate("t", shape, 128))
    sizes = []
    real = target.forward
    target.forward = lambda tokens, *rest: sizes.append(len(tokens)) or real(tokens, *rest)
    prompt = list(np.random.default_rng(0).integers(0, spec.vocab_size, 70))
    out = Engine(target, None, prefill_chunk=CHUNK).generate(prompt, SamplingParams(), 5)
    assert sizes[:5] == [16, 16, 16, 16, 6] and max(sizes) == CHUNK
    assert out.stats.target_forwards == 5 + out.stats.cycles


def test_a_draft_models_catch_up_on_a_new_prompt_runs_in_the_engines_chunks():
    """The drafter's own forward over the prompt is bounded like the target's (Drafter.prefill_chunk, set by the
    engine), and the output is still plain decoding's."""
    from runtime.backends.numpy_ref import NumpyTarget, cache_shape
    from runtime.decode.engine import Engine
    from runtime.drafters.draft_model import DraftModelDrafter
    from runtime.memory.kv import KVArena
    from runtime.sampling import SamplingParams
    from tests.support.hf_tiny import tiny_hf_model

    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=2)
    shape = cache_shape(spec)
    arena = KVArena.for_context({"t": shape, "d": shape}, 128)
    target = NumpyTarget(spec, weights, arena.allocate("t", shape, 128))
    draft = NumpyTarget(spec, weights, arena.allocate("d", shape, 128))
    sizes = []
    real = draft.forward
    draft.forward = lambda tokens, *rest: sizes.append(len(tokens)) or real(tokens, *rest)
    prompt = list(np.random.default_rng(0).integers(0, spec.vocab_size, 70))
    plain = Engine(target, None, prefill_chunk=CHUNK).generate(prompt, SamplingParams(), 12).tokens
    out = Engine(target, DraftModelDrafter(draft, num_tokens=3), prefill_chunk=CHUNK).generate(prompt, SamplingParams(), 12)
    # the prompt and the first token (71 rows) in chunks of 16, then the cycles: the root and a drafted token or two
    assert out.tokens == plain and sizes[:5] == [16, 16, 16, 16, 7] and max(sizes) <= CHUNK
