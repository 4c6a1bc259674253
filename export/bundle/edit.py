"""Edit a bundle, keeping what still holds: `edgespec bundle add-drafter | remove-drafter | set-prompts`.

An edit never rebuilds the bundle. It runs on a hard-linked copy beside it (`.NAME.edit-XXXXXX`: no byte is
copied, every file the same inode) in which files change only by being replaced (written under a temporary name
and renamed: bundle.write_atomically, write_safetensors, the exporters' staging), so the bundle's own files are
never changed through the links; the edited copy, loaded and checked, then takes the bundle's place. A failed
edit leaves the bundle exactly as it was, and a reader sees the old bundle or the new one.

What an edit keeps: every file whose inputs it did not change keeps its bytes and its mtime.
  - add-drafter writes the new drafter's weights and exports only its graphs: when the bundle has ONNX graphs,
    one per new head / draft model beside the target graph, which stays as it is; when it has GGUF files, one
    per quant for a new draft model. Only a new drafter reading a hidden-state tap the target graph lacks makes
    the ONNX export run again (every drafter graph shares the target graph's data file); TensorRT engines built
    from the old graphs are then dropped, and the message says how to rebuild them on the device.
  - remove-drafter deletes only the files the manifest lists for the removed drafters and no other entry uses.
  - set-prompts rewrites the manifest (and chat_template.jinja); no weight is touched.
Nothing the manifest does not list is ever deleted."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar

from export.bundle.builder import swap_in
from export.drafters import registry
from runtime.errors import BundleError, ConfigError
from runtime.model import bundle as bundle_io
from runtime.model.bundle import MANIFEST, BundleWriter, gguf_entries

T = TypeVar("T")
Report = Callable[[str], None]


def edit_bundle(bundle_dir: str, change: Callable[[str], T]) -> T:
    """Run `change(copy)` on a hard-linked copy of the bundle and put the copy in the bundle's place once it
    loads with every checksum right (see the module doc). Returns what `change` returns."""
    real = os.path.realpath(bundle_dir)
    bundle_io.load(real)  # a whole bundle before anything is written
    parent = os.path.dirname(real)
    if not os.access(parent, os.W_OK):
        raise BundleError(f"{parent}: not writable; an edit writes its copy of {os.path.basename(real)} beside it "
                          "before it replaces the bundle. Edit a copy of the bundle in a writable directory")
    staged = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.edit-", dir=parent)
    try:
        try:
            shutil.copytree(real, staged, symlinks=True, copy_function=os.link, dirs_exist_ok=True)
        except (OSError, shutil.Error) as exc:
            raise BundleError(f"{real}: cannot hard-link its files into {staged} ({exc}); edit a copy of the bundle "
                              "on a file system with hard links that you own") from None
        copied = _tree(staged)
        result = change(staged)
        bundle_io.load(staged)  # the edited bundle, every file checked, before it replaces the old one
        _swap(staged, real, copied)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)  # links and files of this edit only: the bundle keeps its own
        raise
    return result


def _tree(root: str) -> Set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, names in os.walk(root) for n in names + dirs}


def _swap(staged: str, real: str, copied: Set[str]) -> None:
    """Put `staged` at `real`; a file that appeared in `real` during the edit (not in `copied`) moves across."""
    old = swap_in(staged, real)
    for rel in sorted(_tree(old) - copied):
        src, dst = os.path.join(old, rel), os.path.join(real, rel)
        if not os.path.lexists(dst) and not os.path.isdir(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
    shutil.rmtree(old)  # links to files the new bundle holds, and the files the edit removed from the bundle


# -- add-drafter -------------------------------------------------------------------------------------

def add_drafters(bundle_dir: str, drafters: Sequence[Tuple[str, str]] = (), validate: bool = True,
                 report: Report = print, **paths: Optional[str]) -> List[str]:
    """Add drafters to a bundle as `edgespec bundle`'s drafter flags name them and export only their graphs (module
    doc). `drafters`: (flag, path) pairs; `paths`: the same by the flag's name (eagle3=DIR, dflash=[DIR, ...]).
    Returns the drafter names added."""
    drafters = list(drafters) + [(f"--{key.replace('_', '-')}", p) for key, value in paths.items()
                                 for p in (value if isinstance(value, (list, tuple)) else [value]) if p]
    if not drafters:
        raise ConfigError("add-drafter: name the drafter to add: "
                          + ", ".join(f"{f.name} {f.metavar}" for _, f in registry.flags()))

    def change(root: str) -> List[str]:
        before = bundle_io.load(root)
        w = BundleWriter.extend(root)
        registry.add_given(w, drafters, before.target.spec)
        w.write()
        after = bundle_io.load(root, verify_checksums=False)
        new = [n for n in after.drafters if n not in before.drafters]
        report(f"bundle: added drafters {', '.join(new)}")
        _export_new_drafters(root, before, after, new, validate, report)
        return new

    return edit_bundle(bundle_dir, change)


def _export_new_drafters(root: str, before, after, new: List[str], validate: bool, report: Report) -> None:
    """The exports the new drafters need, beside the bundle's (module doc)."""
    onnx = before.target.backends.get("onnx")
    if onnx is not None:
        from export.onnx.bundle import add_onnx_to_bundle

        precision = onnx.params.get("precision", "fp32")
        # a fused target came from "auto" (draft models beside it are matmul graphs): export the same way again
        attention = {"fused": "auto"}.get(onnx.params.get("attention", "matmul"), onnx.params.get("attention", "matmul"))
        have = set(onnx.params.get("taps") or ())
        missing = sorted({t for n in new for t in after.drafters[n].target_taps} - have)
        if not missing:
            files = add_onnx_to_bundle(root, precision, validate=validate, attention=attention, only=new)
            report(f"bundle: exported {', '.join(f for f in files if f.endswith('.onnx')) or 'no ONNX graph'} "
                   "beside the target graph, which is kept as it was")
        else:
            taps = sorted(have | {"final_norm"} | {t for d in after.drafters.values() for t in d.target_taps})
            report(f"bundle: the target graph has no taps {missing}, which {', '.join(new)} read: exporting the "
                   "ONNX graphs again with them")
            add_onnx_to_bundle(root, precision, taps, validate=validate, attention=attention)
            for key, e in before.target.backends.items():
                if key.startswith("onnx."):  # a quantised target graph outputs the taps too
                    add_onnx_to_bundle(root, e.params.get("precision", key.split(".")[1]), taps, validate=validate,
                                       block_size=int(e.params.get("block_size", 32)),
                                       accuracy_level=e.params.get("accuracy_level"))
            _drop_backend(root, "tensorrt", report, f"they were built from the old ONNX graphs; rebuild them on the "
                                                    f"device with `edgespec export --to tensorrt --bundle {root}`")
    drafts = [n for n in new if registry.is_decoder(after.drafters[n].kind)]
    for quant in gguf_entries(before.target.backends) if drafts else ():
        from export.gguf.writer import add_gguf_to_bundle

        files = add_gguf_to_bundle(root, quant, validate=validate, only=drafts)
        report(f"bundle: exported {', '.join(files)} beside the target's {quant} GGUF")
    if drafts and "tensorrt" in bundle_io.load(root, verify_checksums=False).target.backends:
        report(f"bundle: {', '.join(drafts)} has no TensorRT engine yet (it runs on numpy beside the target's); "
               "build it on the device with `edgespec export --to tensorrt --bundle BUNDLE`")


