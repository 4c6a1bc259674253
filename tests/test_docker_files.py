"""Static checks of docker/jetson/ (there is no Docker engine and no Jetson here to build it): the
Dockerfile parses into valid instructions, starts from the L4T JetPack image, copies the runtime and the
ROS 2 workspace, runs the node the ROS package really declares, and never installs torch."""
from __future__ import annotations

import json
import os
import re

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker", "jetson")
DOCKERFILE = os.path.join(DOCKER, "Dockerfile")
COMPOSE = os.path.join(DOCKER, "docker-compose.yml")
KEYWORDS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
            "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions(path: str = DOCKERFILE):
    """(KEYWORD, arguments) pairs: comments dropped, backslash continuations joined (Dockerfile rules)."""
    out, pending = [], ""
    for raw in open(path).read().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # comment lines inside a continuation are removed
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if not full:
            continue
        keyword, _, args = full.partition(" ")
        out.append((keyword, args.strip()))
    assert not pending, f"{path}: the last instruction ends in a line continuation"
    return out


def arg_defaults(instrs) -> dict:
    out = {}
    for kw, args in instrs:
        if kw.upper() == "ARG" and "=" in args:
            k, v = args.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def test_every_instruction_keyword_is_a_dockerfile_instruction():
    instrs = instructions()
    assert instrs
    for kw, _ in instrs:
        assert kw.upper() in KEYWORDS, f"{DOCKERFILE}: {kw!r} is not a Dockerfile instruction"
        assert kw == kw.upper(), f"{DOCKERFILE}: write instructions in capitals ({kw!r})"
    assert instrs[0][0] in ("FROM", "ARG"), "a Dockerfile starts with FROM (or the ARGs FROM uses)"


def test_exec_form_instructions_are_valid_json_arrays():
    for kw, args in instructions():
        if kw in ("ENTRYPOINT", "CMD", "SHELL", "VOLUME") and args.startswith("["):
            value = json.loads(args)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{kw} {args}"


def test_it_starts_from_the_l4t_jetpack_6_image():
    instrs = instructions()
    defaults = arg_defaults(instrs)
    froms = [args.split()[0] for kw, args in instrs if kw == "FROM"]
    assert froms, "no FROM"
    image = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), froms[0])
    assert image == "nvcr.io/nvidia/l4t-jetpack:r36.4.0"


def test_it_copies_the_runtime_and_the_ros_workspace_but_not_the_workstation_code():
    sources = []
    for kw, args in instructions():
        if kw in ("COPY", "ADD"):
            parts = [p for p in args.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert any(s.rstrip("/") == "runtime" for s in sources), sources
    assert any(s.rstrip("/").startswith("ros2_ws") for s in sources), sources
    assert not any(s.rstrip("/").startswith("export") for s in sources), "export/ is workstation code"
    for s in sources:  # every copied path exists, or the build fails on the robot
        assert os.path.exists(os.path.join(ROOT, s)), f"COPY {s}: no such path in the repository"


def test_it_never_installs_torch_or_transformers():
    for kw, args in instructions():
        if kw == "RUN":
            assert not re.search(r"\b(torch\w*|transformers)\b", args), f"RUN installs a workstation package: {args}"


def test_it_installs_onnxruntime_from_the_jetson_index_and_ros_2_from_apt():
    text = " ".join(args for _, args in instructions())
    defaults = arg_defaults(instructions())
    assert defaults.get("JETSON_PIP_INDEX", "").startswith("https://pypi.jetson-ai-lab.io/jp6/cu126")
    assert defaults.get("ORT_PACKAGE") == "onnxruntime-gpu"
    assert defaults.get("ROS_DISTRO") == "humble"
    for pkg in ("ros-base", "diagnostic-msgs", "lifecycle-msgs"):
        assert f"ros-${{ROS_DISTRO}}-{pkg}" in text
    assert "python3-colcon-common-extensions" in text and "colcon build" in text


def test_the_default_command_runs_the_node_executable_the_package_declares_with_a_real_params_file():
    instrs = instructions()
    entry = [json.loads(a) for k, a in instrs if k == "ENTRYPOINT"][-1]
    cmd = [json.loads(a) for k, a in instrs if k == "CMD"][-1]
    assert "source /opt/ros/" in " ".join(entry)
    assert cmd[:3] == ["ros2", "run", "edgespec_ros"]
    setup_py = open(os.path.join(ROOT, "ros2_ws", "src", "edgespec_ros", "setup.py")).read()
    declared = re.findall(r'"(\w+)\s*=\s*edgespec_ros\.', setup_py)
    assert cmd[3] in declared, f"ros2 run edgespec_ros {cmd[3]}: setup.py declares {declared}"
    params = cmd[cmd.index("--params-file") + 1]
    assert params.startswith("/opt/edgespec/")
    assert os.path.isfile(os.path.join(ROOT, params[len("/opt/edgespec/"):])), params


def test_the_compose_file_uses_the_nvidia_runtime_host_network_and_a_read_only_bundle():
    compose = yaml.safe_load(open(COMPOSE))
    (service,) = compose["services"].values()
    assert service["runtime"] == "nvidia"
    assert service["network_mode"] == "host"
    mounts = [v for v in service["volumes"] if "/opt/edgespec/build/bundles" in v]
    assert mounts and all(v.endswith(":ro") for v in mounts), mounts
    assert service["build"]["dockerfile"] == "docker/jetson/Dockerfile"


def test_the_readme_says_the_image_was_not_built_here():
    text = open(os.path.join(DOCKER, "README.md")).read()
    assert "Not built or run here" in text


@pytest.mark.parametrize("line,expected", [
    ("FROM x\nRUN a \\\n  # note\n  b\n", [("FROM", "x"), ("RUN", "a  b")]),
    ("# c\n\nARG A=1\nFROM ${A}\n", [("ARG", "A=1"), ("FROM", "${A}")]),
])
def test_the_instruction_parser_joins_continuations_and_drops_comments(tmp_path, line, expected):
    path = tmp_path / "Dockerfile"
    path.write_text(line)
    assert instructions(str(path)) == expected
