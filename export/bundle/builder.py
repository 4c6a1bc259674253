"""Write a runtime bundle from HF checkpoints: the target (+ its MTP module if it has one), the drafters given by
their flags (each added by its kind, export/drafters/kinds/<name>.py: a draft model, Medusa heads, EAGLE heads,
DFlash drafters, an MTP module), the n-gram drafter (no files), the tokenizer, the prompt format
(export/bundle/prompts.py) and the generation defaults.

Nothing we did not write is ever deleted. The output directory must be new, empty, or an edgespec
bundle holding only the files its manifest lists (replaced only with force=True); it may not be, hold
or lie inside an input. The bundle is written into a temporary sibling and renamed into place, so a
failed build leaves the old output as it was and a reader never sees half a bundle."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import Counter
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import yaml

from export.bundle.hf_reader import read_hf_checkpoint
from export.bundle.prompts import bundle_prompts
from export.drafters import registry
from runtime.model.bundle import MANIFEST, BundleWriter, current_umask
from runtime.errors import BundleError
from runtime.model.tensors import safetensors_dtypes, write_safetensors
from runtime.text.tokenizer import Tokenizer

MTP_KEY = re.compile(r"^model\.layers\.(\d+)\.")


# Prefixes of the other MTP layouts (runtime/drafters/mtp.py MTP_LAYOUTS), with the pattern numbering their modules.
MTP_PREFIXES = (("mtp.", "qwen3_next", re.compile(r"^mtp\.layers\.(\d+)\.")),
                ("model.mtp_layers.", "mimo", re.compile(r"^model\.mtp_layers\.(\d+)\.")))


def split_mtp(weights: Dict[str, np.ndarray], num_layers: int):
    """Split MTP modules from the target's weights: DeepSeek-V3 puts them at model.layers.{N+k}, Qwen3-Next
    under mtp.*, MiMo under model.mtp_layers.*."""
    body, mtp = {}, {}
    for name, w in weights.items():
        m = MTP_KEY.match(name)
        is_mtp = (m and int(m.group(1)) >= num_layers) or any(name.startswith(p) for p, _, _ in MTP_PREFIXES)
        (mtp if is_mtp else body)[name] = w
    return body, mtp


def mtp_layout(mtp: Dict[str, np.ndarray], num_layers: int):
    """(layout name, number of modules) of the MTP weights `split_mtp` found. Raises BundleError on a mix."""
    found = {}
    for name in mtp:
        for prefix, layout, numbered in MTP_PREFIXES:
            if name.startswith(prefix):
                m = numbered.match(name)
                found.setdefault(layout, set()).update([int(m.group(1))] if m else [])
                break
        else:
            found.setdefault("deepseek_v3", set()).add(int(MTP_KEY.match(name).group(1)) - num_layers)
    if len(found) != 1:
        raise BundleError(f"the checkpoint mixes MTP layouts {sorted(found)}; expected one of deepseek_v3 "
                          "(model.layers.N+k), qwen3_next (mtp.*), mimo (model.mtp_layers.*)")
    (layout, modules), = found.items()
    return layout, max(1, len(modules))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _files_under(root: str) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                  for d, _, names in os.walk(root) for n in names)


def check_output(out: str, inputs: Sequence[str], force: bool = False, flag: str = "--out") -> None:
    """Refuse an output directory whose replacement could lose data we did not write (see the module doc)."""
    real_out = os.path.realpath(out)
    for given in inputs:
        real_in = os.path.realpath(given)
        if _inside(real_in, real_out) or _inside(real_out, real_in):
            how = "is" if real_in == real_out else ("holds" if _inside(real_in, real_out) else "lies inside")
            raise BundleError(f"{flag} {out} {how} the input {given}; writing there could destroy the checkpoint. "
                              "Choose an output directory outside every input")
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out) or os.path.islink(out):
        raise BundleError(f"{flag} {out} exists and is not a directory; choose a new directory")
    present = _files_under(out)
    if not present:
        return  # an empty directory holds nothing to lose
    manifest = os.path.join(out, MANIFEST)
    listed = None
    try:
        with open(manifest) as f:
            m = yaml.safe_load(f)
        if isinstance(m, dict) and "format_version" in m and isinstance(m.get("files"), dict):
            listed = set(m["files"]) | {MANIFEST}
    except (OSError, yaml.YAMLError):
        pass
    if listed is None:
        raise BundleError(f"{flag} {out} is not empty and is not an edgespec bundle (it holds {present[:3]}"
                          f"{' ...' if len(present) > 3 else ''}); edgespec never deletes what it did not write. "
                          "Choose a new or empty directory")
    foreign = [p for p in present if p not in listed]
    if foreign:
        raise BundleError(f"{flag} {out} is an edgespec bundle but also holds files its manifest does not list "
                          f"({foreign[:3]}{' ...' if len(foreign) > 3 else ''}); edgespec never deletes what it did "
                          "not write. Move them away, or choose a new directory")
    if not force:
        raise BundleError(f"{flag} {out} already holds a bundle; pass --force to replace it (its ONNX / GGUF "
                          f"exports go with it), or change it in place, keeping them: `edgespec bundle add-drafter "
                          f"--bundle {out} --eagle3 DIR`, remove-drafter, set-prompts")


def swap_in(staged: str, real: str) -> str:
    """Put directory `staged` at `real` and return where the old `real` went (`staged` + ".old", for the caller to
    drop): rename(2) cannot replace a non-empty directory, so the old one moves aside first and comes back if the
    second rename fails."""
    old = staged + ".old"
    os.rename(real, old)
    try:
        os.rename(staged, real)
    except OSError:
        os.rename(old, real)
        raise
    return old


def _publish(staged: str, out: str) -> None:
    """Move the finished bundle `staged` to `out`, replacing what check_output allowed to be replaced."""
    if not os.path.lexists(out):
        os.rename(staged, out)
        return
    shutil.rmtree(swap_in(staged, out))


def external_mtp(mtp_dir: str, spec, own: Mapping, target: str = "the target") -> Dict[str, np.ndarray]:
    """The MTP weights of `mtp_dir` (train-drafter mtp: model.layers.{N}.* keys, N = the target's layer count),
    checked to sit after this target's layers. BundleError if the target has its own (`own` not empty) or they do
    not fit."""
    from export.bundle.hf_reader import read_weights

    if own:
        raise BundleError(f"--mtp {mtp_dir}: {target} has its own MTP module; give one or the other")
    weights = read_weights(mtp_dir)
    prefix = f"model.layers.{spec.num_layers}."
    stray = sorted(k for k in weights if not k.startswith(prefix))
    proj = weights.get(prefix + "eh_proj.weight")
    if stray or proj is None or proj.shape != (spec.hidden_size, 2 * spec.hidden_size):
        found = stray[:3] or f"eh_proj {None if proj is None else proj.shape}"
        raise BundleError(f"--mtp {mtp_dir}: expected one MTP module after the target's {spec.num_layers} layers "
                          f"({prefix}*, eh_proj ({spec.hidden_size}, {2 * spec.hidden_size})), found {found}; "
                          "train it for this target with `edgespec train-drafter mtp --target DIR --out DIR`")
    return weights


def build_bundle(target_dir: str, out: str, draft_dir: Optional[str] = None, name: Optional[str] = None,
                 default_drafter: Optional[str] = None, force: bool = False,
                 extend: Optional[Callable[[str], None]] = None, prompts: Optional[Dict[str, str]] = None,
                 report: Callable[[str], None] = lambda note: None, medusa: Optional[str] = None,
                 dflash_dirs: Sequence[str] = (), mtp_dir: Optional[str] = None, flag: str = "--out",
                 drafters: Sequence[Tuple[str, str]] = ()) -> str:
    """Write `out` as a numpy_ref bundle; `extend(staged_dir)` may add other backends' files before the
    bundle is renamed into place. `prompts`: the user's prompt files (keyword arguments of
    export.bundle.prompts.bundle_prompts: prompts_file, chat_template_file, planner_file, action_file); `report`
    receives a line saying where the prompt format came from; `drafters`: (flag, path) pairs of `edgespec bundle`'s
    drafter flags, each added by the kind declaring the flag (export/drafters/registry.py). `draft_dir`, `medusa`,
    `dflash_dirs` and `mtp_dir` are short for ("--draft", DIR), ("--medusa", PATH), ("--dflash", DIR) each and
    ("--mtp", DIR). Returns `out`. Refuses outputs per `check_output`."""
    drafters = ([("--draft", draft_dir)] if draft_dir else []) + ([("--medusa", medusa)] if medusa else []) \
        + [("--dflash", d) for d in dflash_dirs] + ([("--mtp", mtp_dir)] if mtp_dir else []) + list(drafters)
    inputs = [target_dir] + [path for _, path in drafters] + [f for f in (prompts or {}).values() if f]
    check_output(out, inputs, force, flag)
    name = name or os.path.basename(os.path.normpath(os.path.abspath(out)))
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staged = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
    try:
        _write_bundle(target_dir, staged, name, default_drafter, prompts or {}, report, drafters)
        if extend is not None:
            extend(staged)
        # mkdtemp makes it private; a bundle is read by other users (the ROS node): the mode mkdir would give
        os.chmod(staged, 0o777 & ~current_umask())
        _publish(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)  # ours alone: nothing else was ever written there
        raise
    return out


def _write_bundle(target_dir: str, out: str, name: str, default_drafter: Optional[str], prompts: Dict[str, str],
                  report: Callable[[str], None], drafters: Sequence[Tuple[str, str]] = ()) -> None:
    target = read_hf_checkpoint(target_dir)
    if target.tokenizer_file is None:
        raise BundleError(f"{target_dir}: no tokenizer.json; the bundle needs the tokenizer the model was trained with")
    fmt, notes = bundle_prompts(target_dir, Tokenizer(target.tokenizer_file), **prompts)  # before the big writes
    for note in notes:
        report(f"prompts: {note}")
    w = BundleWriter(out, name)
    w.set_prompts(fmt)
    spec = target.spec
    body, mtp = split_mtp(target.weights, spec.num_layers)
    w.set_target(spec)
    bf16 = target.bf16_names  # kept as bf16, bit for bit: never silently widened to twice the bytes
    write_safetensors(w.path("target/model.safetensors"), body, bf16=[n for n in bf16 if n in body])
    w.add_target_backend("numpy_ref", ["target/model.safetensors"])
    shutil.copyfile(target.tokenizer_file, w.path("tokenizer.json"))
    w.set_tokenizer("tokenizer.json")
    for ex in registry.EXPORTS:
        if ex.always is not None:
            ex.always(w, spec)
    if mtp:  # the target's own MTP module (one given with --mtp is added as the other drafters are)
        add_mtp_weights(w, mtp, spec, bf16=[n for n in bf16 if n in mtp])
    added = registry.add_given(w, drafters, spec)
    preferred = [n for n in added if w.manifest["drafters"][n]["kind"] in
                 {k for ex in registry.EXPORTS if ex.default for k in ex.kinds}]
    chosen = default_drafter or (preferred[0] if preferred else "ngram")
    if chosen not in w.manifest["drafters"] and chosen != "none":
        raise BundleError(f"--default-drafter {chosen!r}: this bundle has drafters {sorted(w.manifest['drafters'])} "
                          "(or 'none')")
    w.manifest["default_drafter"] = chosen
    w.set_generation(max_tokens=128, temperature=0.0)
    w.write()


def add_mtp_weights(w: BundleWriter, mtp: Dict[str, np.ndarray], spec, bf16: Sequence[str] = ()) -> None:
    """Write MTP modules (`split_mtp`'s, or `external_mtp`'s) into the bundle being written as the drafter `mtp`."""
    layout, modules = mtp_layout(mtp, spec.num_layers)
    write_safetensors(w.path("mtp/mtp.safetensors"), mtp, bf16=list(bf16))
    w.add_drafter("mtp", "mtp", files=["mtp/mtp.safetensors"],
                  params={"num_modules": modules, "first_layer_index": spec.num_layers, "layout": layout},
                  target_taps=[f"layer_out.{spec.num_layers - 1}"])


def add_draft_model(w: BundleWriter, draft_dir: str, spec, name: str = "draft_model") -> str:
    """Write the HF checkpoint `draft_dir` into the bundle being written by `w` as drafter `name` (a separate
    draft model sharing the target's tokenizer, whose spec is `spec`). Returns the name."""
    if name in w.manifest["drafters"]:
        raise BundleError(f"{draft_dir}: the bundle already has a drafter named {name!r}; remove it first "
                          f"(`edgespec bundle remove-drafter --bundle {w.root} {name}`)")
    draft = read_hf_checkpoint(draft_dir)
    if draft.spec.vocab_size != spec.vocab_size:
        raise BundleError(f"{draft_dir}: vocab size {draft.spec.vocab_size} differs from the target's "
                          f"{spec.vocab_size}; a draft model must share the target's tokenizer")
    dbody, _ = split_mtp(draft.weights, draft.spec.num_layers)
    rel = "draft/model.safetensors" if name == "draft_model" else f"{name}/model.safetensors"
    write_safetensors(w.path(rel), dbody, bf16=[n for n in draft.bf16_names if n in dbody])
    w.add_drafter(name, "draft_model", files=[rel], spec=draft.spec, params={"num_tokens": 4})
    return name


_DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}


def dtype_summary(bundle_dir: str) -> List[str]:
    """One line per safetensors file of a bundle: how many tensors of each dtype, and their bytes; tensors
    in a dtype other than the file's main one are named (e.g. norms kept in fp32 beside bf16 matrices).
    Example: 'target/model.safetensors: bf16 x 26 (0.3 MiB)'."""
    lines = []
    for rel in _files_under(bundle_dir):
        if not rel.endswith(".safetensors"):
            continue
        dtypes = safetensors_dtypes(os.path.join(bundle_dir, rel))
        counts = Counter(_DTYPE_NAMES.get(d, d.lower()) for d in dtypes.values())
        main = counts.most_common(1)[0][0] if counts else ""
        size = os.path.getsize(os.path.join(bundle_dir, rel)) / 2**20
        line = f"{rel}: " + ", ".join(f"{d} x {n}" for d, n in counts.most_common()) + f" ({size:.1f} MiB)"
        others = [n for n, d in sorted(dtypes.items()) if _DTYPE_NAMES.get(d, d.lower()) != main]
        if others:
            line += f"; not {main}: {', '.join(others[:8])}{' ...' if len(others) > 8 else ''}"
        lines.append(line)
    return lines