def _drop_backend(root: str, kind: str, report: Report, why: str) -> None:
    """Remove the `kind` entries of the target and every drafter, and the files only they listed."""
    b = bundle_io.load(root, verify_checksums=False)
    if kind not in b.target.backends and not any(kind in d.backends for d in b.drafters.values()):
        return
    w = BundleWriter.extend(root)
    m = w.manifest
    holders = [m["target"]] + list((m.get("drafters") or {}).values())
    dropped = [f for h in holders for f in ((h.get("backends") or {}).pop(kind, None) or {}).get("files", ())]
    if not dropped:
        return
    removed = _remove_unused(root, m, dropped)
    w.write()
    report(f"bundle: removed the {kind} entries ({', '.join(removed) or 'no file'}): {why}")


# -- remove-drafter ----------------------------------------------------------------------------------

def remove_drafters(bundle_dir: str, names: Sequence[str], report: Report = print) -> List[str]:
    """Remove drafters by name and the files only they used. Returns the files removed."""
    if not names:
        raise ConfigError("remove-drafter: name the drafters to remove")

    def change(root: str) -> List[str]:
        b = bundle_io.load(root, verify_checksums=False)
        unknown = [n for n in names if n not in b.drafters]
        if unknown:
            raise BundleError(f"{bundle_dir}: no drafter {unknown[0]!r}; it has {sorted(b.drafters)}")
        w = BundleWriter.extend(root)
        m = w.manifest
        files = [f for n in names for f in _entry_files(m["drafters"].pop(n))]
        removed = _remove_unused(root, m, files)
        if m.get("default_drafter") in names:
            m["default_drafter"] = "ngram" if "ngram" in m["drafters"] else "none"
            report(f"bundle: the default drafter is now {m['default_drafter']} (set another with "
                   "--default-drafter when building, or request one with --drafter)")
        w.write()
        report(f"bundle: removed drafters {', '.join(names)}; files removed: {', '.join(removed) or 'none'} "
               "(files another entry uses are kept)")
        return removed

    return edit_bundle(bundle_dir, change)


