"""The bundle: a directory with `bundle.yaml` plus weight/engine/tokenizer files — the contract between
`export` (workstation) and `runtime` (robot).

One bundle carries the same target for several backends (`target.backends.<kind>.files`) and any
number of drafters. Every file is listed with its sha256 and size; `load` checks the format version
and every checksum and raises BundleError naming the file and what to do. Only data formats are
allowed (safetensors, ONNX, GGUF, engines, JSON/YAML): nothing is ever unpickled."""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import yaml

from runtime.errors import REBUILD_BUNDLE as REBUILD
from runtime.errors import BundleError
from runtime.model.spec import ModelSpec
from runtime.text.templates import PromptFormat
from runtime.model.tensors import safetensors_dtypes

FORMAT_VERSION = 1
MANIFEST = "bundle.yaml"
# .engine: TensorRT engines; .cache: TensorRT's timing cache (kernel timings, reused by the next build on a device)
DATA_SUFFIXES = (".safetensors", ".onnx", ".onnx.data", ".gguf", ".engine", ".cache", ".plan", ".json", ".yaml", ".txt",
                 ".jinja")
# `edgespec tune`'s measurements of one machine (runtime/serving/tuning.py): rewritten by every tune, so never a
# listed file (a manifest written after a tune, by an export, once listed it and the next tune "corrupted" the bundle)
TUNE_FILE = "tune.yaml"
EXPORTABLE = ("onnx", "tensorrt", "gguf")  # backends `edgespec export --to` writes
# ONNX target graphs: the float graph (fp32 or fp16, one of them) is backend entry "onnx"; weight-only
# quantised graphs sit next to it as "onnx.int8" / "onnx.int4" (`edgespec export --to onnx --precision int8`).
ONNX_PRECISIONS = ("fp32", "fp16", "int8", "int4")


def onnx_entry_key(precision: str) -> str:
    """The target backend entry holding the ONNX graph of `precision`: "onnx" (fp32/fp16) or "onnx.int8"."""
    return "onnx" if precision in ("fp32", "fp16") else f"onnx.{precision}"


# GGUF quants, most precise first (`backend.precision: auto` takes the first one the bundle holds). Several sit
# side by side, as the ONNX graphs do: "gguf" holds f16, "gguf.q8_0" / "gguf.q4_K_M" the quantised files.
GGUF_QUANTS = ("f16", "q8_0", "q4_K_M")
# backend.precision -> the GGUF quant it picks: a quant by name, or the weight class it belongs to
GGUF_QUANT_OF = {"fp16": "f16", "int8": "q8_0", "int4": "q4_K_M", **{q: q for q in GGUF_QUANTS}}


def gguf_entry_key(quant: str) -> str:
    """The backend entry holding the GGUF of `quant`: "gguf" (f16) or "gguf.q8_0"."""
    return "gguf" if quant == "f16" else f"gguf.{quant}"


def gguf_entries(backends: Dict[str, "BackendFiles"]) -> Dict[str, str]:
    """{quant: entry key} of the GGUF entries among `backends`, by each entry's params.quant (a bundle from
    before quants sat side by side has one "gguf" entry of any quant), most precise first."""
    found = {str(files.params.get("quant", "f16")): key for key, files in backends.items()
             if key == "gguf" or key.startswith("gguf.")}
    return dict(sorted(found.items(), key=lambda kv: GGUF_QUANTS.index(kv[0]) if kv[0] in GGUF_QUANTS else 99))
# Keys a manifest may have, per level: anything else is a typo or a newer format, refused by name.
MANIFEST_KEYS = ("format_version", "name", "target", "drafters", "default_drafter", "tokenizer", "generation", "prompts",
                 "files")
TARGET_KEYS = ("spec", "backends")
DRAFTER_KEYS = ("kind", "files", "params", "target_taps", "spec", "backends")
BACKEND_KEYS = ("files", "params")
FILE_KEYS = ("sha256", "size")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
BUILTIN_DRAFTERS = ("none", "ngram")  # drafters every bundle can run, listed in its manifest or not
# A drafter entry's kind is any name here: the kinds are declared by the drafters, two floors up (each
# runtime/drafters/<name>.py SPEC), and runtime/drafters/registry.py refuses a kind none declares when the
# entry is resolved, naming the field and the kinds there are.


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the bundle root
    sha256: str
    size: int


