"""`edgespec tune` writes a tune of this machine into the bundle, a Session drafts adaptively from it by default
(and says so), a tune of another machine is reported and not used, and `bench` can sweep fixed shapes against
the adaptive rule in one run."""
import json
import os
import shutil

import pytest
import yaml

from runtime.cli import main
from runtime.commands.bench import with_shape
from runtime.config import RuntimeConfig
from runtime.serving.session import GenerationParams, Session
from runtime.serving.tuning import TUNE_FILE, machine_fingerprint, read_tunes, write_tune


@pytest.fixture(scope="module")
def tuned(tiny_bundle, tmp_path_factory):
    b = str(tmp_path_factory.mktemp("tuned") / "bundle")
    shutil.copytree(tiny_bundle, b)
    assert main(["tune", "--bundle", b, "--backend", "numpy_ref", "--drafters", "draft_model,ngram", "--rounds", "1",
                 "--max-tokens", "8", "--k-max", "3", "--max-context", "256"]) == 0
    return b


def test_tune_writes_this_machines_costs_and_a_depth_per_drafter_and_template(tuned):
    (entry,) = read_tunes(tuned)
    assert entry["backend"] == "numpy_ref" and entry["machine"]["id"] == machine_fingerprint()["id"]
    rows = [n for n, _ in entry["verify"]]
    assert rows[0] == 1 and rows == sorted(rows) and all(s > 0 for _, s in entry["verify"])
    assert set(entry["drafters"]) == {"draft_model", "ngram"}
    for d in entry["drafters"].values():
        assert d["templates"] and all(0 <= t["k"] <= 3 and t["speedup"] >= 1.0 for t in d["templates"].values())


def test_a_session_drafts_from_the_tune_by_default_and_fixed_when_asked(tuned):
    s = Session.open(tuned, drafter="draft_model", max_context=256)
    out = s.generate("hello there", GenerationParams(max_tokens=6))
    assert s.shape.label == "adaptive (tuned)" and out.stats.shape == "adaptive (tuned)"
    s.close()
    cfg = RuntimeConfig(bundle=tuned)
    fixed = Session(with_shape(cfg, "draft_model@fixed", "draft_model"))
    assert fixed.engine.policy is None and fixed.engine.shape == "fixed"
    fixed.close()
    k2 = with_shape(cfg, "draft_model@k2", "draft_model")
    assert k2.drafter.shape == "fixed" and k2.drafter.num_tokens == 2


def test_a_tune_of_another_machine_is_reported_not_used(tuned, tmp_path):
    b = str(tmp_path / "b")
    shutil.copytree(tuned, b)
    (entry,) = read_tunes(b)
    os.remove(os.path.join(b, TUNE_FILE))
    other = dict(entry, machine=dict(entry["machine"], id="0123456789ab", cpu="Cortex-A78AE", cores=8))
    write_tune(b, other)
    s = Session.open(b, drafter="draft_model", max_context=256)
    assert s.engine.policy is None and "Cortex-A78AE" in s.shape.note and "edgespec tune" in s.shape.note
    s.close()


def test_writing_a_tune_keeps_the_other_machines_entries(tuned, tmp_path):
    b = str(tmp_path / "b")
    shutil.copytree(tuned, b)
    (mine,) = read_tunes(b)
    write_tune(b, dict(mine, machine=dict(mine["machine"], id="feedfacecafe")))
    write_tune(b, dict(mine, when="later"))  # this machine again: replaces its own entry only
    tunes = read_tunes(b)
    assert sorted(t["machine"]["id"] for t in tunes) == sorted([mine["machine"]["id"], "feedfacecafe"])
    assert [t["when"] for t in tunes if t["machine"]["id"] == mine["machine"]["id"]] == ["later"]
    assert not [f for f in os.listdir(b) if f.startswith(".tune-")]  # no temporary left behind


def test_an_unreadable_tune_is_one_line_naming_the_file(tuned, tmp_path, capsys):
    b = str(tmp_path / "b")
    shutil.copytree(tuned, b)
    with open(os.path.join(b, TUNE_FILE), "w") as f:
        f.write("tunes: [unclosed")
    assert main(["generate", "--bundle", b, "--backend", "numpy_ref", "--prompt", "hi", "--drafter", "draft_model", "--max-tokens", "2",
                 "--max-context", "256"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and TUNE_FILE in err and "edgespec tune" in err


def test_tune_json_is_the_entry_it_wrote(tuned, capsys):
    assert main(["tune", "--bundle", tuned, "--backend", "numpy_ref", "--drafters", "ngram", "--rounds", "1",
                 "--max-tokens", "4", "--k-max", "2", "--max-context", "256", "--dry-run", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert set(entry["drafters"]) == {"ngram"} and yaml.safe_dump(entry)
    assert "calibration" in entry["drafters"]["ngram"]  # (empty: an n-gram drafter has no confidence)


def test_tune_writes_each_drafters_acceptance_against_confidence_and_a_session_starts_from_it(tuned):
    (entry,) = read_tunes(tuned)
    cal = entry["drafters"]["draft_model"]["calibration"]
    assert set(cal) == {"greedy", "sampled"}
    for table in cal.values():
        assert len(table["drafted"]) == len(table["edges"]) - 1 and sum(table["drafted"]) > 0
        assert all(0 <= a <= n for a, n in zip(table["accepted"], table["drafted"]))
    s = Session.open(tuned, drafter="draft_model", max_context=256)
    assert s.engine.policy.calibrations["greedy"].drafted == [float(x) for x in cal["greedy"]["drafted"]]
    s.close()


def test_tune_plot_writes_the_cost_curve_the_calibration_and_expected_against_measured_rates(tuned, tmp_path):
    out = tmp_path / "plots"
    assert main(["tune", "--bundle", tuned, "--backend", "numpy_ref", "--drafters", "draft_model", "--rounds", "1",
                 "--max-tokens", "4", "--k-max", "2", "--max-context", "256", "--dry-run", "--plot", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["calibration.png", "cost.png", "rates.png"]


def test_a_tune_after_an_export_leaves_the_bundle_loadable(tuned, tmp_path):
    """tune -> export (which rewrites the manifest) -> tune again: the manifest never lists tune.yaml, so the second
    tune does not make every later load refuse the bundle as corrupt; an older manifest that lists it still loads."""
    from runtime.model.bundle import MANIFEST, BundleWriter, load

    b = str(tmp_path / "b")
    shutil.copytree(tuned, b)
    BundleWriter.extend(b).write()  # what an export does after adding its files
    with open(os.path.join(b, MANIFEST)) as f:
        assert TUNE_FILE not in yaml.safe_load(f)["files"]
    (entry,) = read_tunes(b)
    write_tune(b, dict(entry, backend="onnx"))  # the next tune: the file grows
    assert TUNE_FILE not in load(b, verify_checksums=True).files
    with open(os.path.join(b, MANIFEST)) as f:  # a manifest written by an export before this fix
        m = yaml.safe_load(f)
    m["files"][TUNE_FILE] = {"sha256": "0" * 64, "size": 1}
    with open(os.path.join(b, MANIFEST), "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)
    load(b, verify_checksums=True)
    s = Session.open(b, drafter="draft_model", max_context=256)
    assert s.shape.label == "adaptive (tuned)"
    s.close()
