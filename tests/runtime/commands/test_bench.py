"""Specification of `edgespec bench` output: paired (interleaved) measurements, the speedup as the median of
per-round ratios with its min-max, a none-vs-none control row, and stand-in bundles labelled as such.
Timings are never asserted (a shared 2-core machine); only the shape and the bookkeeping are."""
import json
import os
import shutil

import numpy as np
import pytest

from runtime.commands.bench import CONTROL, paired_speedup
from tests.runtime.commands.test_cli import run_cli

FAST = ["--domains", "planner", "--max-tokens", "6", "--rounds", "1"]


def test_paired_speedup_is_the_median_of_per_round_ratios_with_min_and_max():
    got = paired_speedup([80.0, 84.0, 30.0], [40.0, 38.0, 20.0])
    assert got["speedup"] == 2.0 and got["speedup_min"] == 1.5 and got["speedup_max"] == pytest.approx(84 / 38)
    assert got["speedup_per_round"] == pytest.approx([2.0, 84 / 38, 1.5])


def test_bench_json_has_every_config_per_temperature_a_control_row_and_the_spread(tiny_bundle, capsys):
    code, out, err = run_cli(["bench", "--bundle", tiny_bundle, "--drafters", "ngram,draft_model",
                              "--temperatures", "0,1", "--json"] + FAST, capsys)
    rows = json.loads(out)
    assert code == 0 and "round 1/1 done" in err
    assert [(r["label"], r["temperature"]) for r in rows] == [
        (label, t) for t in (0.0, 1.0) for label in ("none", "ngram", "draft_model", CONTROL)]
    for r in rows:
        assert r["rounds"] == 1 and len(r["speedup_per_round"]) == 1
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
        assert r["control"] == (r["label"] == CONTROL) and r["standin"] is False and r["bundle"] == "tiny"
        assert r["identical_to_plain"] is (True if r["temperature"] == 0 else None)
    base = [r for r in rows if r["label"] == "none"]
    assert all(r["speedup"] == 1.0 and r["tau"] == 1.0 for r in base)
    control = [r for r in rows if r["control"]]
    assert all(r["drafter"] == "none" and r["tau"] == 1.0 for r in control)


def test_a_standin_bundle_is_labelled_as_a_stand_in(tiny_bundle, tmp_path, capsys):
    copy = str(tmp_path / "tiny-standin")
    shutil.copytree(tiny_bundle, copy)
    manifest = os.path.join(copy, "bundle.yaml")
    text = open(manifest).read()
    open(manifest, "w").write(text.replace("name: tiny\n", "name: tiny-standin\n", 1))
    code, out, _ = run_cli(["bench", "--bundle", copy, "--drafters", "ngram"] + FAST, capsys)
    assert code == 0 and "STAND-IN" in out and "ngram *" in out and "* stand-in rows" in out
    assert f"{CONTROL} *" in out


def test_peers_run_on_the_same_weights_interleaved_and_their_greedy_output_is_checked(tiny_bundle, capsys):
    hf = os.path.dirname(tiny_bundle)  # the tiny bundle's HF folders: target/, draft/
    code, out, err = run_cli(["bench", "--bundle", tiny_bundle, "--drafters", "draft_model", "--json",
                              "--peers", "hf_assisted,ortgenai", "--peer-target", os.path.join(hf, "target"),
                              "--peer-draft", os.path.join(hf, "draft")] + FAST, capsys)
    rows = json.loads(out)
    peers = {r["drafter"]: r for r in rows if r.get("peer")}
    assert code == 0 and set(peers) == {"peer:hf_assisted", "peer:ortgenai"}, err
    for r in peers.values():
        assert "unavailable" not in r and r["identical_to_plain"] is True and r["rounds"] == 1
        assert r["edgespec_best"] in ("none", "draft_model") and r["edgespec_best_over_peer"] > 0


def test_a_peers_generation_is_followed_by_an_untimed_pause_so_its_idle_threads_do_not_slow_the_next_row(monkeypatch):
    """onnxruntime-genai's pools spin after its run; the configuration run next in the rotation (always plain
    decoding, after the last peer) measured 37 % slower than the control row before this pause."""
    from runtime.commands import bench_peers

    events = []

    class Peer:
        name = "fake"

        def generate(self, ids, max_tokens):
            events.append("generate")
            return [5, 6], {}

    monkeypatch.setattr(bench_peers.time, "sleep", lambda s: events.append(("sleep", s)))
    run = bench_peers.run_peer(Peer(), [1, 2], 2)
    assert events == ["generate", ("sleep", bench_peers.PEER_SETTLE_S)] and bench_peers.PEER_SETTLE_S > 0
    assert run.token_ids == [5, 6] and run.stats.wall_s < bench_peers.PEER_SETTLE_S  # the pause is not the peer's time


