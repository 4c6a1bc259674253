"""Specification of typed configuration (runtime/config.py) and of the shipped YAML files in configs/.

A bad value is refused once, at load, with a ConfigError that names the file, the key path, the value
and what was expected; nothing deeper in the code ever digs in a dict."""
from __future__ import annotations

from tests.support import REPO_ROOT
import dataclasses
import glob
import os
import re

import pytest

from runtime.config import (BackendConfig, DeviceProfile, GenerationConfig, RuntimeConfig, from_dict, load_config,
                            load_yaml, to_dict)
from runtime.errors import ConfigError

ROOT = REPO_ROOT
CONFIGS = os.path.join(ROOT, "configs")
DEVICES = sorted(glob.glob(os.path.join(CONFIGS, "devices", "*.yaml")))
JETSON_MODULES = ("orin_nano_4gb", "orin_nano_8gb", "orin_nx_8gb", "orin_nx_16gb", "agx_orin_32gb", "agx_orin_64gb",
                  "thor_t5000")


def write(tmp_path, text: str) -> str:
    path = str(tmp_path / "cfg.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def error_of(path: str, cls=RuntimeConfig) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path, cls)
    return str(exc.value)


# ---------------------------------------------------------------------------------------------- shipped files

def test_the_shipped_defaults_load_and_equal_the_dataclass_defaults():
    path = os.path.join(CONFIGS, "runtime.yaml")
    cfg = load_config(path)
    assert cfg == RuntimeConfig()


def test_the_shipped_defaults_spell_out_every_key_with_a_comment():
    path = os.path.join(CONFIGS, "runtime.yaml")
    data = load_yaml(path)
    assert data == to_dict(RuntimeConfig()), "configs/runtime.yaml must list every key at its default value"
    lines = open(path).read().splitlines()
    for line in lines:
        m = re.match(r"^\s*(\w+):\s*(\S.*)?$", line)
        if m and m.group(2) is not None:  # a leaf `key: value` line
            assert "#" in line, f"configs/runtime.yaml: key {m.group(1)!r} has no comment"


def test_the_onnx_config_selects_the_onnx_backend_on_the_cpu_provider():
    cfg = load_config(os.path.join(CONFIGS, "runtime_onnx.yaml"))
    assert cfg.backend.kind == "onnx"
    assert cfg.backend.providers == ("CPUExecutionProvider",)


def test_there_is_a_device_profile_for_every_jetson_module_and_this_machine():
    names = {os.path.splitext(os.path.basename(p))[0] for p in DEVICES}
    assert set(JETSON_MODULES) | {"this_machine"} <= names


@pytest.mark.parametrize("path", DEVICES, ids=[os.path.basename(p) for p in DEVICES])
def test_every_device_profile_loads_and_cites_its_numbers(path):
    dev = load_config(path, DeviceProfile)
    assert dev.name == os.path.splitext(os.path.basename(path))[0]
    assert dev.notes.strip(), f"{path}: `notes:` must say where memory_gb and bandwidth_gbs come from"
    assert 0 < dev.reserved_mb < dev.memory_gb * 1024


def test_device_profiles_carry_the_data_sheet_numbers():
    dev = {os.path.splitext(os.path.basename(p))[0]: load_config(p, DeviceProfile) for p in DEVICES}
    assert (dev["orin_nano_4gb"].memory_gb, dev["orin_nano_4gb"].bandwidth_gbs) == (4, 34)
    assert (dev["orin_nano_8gb"].memory_gb, dev["orin_nano_8gb"].bandwidth_gbs) == (8, 68)
    assert (dev["orin_nx_16gb"].memory_gb, dev["orin_nx_16gb"].bandwidth_gbs) == (16, 102.4)
    assert (dev["agx_orin_64gb"].memory_gb, dev["agx_orin_64gb"].bandwidth_gbs) == (64, 204.8)
    assert (dev["thor_t5000"].memory_gb, dev["thor_t5000"].bandwidth_gbs) == (128, 273)


def test_a_device_profile_without_a_name_is_refused(tmp_path):
    msg = error_of(write(tmp_path, "memory_gb: 8\n"), DeviceProfile)
    assert "name: missing required key" in msg


# ---------------------------------------------------------------------------------------------- bad values

# (yaml text, key path, value as repr'd in the message, what was expected)
BAD = [
    ("unknown top-level key", "bundel: x\n", "bundel", None, "unknown key; expected one of"),
    ("unknown nested key", "generation:\n  temprature: 0.5\n", "generation.temprature", None,
     "unknown key; expected one of"),
    ("string for int", "memory:\n  max_context: '4096'\n", "memory.max_context", "'4096'", "expected an integer"),
    ("bool for int", "backend:\n  threads: true\n", "backend.threads", "True", "expected an integer"),
    ("float for int", "drafter:\n  num_tokens: 4.5\n", "drafter.num_tokens", "4.5", "expected an integer"),
    ("bool for float", "generation:\n  temperature: false\n", "generation.temperature", "False", "expected a finite number"),
    ("list for mapping", "generation: [1, 2]\n", "generation", "[1, 2]", "expected a mapping"),
    ("mapping for string", "bundle: {path: x}\n", "bundle", "{'path': 'x'}", "expected a string"),
    ("string for list", "backend:\n  providers: CPUExecutionProvider\n", "backend.providers",
     "'CPUExecutionProvider'", "expected a list"),
    ("int in a list of strings", "generation:\n  stop: ['\\n', 3]\n", "generation.stop[1]", "3", "expected a string"),
    ("below min", "drafter:\n  num_tokens: 0\n", "drafter.num_tokens", "0", "expected >= 1"),
    ("below min (float)", "generation:\n  temperature: -0.1\n", "generation.temperature", "-0.1", "expected >= 0.0"),
    ("above max", "drafter:\n  branching: 17\n", "drafter.branching", "17", "expected <= 16"),
    ("above max (float)", "generation:\n  top_p: 1.5\n", "generation.top_p", "1.5", "expected <= 1.0"),
    ("bad choice", "backend:\n  kind: cuda\n", "backend.kind", "'cuda'", "expected one of ['numpy_ref', 'onnx'"),
    ("bad precision", "backend:\n  precision: int3\n", "backend.precision", "'int3'", "expected one of ['auto', 'fp32', 'fp16', 'int8', 'int4', 'f16', 'q8_0', 'q4_K_M']"),
    ("NaN", "generation:\n  temperature: .nan\n", "generation.temperature", "nan", "expected a finite number"),
    ("NaN in a range", "memory:\n  budget_mb: .NaN\n", "memory.budget_mb", "nan", "expected a finite number"),
]


@pytest.mark.parametrize("text,key,value,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_value_names_the_file_the_key_the_value_and_what_was_expected(tmp_path, text, key, value, expected):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}: {key}: "), msg
    if value is not None:
        assert f"got {value}," in msg, msg
    assert expected in msg, msg


def test_an_unknown_key_lists_the_keys_that_exist(tmp_path):
    msg = error_of(write(tmp_path, "generation:\n  temprature: 0.5\n"))
    for name in (f.name for f in dataclasses.fields(GenerationConfig)):
        assert repr(name) in msg


def test_infinity_is_refused_by_the_range_not_passed_through(tmp_path):
    msg = error_of(write(tmp_path, "generation:\n  temperature: .inf\n"))
    assert "generation.temperature: got inf, expected a finite number" in msg


def test_a_binary_file_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "cfg.yaml")
    with open(path, "wb") as f:
        f.write(b"\xff\xfe\x00bundle: x\x80\x81")
    msg = error_of(path)
    assert msg.startswith(f"{path}: ")


