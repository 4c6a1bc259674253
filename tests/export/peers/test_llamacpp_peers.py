"""llama.cpp's own tools as bench peers (export/peers/llamacpp.py), without building them: the command lines
(greedy, flash attention off, the bundle's GGUF files, the draft model for draft-simple, one token fewer for
llama-speculative-simple, which overshoots -n by one), the parsing of their printed text and timings, the cache
key of a build, a cached build reused without a compiler, and the rows that say why a peer cannot run.
The outputs parsed below are recorded from the tools built from llama-cpp-python 0.3.36's vendored llama.cpp."""
import json
import os
import stat

import pytest

from export.peers import llamacpp as lp
from export.peers.registry import PeerModels, PeerUnavailable, open_peer

TOOLS = {t: f"/cache/bin/{t}" for t in lp.TOOLS}


def _opt(argv, flag):
    return argv[argv.index(flag) + 1]


def test_plain_decoding_runs_llama_completion_greedy_on_the_target_gguf_for_exactly_max_tokens():
    argv = lp.peer_command("llamacpp", TOOLS, "t.gguf", "hello", 64, threads=2)
    assert argv[0] == TOOLS["llama-completion"] and _opt(argv, "-m") == "t.gguf" and _opt(argv, "-p") == "hello"
    assert _opt(argv, "-n") == "64" and _opt(argv, "--temp") == "0" and _opt(argv, "--top-k") == "1"
    assert _opt(argv, "-fa") == "off" and _opt(argv, "-t") == "2" and "--no-escape" in argv
    assert "--no-display-prompt" in argv and "-no-cnv" in argv and "-md" not in argv
    assert "-sp" in argv  # special tokens printed (llama-speculative-simple prints them by default)


def test_draft_simple_runs_the_bundles_draft_model_gguf_and_asks_for_one_token_fewer():
    argv = lp.peer_command("llamacpp_draft", TOOLS, "t.gguf", "hi", 64, draft_gguf="d.gguf", threads=2)
    assert argv[0] == TOOLS["llama-speculative-simple"] and _opt(argv, "--spec-type") == "draft-simple"
    assert _opt(argv, "-md") == "d.gguf" and _opt(argv, "-n") == "63" and _opt(argv, "-fa") == "off"
    assert _opt(argv, "--spec-draft-n-max") == str(lp.DRAFT_N_MAX) and _opt(argv, "--spec-draft-p-min") == "0"
    with pytest.raises(PeerUnavailable, match="drafter as GGUF"):
        lp.peer_command("llamacpp_draft", TOOLS, "t.gguf", "hi", 64, draft_gguf=None)


def test_ngram_mode_uses_llamas_ngram_simple_with_our_lookup_sizes():
    argv = lp.peer_command("llamacpp_ngram", TOOLS, "t.gguf", "hi", 8)
    assert _opt(argv, "--spec-type") == "ngram-simple" and "-md" not in argv
    assert _opt(argv, "--spec-ngram-simple-size-n") == str(lp.NGRAM_SIZE_N)


def test_eagle3_mode_runs_draft_eagle3_with_the_converted_drafter_gguf():
    argv = lp.peer_command("llamacpp_eagle3", TOOLS, "t.gguf", "hi", 8, draft_gguf="e3.gguf")
    assert _opt(argv, "--spec-type") == "draft-eagle3" and _opt(argv, "-md") == "e3.gguf"


def test_the_eagle3_drafter_is_described_to_llamas_converter_as_its_hf_config_says():
    from runtime.model import bundle
    b = bundle.load("build/bundles/zoo", verify_checksums=False) if os.path.isdir("build/bundles/zoo") else None
    if b is None or "eagle3" not in b.drafters:
        pytest.skip("no zoo bundle with an eagle3 drafter (make bundles)")
    cfg = lp.hf_config(b.drafters["eagle3"].spec, num_hidden_layers=1)
    with open("zoo/eagle3/config.json") as f:
        hf = json.load(f)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "rms_norm_eps", "rope_theta", "num_hidden_layers"):
        assert cfg[k] == hf[k], k


@pytest.mark.parametrize("name", ["llamacpp_mtp", "llamacpp_dflash"])
def test_modes_whose_gguf_layout_we_do_not_write_say_why(name):
    with pytest.raises(PeerUnavailable, match="layout|NextN"):
        lp.peer_command(name, TOOLS, "t.gguf", "hi", 8)
    with pytest.raises(PeerUnavailable):  # through the bench's entry point: a row, never a traceback
        open_peer(name, PeerModels(target=""), "/nonexistent-cache")


def test_a_llamacpp_peer_without_the_bundles_gguf_says_which_export_to_run():
    with pytest.raises(PeerUnavailable, match="export --to gguf"):
        open_peer("llamacpp_draft", PeerModels(target="", gguf_target=None), "/nonexistent-cache")