def _entry_files(entry: Mapping) -> List[str]:
    """Every file one manifest entry (a drafter or the target) names, its backends' included."""
    return list(entry.get("files") or ()) + [f for e in (entry.get("backends") or {}).values() for f in e.get("files", ())]


def _remove_unused(root: str, manifest: Dict, files: Sequence[str]) -> List[str]:
    """Delete those of `files` that the manifest lists as the bundle's and no entry of it still uses; folders
    they leave empty go too. Returns the files deleted."""
    used = {manifest.get("tokenizer")} | set(_entry_files(manifest["target"]))
    used |= {f for d in (manifest.get("drafters") or {}).values() for f in _entry_files(d)}
    prompts = manifest.get("prompts")
    if isinstance(prompts, dict):
        used.add(prompts.get("chat_template"))
    listed = set(manifest.get("files") or {})
    removed = sorted({f for f in files if f in listed and f not in used and f != MANIFEST})
    for rel in removed:
        os.remove(os.path.join(root, rel))
        folder = os.path.dirname(os.path.join(root, rel))
        while os.path.realpath(folder) != os.path.realpath(root) and not os.listdir(folder):
            os.rmdir(folder)
            folder = os.path.dirname(folder)
    return removed


# -- set-prompts -------------------------------------------------------------------------------------

def set_prompts(bundle_dir: str, prompts: Mapping[str, str], target_dir: Optional[str] = None,
                report: Report = print) -> None:
    """Lay the user's prompt files (keyword arguments of export.bundle.prompts.bundle_prompts: prompts_file,
    chat_template_file, planner_file, action_file) over the bundle's prompt format, or over the model's own
    read from `target_dir`, and record it. No weight file changes."""
    prompts = {k: v for k, v in prompts.items() if v}
    if not prompts and target_dir is None:
        raise ConfigError("set-prompts: give what to change: --prompts FILE, --chat-template FILE, "
                          "--planner-template FILE or --action-template FILE (or --target DIR for the model's own)")

    def change(root: str) -> None:
        from export.bundle.prompts import bundle_prompts
        from runtime.text.tokenizer import Tokenizer

        b = bundle_io.load(root)
        if target_dir is None and b.prompts is None:
            raise BundleError(f"{bundle_dir}: records no prompt format to change (a bundle from an older edgespec); "
                              "pass --target DIR, the HF checkpoint it was built from, to start from the model's own")
        base = None
        if target_dir is None:
            base = b.prompts.to_dict()
            if b.prompts.chat_template:
                base["chat_template"] = b.prompts.chat_template  # the source itself: bundle_prompts reads no file
        fmt, notes = bundle_prompts(target_dir, Tokenizer(b.path(b.tokenizer)), base=base, **prompts)
        for note in notes:
            report(f"prompts: {note}")
        w = BundleWriter.extend(root)
        w.set_prompts(fmt)
        if b.chat_template_file and not fmt.chat_template:
            _remove_unused(root, w.manifest, [b.chat_template_file])
        w.write()
        report(f"bundle: {bundle_dir}: prompt format recorded; no weight file changed")

    edit_bundle(bundle_dir, change)