@dataclass(frozen=True)
class BackendFiles:
    files: Tuple[str, ...]
    params: Dict[str, Any] = field(default_factory=dict)  # e.g. precision, graph input names


@dataclass(frozen=True)
class TargetEntry:
    spec: ModelSpec
    backends: Dict[str, BackendFiles]


@dataclass(frozen=True)
class DrafterEntry:
    kind: str
    files: Tuple[str, ...] = ()
    params: Dict[str, Any] = field(default_factory=dict)
    target_taps: Tuple[str, ...] = ()  # hidden taps of the target this drafter reads
    spec: Optional[ModelSpec] = None  # for drafters that are models of their own
    backends: Dict[str, BackendFiles] = field(default_factory=dict)  # backend-specific graphs (e.g. onnx)


@dataclass(frozen=True)
class Bundle:
    root: str
    name: str
    target: TargetEntry
    drafters: Dict[str, DrafterEntry]
    default_drafter: str
    tokenizer: str  # relative path of tokenizer.json
    generation: Dict[str, Any]
    files: Dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    prompts: Optional[PromptFormat] = None  # the model's prompt format; None: a bundle from before it was recorded
    chat_template_file: Optional[str] = None  # relative path of the chat template, if the bundle has one

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def drafter(self, name: str) -> DrafterEntry:
        if name not in self.drafters:
            raise BundleError(self.missing_drafter(name))
        return self.drafters[name]

    def drafter_choices(self) -> list:
        """Every drafter name this bundle can run: its own, n-gram (needs no files) and 'none'."""
        return sorted(set(BUILTIN_DRAFTERS) | set(self.drafters))

    def missing_drafter(self, name: str) -> str:
        """The message for a drafter this bundle lacks: what it can run instead (how to add one: each drafter's
        file says, runtime/drafters/registry.py missing_drafter)."""
        return (f"{self.root}: no drafter {name!r} in this bundle; it can run {self.drafter_choices()} "
                "('none' = plain decoding)")

    def target_files(self, backend: str) -> BackendFiles:
        if backend not in self.target.backends:
            how = (f"Export it with `edgespec export --to {backend} --bundle {self.root}`." if backend in EXPORTABLE
                   else f"edgespec cannot export for {backend!r} yet (exporters: {', '.join(EXPORTABLE)}).")
            raise BundleError(f"{self.root}: the target has no files for backend {backend!r}; it has "
                              f"{sorted(self.target.backends)}. {how}")
        return self.target.backends[backend]

    def onnx_target(self, precision: str = "auto") -> BackendFiles:
        """The target's ONNX graph of `precision` ("auto" = the float graph, entry "onnx"); a BundleError
        naming the export command when the bundle does not hold it."""
        if precision == "auto":
            return self.target_files("onnx")
        if precision not in ONNX_PRECISIONS:
            raise BundleError(f"precision {precision!r} (backend.precision / --precision): a GGUF quant, not an ONNX graph; run it with --backend gguf, "
                              f"or pick an ONNX precision ({', '.join(ONNX_PRECISIONS)})")
        key = onnx_entry_key(precision)
        files = self.target.backends.get(key)
        if files is None or files.params.get("precision", "fp32") != precision:
            have = sorted(f"{k} ({v.params.get('precision', 'fp32')})" for k, v in self.target.backends.items()
                          if k.startswith("onnx"))
            export = f"edgespec export --to onnx --precision {precision} --bundle {self.root}"  # precision: a valid choice
            raise BundleError(f"{self.root}: the target has no {precision} ONNX graph (it has {have or 'none'}); "
                              f"export it with `{export}`")
        return files

    def gguf_quant(self, precision: str = "auto") -> str:
        """The GGUF quant `precision` picks (auto: the most precise the bundle holds); a BundleError listing the
        quants the bundle has and the export command that adds the missing one."""
        have = gguf_entries(self.target.backends)
        if not have:
            raise BundleError(f"{self.root}: the target has no GGUF file; export one with `edgespec export --to gguf "
                              f"--bundle {self.root}` (f16; --precision q8_0 or q4_K_M for llama.cpp's quants)")
        if precision == "auto":
            return next(iter(have))
        quant = GGUF_QUANT_OF.get(precision)
        if quant is None:
            raise BundleError(f"precision {precision!r} (backend.precision / --precision): no GGUF quant; the gguf backend takes one of "
                              f"{list(GGUF_QUANTS)} (or fp16 / int8 / int4 for them); this bundle has {list(have)}")
        if quant not in have:
            export = f"edgespec export --to gguf --precision {quant} --bundle {self.root}"
            raise BundleError(f"{self.root}: the target has no {quant} GGUF (it has {', '.join(have)}); "
                              f"export it with `{export}`")
        return quant

    def target_entry_key(self, backend: str, precision: str = "auto") -> str:
        """The target backend entry a Session on `backend` at `precision` opens: "onnx.int8" for the ONNX int8
        graph, "gguf.q8_0" for the q8_0 GGUF, else the backend's name."""
        if backend == "onnx" and precision != "auto":
            return onnx_entry_key(precision)
        if backend == "gguf":
            return gguf_entries(self.target.backends)[self.gguf_quant(precision)]
        return backend


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _backends(d: Dict[str, Any]) -> Dict[str, BackendFiles]:
    return {k: BackendFiles(files=tuple(v.get("files", ())), params=dict(v.get("params", {}))) for k, v in (d or {}).items()}