def test_the_build_cache_is_keyed_on_version_and_flags_and_a_cached_build_is_reused(tmp_path, monkeypatch):
    assert lp.tools_key("0.3.36") != lp.tools_key("0.3.37")
    assert lp.tools_key("0.3.36", lp.cmake_flags()) != lp.tools_key("0.3.36", lp.cmake_flags() + ["-DGGML_NATIVE=ON"])
    assert "-DGGML_NATIVE=OFF" in lp.cmake_flags() and "-DGGML_AMX_INT8=OFF" in lp.cmake_flags()
    bin_dir = tmp_path / "llamacpp-tools" / lp.tools_key() / "bin"
    bin_dir.mkdir(parents=True)
    for t in lp.TOOLS:
        (bin_dir / t).write_text("#!/bin/sh\n")
        (bin_dir / t).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", "")  # no cmake, no compiler: a cached build needs neither
    assert lp.build_tools(str(tmp_path), log=lambda m: pytest.fail(m)) == {t: str(bin_dir / t) for t in lp.TOOLS}


def test_without_a_compiler_the_build_is_a_peer_row_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(PeerUnavailable, match="cmake"):
        lp.build_tools(str(tmp_path), log=lambda m: None)


# Recorded from the tools (zoo target f16 GGUF, planner prompt, 4 tokens), log prefixes as they print them.
SPEC_STDOUT = b'\n\n<|bos|><|plan|>take the hammer<|sep|>[{"skill":"navigate\n\n\n\n'
SPEC_STDERR = """0.00.323.496 I encoded   26 tokens in    0.063 seconds, speed:  412.607 t/s
0.00.323.561 I decoded    4 tokens in    0.022 seconds, speed:  182.100 t/s
0.00.323.570 I
0.00.323.580 I n_draft   = 4
0.00.323.590 I n_predict = 4
0.00.323.600 I n_drafted = 3
0.00.323.610 I n_accept  = 2
0.00.323.620 I accept    = 66.667%
0.00.324.427 I common_perf_print: prompt eval time =      92.28 ms /    28 tokens (    3.30 ms per token,   303.41 tokens per second)
0.00.324.488 I common_perf_print:        eval time =       5.51 ms /     3 runs   (    1.84 ms per token,   544.07 tokens per second)
"""
PLAIN_STDERR = """0.00.222.325 I common_perf_print:    sampling time =       0.08 ms
0.00.222.417 I common_perf_print:        load time =      27.75 ms
0.00.222.524 I common_perf_print: prompt eval time =      27.04 ms /    26 tokens (    1.04 ms per token,   961.54 tokens per second)
0.00.222.567 I common_perf_print:        eval time =       5.07 ms /     3 runs   (    1.69 ms per token,   591.72 tokens per second)
0.00.222.608 I common_perf_print:       total time =      46.77 ms /    29 tokens
"""


def test_speculative_output_gives_the_generation_its_own_timings_and_draft_tallies():
    text, stats = lp.parse_output(SPEC_STDOUT, SPEC_STDERR, b"<|bos|><|plan|>take the hammer<|sep|>", True)
    assert text == b'[{"skill":"navigate'
    assert stats["wall_s"] == pytest.approx(0.063 + 0.022)  # prompt + generation; load and warm-up excluded
    assert (stats["drafted"], stats["accepted"], stats["tokens"], stats["cycles"]) == (3, 2, 4, 2)


def test_plain_output_is_timed_by_prompt_eval_eval_and_sampling_not_load():
    text, stats = lp.parse_output(b'[{"skill":"navigate\n\n', PLAIN_STDERR, b"ignored", False)
    assert text == b'[{"skill":"navigate' and stats["wall_s"] == pytest.approx((27.04 + 5.07 + 0.08) / 1e3)
    text, _ = lp.parse_output(b'[{"skill":"stop"}] [end of text]\n\n\n', PLAIN_STDERR, b"", False)
    assert text == b'[{"skill":"stop"}]'  # its EOS note is not generated text


def test_output_whose_timings_were_lost_is_refused_not_guessed():
    # llama.cpp's logger thread may drop the last lines at exit on a loaded machine; the peer runs it again
    with pytest.raises(ValueError, match="timings"):
        lp.parse_output(SPEC_STDOUT, SPEC_STDERR.splitlines()[-1], b"<|bos|><|plan|>take the hammer<|sep|>", True)
    with pytest.raises(ValueError, match="echo"):
        lp.parse_output(b"\n\nsomething else", SPEC_STDERR, b"<|bos|>", True)
    with pytest.raises(ValueError, match="timings"):
        lp.parse_output(b"x", "load time = 3 ms\n", b"", False)
