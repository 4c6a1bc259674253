"""`edgespec zoo build --quick`: the whole pipeline at toy scale, end to end, in a few minutes on a CPU."""
import json
import os

import pytest
import yaml

from runtime.cli import main


@pytest.mark.slow
def test_quick_build_writes_loadable_hf_dirs_a_manifest_and_a_report(tmp_path):
    out = tmp_path / "zoo"
    assert main(["zoo", "build", "--quick", "--out", str(out)]) == 0
    for sub in ("target", "draft"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (out / sub / f).exists()
    cfg = json.load(open(out / "target" / "config.json"))
    assert cfg["model_type"] == "llama" and cfg["num_nextn_predict_layers"] == 1
    m = yaml.safe_load(open(out / "MANIFEST.yaml"))
    assert m["seed"] == 1234 and m["command"] == "edgespec zoo build --quick"
    assert set(m["heldout"]) == {"planner", "action", "text"}
    assert {"loss", "mtp_loss", "mtp_agree", "draft_loss", "draft_agree"} <= set(m["heldout"]["planner"])
    from export.zoo.train import QUICK
    plans, actions = m["quality"]["planner"], m["quality"]["action"]
    assert plans["n"] == actions["n"] == QUICK.report_examples  # measured on as many held-out answers as asked
    # each share is a stricter count of the same answers: an exact plan names the right objects, which needs valid JSON
    assert plans["exact_plan"] <= plans["valid_and_objects_match"] <= plans["valid_json"]
    assert actions["in_range"] <= actions["first_chunk_in_range"]  # a lone in-range chunk has an in-range first chunk
    assert m["total_bytes"] < 25 * 2**20
    # resuming a finished build redoes no training
    assert main(["zoo", "build", "--quick", "--out", str(out), "--resume", "--no-report"]) == 0
    m2 = yaml.safe_load(open(out / "MANIFEST.yaml"))
    assert m2["steps_run"] == m["steps_run"]


def test_quick_build_refuses_to_overwrite_the_shipped_zoo():
    from export.zoo.train import DEFAULT_OUT

    assert main(["zoo", "build", "--quick", "--out", DEFAULT_OUT]) == 2


def test_zoo_cli_offers_build_and_report(capsys):
    for argv in (["zoo", "--help"], ["zoo", "build", "--help"], ["zoo", "report", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--resume" in out and "MANIFEST.yaml" in out