def _known_keys(manifest: str, where: str, d: Any, allowed: Tuple[str, ...]) -> Dict[str, Any]:
    """`d`, checked to be a mapping whose keys are all `allowed`; else a BundleError naming the key."""
    _mapping(manifest, where, d)
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise BundleError(f"{manifest}: {where + '.' if where else ''}{unknown[0]}: unknown key; expected one of "
                          f"{sorted(allowed)} (a typo, or a bundle from a newer edgespec); {REBUILD}")
    return d


def _mapping(manifest: str, where: str, d: Any, optional: bool = False) -> Dict[str, Any]:
    if optional and d is None:
        return {}
    if not isinstance(d, dict):
        raise BundleError(f"{manifest}: {where}: got {d!r}, expected a mapping; {REBUILD}")
    return d


def _check_keys(manifest: str, m: Dict[str, Any]) -> None:
    """Every key of the manifest is one this runtime reads (nothing is ignored silently)."""
    _known_keys(manifest, "", m, MANIFEST_KEYS)
    target = _known_keys(manifest, "target", m.get("target"), TARGET_KEYS)
    for kind, b in _mapping(manifest, "target.backends", target.get("backends"), True).items():
        _known_keys(manifest, f"target.backends.{kind}", b, BACKEND_KEYS)
    for name, d in _mapping(manifest, "drafters", m.get("drafters"), True).items():
        _known_keys(manifest, f"drafters.{name}", d, DRAFTER_KEYS)
        for kind, b in _mapping(manifest, f"drafters.{name}.backends", d.get("backends"), True).items():
            _known_keys(manifest, f"drafters.{name}.backends.{kind}", b, BACKEND_KEYS)
    for rel, e in _mapping(manifest, "files", m.get("files"), True).items():
        _known_keys(manifest, f"files.{rel}", e, FILE_KEYS)