def test_a_peer_that_cannot_run_gets_a_row_saying_why_and_the_bench_goes_on(tiny_bundle, tmp_path, capsys):
    hf = os.path.dirname(tiny_bundle)
    missing = str(tmp_path / "no-draft-here")
    # both draft-model peers: the draft folder is missing
    code, out, _ = run_cli(["bench", "--bundle", tiny_bundle, "--drafters", "ngram", "--peers",
                            "hf_assisted,ortgenai_draft", "--peer-target", os.path.join(hf, "target"),
                            "--peer-draft", missing] + FAST, capsys)
    lines = [line for line in out.splitlines() if "unavailable:" in line]
    assert code == 0 and len(lines) == 2 and "no-draft-here" in lines[0], out


def test_peers_on_a_bundle_of_unknown_origin_need_the_hf_folder(tiny_bundle, capsys):
    code, _, err = run_cli(["bench", "--bundle", tiny_bundle, "--peers", "hf"] + FAST, capsys)
    assert code == 2 and "--peer-target" in err and "Traceback" not in err
    code, _, err = run_cli(["bench", "--bundle", tiny_bundle, "--peers", "vllm"] + FAST, capsys)
    assert code == 2 and "--peers" in err and "ortgenai" in err


def test_own_prompts_from_a_file_and_plots_with_per_domain_speedup_and_acceptance_by_depth(tiny_bundle, tmp_path,
                                                                                            capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("navigate to the kitchen\n\nopen the drawer\\nand wait\n")
    plots = tmp_path / "plots"
    code, out, err = run_cli(["bench", "--bundle", tiny_bundle, "--drafters", "draft_model", "--prompts", str(prompts),
                              "--plot", str(plots), "--json", "--max-tokens", "6", "--rounds", "1"], capsys)
    rows = json.loads(out)
    assert code == 0, err
    assert all(set(r["by_domain"]) == {"file"} for r in rows)
    draft = next(r for r in rows if r["label"] == "draft_model")
    assert draft["acceptance_by_depth"] and all(0 <= a <= 1 for a in draft["acceptance_by_depth"])
    assert draft["target_gb_per_s"] > 0 and draft["bandwidth_bound_gb_per_s"] > 0
    assert sorted(os.listdir(plots)) == ["cycle_time.png", "speedup.png", "tau_depth.png"]


def test_a_prompts_file_that_cannot_be_used_is_named(tmp_path, tiny_bundle, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, _, err = run_cli(["bench", "--bundle", tiny_bundle, "--prompts", str(empty)], capsys)
    assert code == 2 and "--prompts" in err and "empty.txt" in err
    code, _, err = run_cli(["bench", "--bundle", tiny_bundle, "--prompts", str(tmp_path / "missing.txt")], capsys)
    assert code == 2 and "missing.txt" in err


def test_near_tie_names_where_a_greedy_output_differs_and_the_target_logit_gap_there(tiny_bundle):
    from runtime.commands.bench import float_tie, near_tie
    from runtime.serving.session import GenerationParams, Session
    s = Session.open(tiny_bundle, drafter="none")
    try:
        ids = s.tokenizer.encode("navigate to the kitchen")
        plain = s.generate_ids(ids, GenerationParams(max_tokens=5))[1]
        s.target.reset()
        logits = s.target.forward(np.asarray(ids + plain[:2], np.int64), np.arange(len(ids) + 2), None, ()).logits[-1]
        runner_up = int(np.argsort(logits)[-2])
        got = near_tie(s, ids, plain, plain[:2] + [runner_up])
    finally:
        s.close()
    assert got["position"] == 2 and got["plain_token"] == plain[2] and got["other_token"] == runner_up
    assert got["logit_gap"] == pytest.approx(float(logits[plain[2]] - logits[runner_up]), abs=1e-5) and got["logit_gap"] >= 0
    # whether that gap is a rounding or a wrong token is judged on the two logits themselves
    assert got["float_tie"] is float_tie(got["logit_gap"], float(logits[plain[2]]), float(logits[runner_up]))


def test_a_gap_of_a_rounding_is_a_float_tie_and_a_wider_one_is_not():
    """fp32: the zoo's near-tie at prompt 4 token 44 is 1 ulp of 8.19 (9.5e-7); f16 weights: 2.5e-4 at ~10. A wrong
    token chosen by a broken verifier would sit a visible gap below the argmax."""
    from runtime.commands.bench import float_tie
    assert float_tie(9.5367e-07, 8.193508, 8.193507) and float_tie(0.0, 8.19, 8.19) and float_tie(2.5e-4, 10.2, 10.2)
    assert not float_tie(0.07, 8.19, 8.12) and not float_tie(0.01, 3.0, 2.99)


def _sealed_copy(tiny_bundle, tmp_path, edit):
    """A copy of the tiny bundle changed by `edit(root, writer)`, its manifest re-sealed."""
    from runtime.model.bundle import BundleWriter
    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    w = BundleWriter.extend(root)
    edit(root, w)
    w.write()
    return root


def test_a_drafter_that_cannot_run_here_becomes_a_row_saying_why_and_the_others_run(tiny_bundle, tmp_path, capsys):
    # a DFlash-2 entry without its draft layers' spec: the session for it is refused (a BundleError), as a
    # drafter without a graph for the backend, or reading a tap the backend lacks, would be
    root = _sealed_copy(tiny_bundle, tmp_path, lambda r, w: w.add_drafter("dflash2", "dflash2", params={}))
    code, out, err = run_cli(["bench", "--bundle", root, "--drafters", "none,ngram,dflash2", "--json"] + FAST, capsys)
    rows = json.loads(out)
    assert code == 0 and [r["label"] for r in rows] == ["none", "ngram", CONTROL, "dflash2"], err
    assert "drafters.dflash2" in rows[-1]["skipped"] and "tokens_per_s" not in rows[-1]  # the refusal, by name
    assert all(r["tokens_per_s"] > 0 for r in rows[:3])
    code, out, err = run_cli(["bench", "--bundle", root, "--drafters", "ngram,dflash2"] + FAST, capsys)
    assert code == 0 and any(l.startswith("dflash2") and "skipped: " in l for l in out.splitlines()), out


def _without_action_tokens(root, writer):
    path = os.path.join(root, "tokenizer.json")
    text = open(path).read()
    open(path, "w").write(text.replace("<|a", "<|z"))  # same ids, no action-bin token by name


def test_the_action_domain_is_skipped_naming_why_on_a_model_without_action_tokens(tiny_bundle, tmp_path, capsys):
    root = _sealed_copy(tiny_bundle, tmp_path, _without_action_tokens)
    code, out, err = run_cli(["bench", "--bundle", root, "--drafters", "none", "--max-tokens", "4", "--rounds", "1"],
                             capsys)
    assert code == 0 and "bench: skipping the action domain: this model has no action tokens" in err, err
    assert "prompts (planner,text)" in out, out
    code, _, err = run_cli(["bench", "--bundle", root, "--domains", "action"] + FAST[2:], capsys)
    assert code == 2 and "--domains: action: this model has no action tokens" in err, err


def test_the_default_drafters_are_those_of_none_ngram_draft_model_the_bundle_has(tiny_bundle, tmp_path, capsys):
    def drop_draft_model(root, w):
        del w.manifest["drafters"]["draft_model"]
        w.manifest["default_drafter"] = "none"

    root = _sealed_copy(tiny_bundle, tmp_path, drop_draft_model)
    code, out, err = run_cli(["bench", "--bundle", root, "--json"] + FAST, capsys)
    assert code == 0 and [r["label"] for r in json.loads(out)] == ["none", "ngram", CONTROL], err


def test_the_bench_opens_the_control_first_and_plain_decoding_last_and_reports_rows_as_asked(monkeypatch):
    """Where a session's memory lands shows in its speed (a plain session opened after 16 others ran ~5 % faster
    than one opened before them), so plain decoding, every row's baseline, is opened last: no drafter gains from
    the order, and the control, opened first, shows the effect's size. The table keeps the order asked."""
    import runtime.commands.bench as bench

    opened = []

    class FakeSession:
        def __init__(self, cfg):
            opened.append(self)
            self.kind = cfg.drafter.kind

        def generate(self, *a, **k):
            return None

        def warm_up(self, prompt=None):
            return None

    monkeypatch.setattr(bench, "Session", FakeSession)
    from runtime.config import RuntimeConfig

    configs = {"none": "none", "ngram": "ngram", "draft_model@k4": "draft_model", bench.CONTROL: "none"}
    sessions, skipped = bench.open_sessions(RuntimeConfig(), configs, "hi")
    assert [s.kind for s in opened] == ["none", "ngram", "draft_model", "none"]
    assert sessions[CONTROL] is opened[0] and sessions["none"] is opened[-1]  # the control first, plain last
    assert list(sessions) == list(configs) and not skipped


def test_the_bench_fails_on_a_greedy_divergence_only_where_it_is_not_a_float_near_tie():
    from runtime.commands.bench import exit_status
    tie = {"identical_to_plain": False, "near_tie": {"float_tie": True, "logit_gap": 0.0}}
    wrong = {"identical_to_plain": False, "near_tie": {"float_tie": False, "logit_gap": 0.07}}
    assert exit_status([{"identical_to_plain": True}, tie]) == 0
    assert exit_status([{"identical_to_plain": True}, tie, wrong]) == 1
    assert exit_status([{"identical_to_plain": False}]) == 1  # a divergence nobody judged fails
    assert exit_status([{"identical_to_plain": None, "skipped": "no graph"}]) == 0