def test_infinity_is_refused_even_where_there_is_no_max(tmp_path):
    msg = error_of(write(tmp_path, "memory:\n  budget_mb: .inf\n"))
    assert "memory.budget_mb: got inf" in msg


def test_a_file_that_is_not_yaml_is_refused_naming_it(tmp_path):
    path = write(tmp_path, "backend: {kind: onnx\n  threads: [\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: not valid YAML")


def test_a_file_whose_top_level_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path, "- bundle\n- backend\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: <top>: got ['bundle', 'backend'], expected a mapping")


def test_a_missing_file_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "absent.yaml")
    msg = error_of(path)
    assert msg.startswith(f"{path}: cannot read") and "No such file" in msg


def test_an_empty_file_means_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == RuntimeConfig()


def test_a_partial_file_keeps_the_other_defaults_and_converts_types(tmp_path):
    cfg = load_config(write(tmp_path, "backend:\n  kind: onnx\n  providers: [CUDAExecutionProvider, "
                                      "CPUExecutionProvider]\nmemory:\n  budget_mb: 512\n"))
    assert cfg.backend == BackendConfig(kind="onnx", providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert cfg.memory.budget_mb == 512.0 and isinstance(cfg.memory.budget_mb, float)
    assert cfg.generation == GenerationConfig()


def test_configs_are_frozen():
    cfg = RuntimeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bundle = "elsewhere"  # type: ignore[misc]


def test_to_dict_round_trips_through_from_dict():
    cfg = from_dict(RuntimeConfig, {"generation": {"stop": ["\n\n"], "temperature": 0.7}, "drafter": {"kind": "none"}})
    assert from_dict(RuntimeConfig, to_dict(cfg)) == cfg