def load(path: str, verify_checksums: bool = True) -> Bundle:
    """Read and check a bundle directory. Raises BundleError naming what is wrong and what to do."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise BundleError(f"{os.path.abspath(path)}: no such bundle directory; build one with `edgespec bundle "
                          "--target DIR --out DIR` (the zoo: `make bundles`)")
    if not os.access(path, os.R_OK | os.X_OK):  # else every file in it reads as "missing"
        raise BundleError(f"{os.path.abspath(path)}: cannot read this bundle directory (permission denied for this "
                          "user); give it read and search permission (chmod -R u+rX) or run as its owner")
    if not os.path.isfile(manifest):
        raise BundleError(f"{manifest}: missing; this directory is not a bundle ({REBUILD})")
    try:
        with open(manifest) as f:
            m = yaml.safe_load(f)
    except OSError as exc:
        raise BundleError(f"{manifest}: cannot read ({exc.strerror}); fix its permissions (chmod u+r)") from exc
    except yaml.YAMLError as exc:
        raise BundleError(f"{manifest}: not valid YAML ({exc}); {REBUILD}") from exc
    if not isinstance(m, dict):
        raise BundleError(f"{manifest}: expected a mapping at the top level")
    version = m.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise BundleError(f"{manifest}: format_version {version!r} is not supported by this runtime "
                          f"(expected {FORMAT_VERSION}); re-export the bundle with a matching edgespec")
    _check_keys(manifest, m)
    try:
        files = {p: FileEntry(p, e["sha256"], int(e["size"])) for p, e in (m.get("files") or {}).items()
                 if p != TUNE_FILE}  # an older export listed it: the tune is checked where it is read
        t = m["target"]
        target = TargetEntry(spec=ModelSpec.from_dict(t["spec"], f"{manifest}: target.spec"),
                             backends=_backends(t.get("backends")))
        drafters = {}
        for name, d in (m.get("drafters") or {}).items():
            if not isinstance(d.get("kind"), str) or not d["kind"]:
                raise BundleError(f"{manifest}: drafters.{name}.kind {d.get('kind')!r}: expected the drafter's kind "
                                  "(a name such as eagle3 or dflash)")
            drafters[name] = DrafterEntry(
                kind=d["kind"], files=tuple(d.get("files", ())), params=dict(d.get("params") or {}),
                target_taps=tuple(d.get("target_taps", ())),
                spec=ModelSpec.from_dict(d["spec"], f"{manifest}: drafters.{name}.spec") if d.get("spec") else None,
                backends=_backends(d.get("backends")))
        bundle = Bundle(root=path, name=str(m.get("name", os.path.basename(path))), target=target, drafters=drafters,
                        default_drafter=str(m.get("default_drafter", "none")), tokenizer=str(m["tokenizer"]),
                        generation=dict(m.get("generation") or {}), files=files, format_version=version,
                        chat_template_file=_chat_file(m.get("prompts")))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BundleError(f"{manifest}: malformed manifest ({exc!r}); {REBUILD}") from exc
    _check_files(bundle, verify_checksums)
    if m.get("prompts") is not None:  # read after the checksums: the chat template is one of the files
        bundle = replace(bundle, prompts=PromptFormat.from_dict(m["prompts"], f"{manifest}: prompts",
                                                                lambda rel: _read_text(bundle, rel)))
    _check_layers(bundle, manifest)
    return bundle


def _check_layers(bundle: Bundle, manifest: str) -> None:
    """The spec's num_layers matches the decoder layers its safetensors hold (read from the headers)."""
    models = [("target.spec", bundle.target.spec, bundle.target.backends.get("numpy_ref"))]
    models += [(f"drafters.{n}.spec", d.spec, BackendFiles(d.files)) for n, d in bundle.drafters.items()
               if d.kind == "draft_model" and d.spec is not None]
    for where, spec, files in models:
        names = [rel for rel in (files.files if files else ()) if rel.endswith(".safetensors")]
        if not names:
            continue
        layers = set()
        for rel in names:
            layers |= {int(m.group(1)) for m in map(LAYER_KEY.match, safetensors_dtypes(bundle.path(rel))) if m}
        if layers != set(range(spec.num_layers)):
            held = f"layers 0..{max(layers)}" if layers == set(range(len(layers))) else f"layers {sorted(layers)}"
            raise BundleError(f"{manifest}: {where}.num_layers is {spec.num_layers}, but {', '.join(names)} hold "
                              f"{held}; the manifest does not describe its files ({REBUILD})")


def _chat_file(prompts: Any) -> Optional[str]:
    """The chat template's file name, when the prompts section names one (from_dict checks the rest)."""
    rel = prompts.get("chat_template") if isinstance(prompts, dict) else None
    return rel if isinstance(rel, str) and rel else None


def _read_text(bundle: Bundle, rel: str) -> str:
    try:
        with open(bundle.path(rel), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{bundle.path(rel)}: cannot read the chat template ({exc}); {REBUILD}") from exc


def _referenced(bundle: Bundle):
    refs = [bundle.tokenizer] + ([bundle.chat_template_file] if bundle.chat_template_file else [])
    for b in bundle.target.backends.values():
        refs += b.files
    for d in bundle.drafters.values():
        refs += d.files
        for b in d.backends.values():
            refs += b.files
    return refs


def file_stamps(bundle: Bundle) -> Dict[str, Tuple[int, int]]:
    """(size, mtime in ns) of the manifest and each file it lists, as they are now ((-1, -1): missing)."""
    stamps = {}
    for rel in (MANIFEST, *bundle.files):
        try:
            st = os.stat(bundle.path(rel))
            stamps[rel] = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamps[rel] = (-1, -1)
    return stamps


def changed_files(bundle: Bundle, stamps: Dict[str, Tuple[int, int]]) -> List[str]:
    """The bundle's files that differ from `stamps` (taken when it was loaded), each with how.

    Example: ['bundle.yaml (modified)', 'target.safetensors (missing)']."""
    now = file_stamps(bundle)
    return [f"{rel} ({'missing' if now[rel][0] < 0 else 'modified'})" for rel in stamps if now.get(rel) != stamps[rel]]


def _check_files(bundle: Bundle, verify_checksums: bool) -> None:
    for rel in _referenced(bundle):
        if rel not in bundle.files:
            raise BundleError(f"{bundle.root}: {rel} is used but has no checksum in {MANIFEST}; {REBUILD}")
    root = os.path.realpath(bundle.root)
    for rel, entry in bundle.files.items():
        full = bundle.path(rel)
        if os.path.isabs(rel) or not os.path.realpath(full).startswith(root + os.sep):
            raise BundleError(f"{bundle.root}: manifest names {rel!r}, which lies outside the bundle; refusing it")
        if not rel.endswith(DATA_SUFFIXES):
            raise BundleError(f"{full}: not a data format edgespec loads (allowed: {', '.join(DATA_SUFFIXES)})")
        if not os.path.isfile(full):
            raise BundleError(f"{full}: missing from the bundle; copy the whole bundle directory again or re-export")
        size = os.path.getsize(full)
        if size != entry.size:
            raise BundleError(f"{full}: corrupt (size {size} bytes, manifest says {entry.size}); copy it again or re-export")
        try:
            digest = sha256_of(full) if verify_checksums else entry.sha256
        except OSError as exc:
            raise BundleError(f"{full}: cannot read ({exc.strerror}); fix its permissions (chmod u+r)") from exc
        if digest != entry.sha256:
            raise BundleError(f"{full}: corrupt (sha256 differs from the manifest); copy it again or re-export")


class BundleWriter:
    """Builds a bundle directory: add files, describe target/drafters, then `write()` the manifest."""

    def __init__(self, root: str, name: str):
        self.root = root
        self.name = name
        os.makedirs(root, exist_ok=True)
        self.manifest: Dict[str, Any] = {"format_version": FORMAT_VERSION, "name": name, "target": {"backends": {}},
                                         "drafters": {}, "default_drafter": "none", "generation": {}}

    @classmethod
    def extend(cls, root: str) -> "BundleWriter":
        """Open an existing bundle to add files (e.g. ONNX graphs for another backend)."""
        load(root)  # never re-checksum a file that is already corrupt
        writer = cls.__new__(cls)
        writer.root = root
        with open(os.path.join(root, MANIFEST)) as f:
            writer.manifest = yaml.safe_load(f)
        writer.name = writer.manifest.get("name", os.path.basename(root))
        return writer

    def path(self, rel: str) -> str:
        full = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return full

    def set_target(self, spec: ModelSpec) -> None:
        self.manifest["target"]["spec"] = spec.to_dict()

    def add_target_backend(self, kind: str, files, params: Optional[Dict[str, Any]] = None) -> None:
        self.manifest["target"]["backends"][kind] = {"files": list(files), "params": dict(params or {})}

    def add_drafter(self, name: str, kind: str, files=(), params=None, target_taps=(), spec: Optional[ModelSpec] = None,
                    default: bool = False) -> None:
        entry: Dict[str, Any] = {"kind": kind, "files": list(files), "params": dict(params or {}),
                                 "target_taps": list(target_taps)}
        if spec is not None:
            entry["spec"] = spec.to_dict()
        self.manifest["drafters"][name] = entry
        if default:
            self.manifest["default_drafter"] = name

    def add_drafter_backend(self, name: str, kind: str, files, params=None) -> None:
        self.manifest["drafters"][name].setdefault("backends", {})[kind] = {"files": list(files), "params": dict(params or {})}

    def set_tokenizer(self, rel: str) -> None:
        self.manifest["tokenizer"] = rel

    def set_prompts(self, fmt: PromptFormat) -> None:
        """Record the model's prompt format; its chat template becomes the file chat_template.jinja."""
        rel = None
        if fmt.chat_template:
            rel = "chat_template.jinja"
            write_atomically(self.path(rel), fmt.chat_template)  # replaced, never rewritten in place (hard links)
        self.manifest["prompts"] = fmt.to_dict(rel)

    def set_generation(self, **defaults: Any) -> None:
        self.manifest["generation"].update(defaults)

    def write(self) -> str:
        """Checksum every file under the root and write bundle.yaml. Returns the manifest path."""
        files = {}
        for dirpath, _, names in os.walk(self.root):
            for n in sorted(names):
                full = os.path.join(dirpath, n)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if rel in (MANIFEST, TUNE_FILE) or not rel.endswith(DATA_SUFFIXES):
                    continue  # only data formats belong to a bundle; stray files and the machine's tune stay unlisted
                files[rel] = {"sha256": sha256_of(full), "size": os.path.getsize(full)}
        self.manifest["files"] = dict(sorted(files.items()))
        out = os.path.join(self.root, MANIFEST)
        write_atomically(out, yaml.safe_dump(self.manifest, sort_keys=False, width=200))  # templates on one line
        return out


def update_target_backend_params(root: str, key: str, name: str, value: Any) -> str:
    """Set target.backends.<key>.params.<name> = value in the bundle at `root` and rewrite bundle.yaml
    atomically; every other key of the manifest stays as it was (no file is re-checksummed: only the
    manifest changes, and it is not one of the listed files). Returns the manifest path."""
    manifest = os.path.join(root, MANIFEST)
    load(root, verify_checksums=False)  # a manifest this runtime reads, with that backend
    with open(manifest) as f:
        m = yaml.safe_load(f)
    entry = (m["target"].get("backends") or {}).get(key)
    if entry is None:
        raise BundleError(f"{manifest}: target.backends has no {key!r} entry; it has "
                          f"{sorted(m['target'].get('backends') or {})}")
    if not os.access(root, os.W_OK):
        raise BundleError(f"{root}: not writable; profile a copy of the bundle to store what was measured")
    if not isinstance(entry.get("params"), dict):
        entry["params"] = {}
    entry["params"][name] = value
    write_atomically(manifest, yaml.safe_dump(m, sort_keys=False, width=200))
    return manifest


def current_umask() -> int:
    try:
        with open("/proc/self/status") as f:  # Linux: read without changing it
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)  # elsewhere the only way to read it is to set it (and put it back)
        os.umask(umask)
        return umask


def normal_file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file: 0o666 less the umask (0o644 under umask 022).
    Temporary files (tempfile.mkstemp) and onnx's external-data writer create theirs 0o600; a bundle's files
    get this mode instead, all alike, so that a copy to the robot's user (rsync -p) can read every one."""
    return 0o666 & ~current_umask()


def give_normal_mode(*paths: str) -> None:
    """chmod each file to `normal_file_mode()` (a file written by a library or through a temporary name)."""
    mode = normal_file_mode()
    for path in paths:
        os.chmod(path, mode)


def write_atomically(path: str, text: str) -> None:
    """Replace `path` by a new file holding `text`: written to a temporary file beside it, then renamed.
    A reader sees the old file or the new one, never half of one; and a hard link to the old file (a
    `cp -al` copy of the bundle) keeps the old content instead of being changed through the link."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        give_normal_mode(tmp)  # mkstemp made it 0o600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
