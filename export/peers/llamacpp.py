"""llama.cpp's own command-line tools as peers of `edgespec bench --peers`: plain decoding and its speculative
modes, run on the SAME GGUF files and prompt token ids as edgespec's gguf backend.

The tools are compiled once from the llama.cpp that the llama-cpp-python sdist vendors (the version edgespec's
gguf backend links), non-native with the flags scripts/bootstrap.sh uses for the Python binding (a -march=native
build enables AMX kernels that die with SIGILL on q8_0 here), and cached under `<cache>/llamacpp-tools/<key>/`,
keyed on the version and the flags, so a second run reuses them:

    tools = build_tools(cache_dir, log=print)          # {'llama-completion': path, ...} or PeerUnavailable
    argv = peer_command("llamacpp_draft", tools, target_gguf, prompt_ids, 64, draft_gguf=draft)
    stats = parse_output(stdout, stderr)               # tok/s, drafted/accepted, generated ids

Peers:
  llamacpp           `llama-completion`, greedy plain decoding (the baseline llama.cpp users run)
  llamacpp_draft     `llama-speculative-simple --spec-type draft-simple` with the bundle's draft model as GGUF
  llamacpp_ngram     `llama-speculative-simple --spec-type ngram-simple` (n-gram lookup in the context)
  llamacpp_eagle3    `--spec-type draft-eagle3` with the bundle's EAGLE-3 drafter, converted to llama.cpp's eagle3
                     GGUF by llama.cpp's own convert_hf_to_gguf.py (vendored), cached
  llamacpp_mtp / llamacpp_dflash
                     its MTP / DFlash modes: a row saying why they cannot run on our drafters
Workstation side (subprocesses and a compiler); the runtime never imports it."""
from __future__ import annotations

import glob
import re
import hashlib
import os
import shutil
import json
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from export.peers.base import Peer, PeerUnavailable, cut_at_eos

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# The same portable CPU flags as scripts/bootstrap.sh builds the Python binding with (x86-64).
CMAKE_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
X86_FLAGS = ("-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF")
BUILD_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON")
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-speculative")


def cmake_flags() -> List[str]:
    flags = list(CMAKE_FLAGS) + list(BUILD_FLAGS)
    if os.uname().machine == "x86_64":
        flags += list(X86_FLAGS)
    return flags


def tools_key(version: str = LLAMA_CPP_PYTHON_VERSION, flags: Optional[List[str]] = None) -> str:
    """The cache key of a build: the sdist version and the cmake flags.

    >>> tools_key("0.3.36", ["-DA=1"]) == tools_key("0.3.36", ["-DA=1"]) != tools_key("0.3.36", ["-DA=0"])
    True"""
    text = version + " " + " ".join(flags if flags is not None else cmake_flags())
    return f"{version}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def find_sdist(version: str = LLAMA_CPP_PYTHON_VERSION) -> Optional[str]:
    """A llama-cpp-python sdist of this version: in $EDGESPEC_LLAMA_CPP_SDIST, pip's unpack folders or the cache."""
    name = f"llama_cpp_python-{version}.tar.gz"
    env = os.environ.get("EDGESPEC_LLAMA_CPP_SDIST")
    candidates = ([env] if env else []) + sorted(glob.glob(os.path.join(tempfile.gettempdir(), "pip-unpack-*", name)))
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    return None


def vendored_source(cache_dir: str, log: Callable[[str], None] = print,
                    version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """The llama.cpp source tree the llama-cpp-python sdist vendors, unpacked (once) under the tools' cache."""
    root = os.path.abspath(os.path.join(cache_dir, "llamacpp-tools", tools_key(version)))
    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "src")
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        sdist = os.path.join(cache_dir, f"llama_cpp_python-{version}.tar.gz")
        if not os.path.isfile(sdist):
            found = find_sdist(version)
            if found is None:
                log(f"llama.cpp peers: downloading the llama-cpp-python {version} sdist (pip download)")
                res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", cache_dir,
                                      f"llama-cpp-python=={version}"], capture_output=True, text=True)
                if res.returncode != 0 or not os.path.isfile(sdist):
                    raise PeerUnavailable(f"no llama-cpp-python {version} sdist: pip download failed "
                                          f"({(res.stderr or res.stdout).strip().splitlines()[-1:]}); set "
                                          "EDGESPEC_LLAMA_CPP_SDIST=PATH to one")
            else:
                shutil.copyfile(found, sdist + ".tmp")
                os.replace(sdist + ".tmp", sdist)
        tmp = tempfile.mkdtemp(dir=root, prefix="unpack-")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
        shutil.rmtree(src, ignore_errors=True)
        os.replace(tmp, src)
    return src


def build_tools(cache_dir: str, log: Callable[[str], None] = print, jobs: int = 2,
                version: str = LLAMA_CPP_PYTHON_VERSION) -> Dict[str, str]:
    """llama.cpp's tools built (once) from the vendored source of the llama-cpp-python sdist; {name: path}.
    A missing compiler, sdist or a failed build raises PeerUnavailable naming the log."""
    key = tools_key(version)
    root = os.path.abspath(os.path.join(cache_dir, "llamacpp-tools", key))
    bin_dir = os.path.join(root, "bin")
    paths = {t: os.path.join(bin_dir, t) for t in TOOLS}
    if all(os.access(p, os.X_OK) for p in paths.values()):
        return paths
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"building llama.cpp's tools needs `{tool}` (apt-get install cmake g++)")
    src = vendored_source(cache_dir, log, version)
    build = os.path.join(root, "build")
    log_path = os.path.join(root, "build.log")
    log(f"llama.cpp peers: building {', '.join(TOOLS)} from llama-cpp-python {version}'s vendored llama.cpp "
        f"(non-native, -j{jobs}, about 6 min on 2 cores, once; log {log_path})")
    with open(log_path, "w") as out:
        steps = [["cmake", "-S", src, "-B", build] + cmake_flags(),
                 ["nice", "-n", "10", "cmake", "--build", build, "-j", str(jobs), "--target"] + list(TOOLS)]
        for cmd in steps:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerUnavailable(f"building llama.cpp's tools failed (log: {log_path})")
    os.makedirs(bin_dir, exist_ok=True)
    for t, p in paths.items():
        built = os.path.join(build, "bin", t)
        if not os.path.isfile(built):
            raise PeerUnavailable(f"building llama.cpp's tools left no {t} (log: {log_path})")
        shutil.copy2(built, p + ".tmp")
        os.replace(p + ".tmp", p)
    log(f"llama.cpp peers: tools ready in {bin_dir}")
    return paths


# --- EAGLE-3 in llama.cpp's own layout -------------------------------------------------------------------------

# Run inside a subprocess: llama.cpp's converter and the gguf-py it vendors (which knows the eagle3 architecture;
# the installed `gguf` may not). Only the vocabulary step is replaced, by edgespec's own writer of the target's
# vocabulary (export/gguf/writer.py), so that the draft's vocabulary is the target GGUF's token for token (llama.cpp
# checks that) and the converter's pre-tokenizer hash list, which does not know the zoo's, is not consulted.
_CONVERT_EAGLE3 = """
import sys
src, root, bundle_dir, eagle_dir, target_dir, out = sys.argv[1:7]
sys.path[:0] = [src + "/gguf-py", src, root]
import gguf
import convert_hf_to_gguf
from conversion.llama import LlamaModel
from export.gguf.writer import _add_tokenizer
from runtime.model import bundle
b = bundle.load(bundle_dir, verify_checksums=False)
LlamaModel.set_vocab = lambda self: _add_tokenizer(self.gguf_writer, gguf, b.path(b.tokenizer), b.target.spec)
sys.argv = ["convert_hf_to_gguf.py", eagle_dir, "--outfile", out, "--outtype", "f16", "--target-model-dir", target_dir]
convert_hf_to_gguf.main()
"""


def hf_config(spec, **extra) -> Dict[str, object]:
    """A Llama config.json for a ModelSpec (what llama.cpp's converter reads of it)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps,
            "rope_theta": spec.rope_theta, "max_position_embeddings": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings, **extra}


def eagle3_gguf(bundle_dir: str, cache_dir: str, log: Callable[[str], None] = print) -> str:
    """The bundle's EAGLE-3 drafter as llama.cpp's `eagle3` GGUF (f16), written by llama.cpp's own converter from
    an HF folder made of the bundle's safetensors and spec; cached on the drafter file's bytes. PeerUnavailable
    says why when the bundle has none or it is not a Llama-family one (the converter's EAGLE-3 path)."""
    from runtime.model import bundle as bundle_mod
    b = bundle_mod.load(bundle_dir, verify_checksums=False)
    entry = b.drafters.get("eagle3")
    if entry is None or entry.kind != "eagle3" or entry.spec is None:
        raise PeerUnavailable(f"{bundle_dir}: no eagle3 drafter (with a spec) in the bundle to convert")
    if b.target.spec.family != "llama" or entry.spec.family != "llama":
        raise PeerUnavailable("llama.cpp's converter writes EAGLE-3 GGUFs of Llama-family drafters only")
    weights = [f for f in entry.files if f.endswith(".safetensors")]
    h = hashlib.sha256(LLAMA_CPP_PYTHON_VERSION.encode())
    for f in weights + [b.tokenizer]:
        with open(b.path(f), "rb") as fh:
            h.update(fh.read())
    out_dir = os.path.abspath(os.path.join(cache_dir, "llamacpp-gguf", h.hexdigest()[:16]))
    out = os.path.join(out_dir, "eagle3.f16.gguf")
    if os.path.isfile(out):
        return out
    src = vendored_source(cache_dir, log)
    log("llama.cpp peers: converting the bundle's EAGLE-3 drafter with llama.cpp's convert_hf_to_gguf.py")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        eagle_dir, target_dir = os.path.join(tmp, "eagle3"), os.path.join(tmp, "target")
        os.makedirs(eagle_dir)
        os.makedirs(target_dir)
        p = entry.params
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                 "draft_vocab_size": int(p.get("draft_vocab_size", entry.spec.vocab_size)),
                 "eagle_aux_hidden_state_layer_ids": [int(i) for i in p.get("tap_layers", ())],
                 "target_hidden_size": b.target.spec.hidden_size,
                 "norm_before_residual": bool(p.get("norm_before_residual", False))}
        for name, d, cfg in (("eagle3", eagle_dir, hf_config(entry.spec, **extra)),
                             ("target", target_dir, hf_config(b.target.spec))):
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
        os.symlink(os.path.abspath(b.path(weights[0])), os.path.join(eagle_dir, "model.safetensors"))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        res = subprocess.run([sys.executable, "-c", _CONVERT_EAGLE3, src, root, os.path.abspath(bundle_dir),
                              eagle_dir, target_dir, out + ".tmp"], capture_output=True, text=True)
        if res.returncode != 0 or not os.path.isfile(out + ".tmp"):
            tail = " / ".join((res.stderr or res.stdout).strip().splitlines()[-2:])[:300]
            raise PeerUnavailable(f"llama.cpp's converter could not write the EAGLE-3 drafter: {tail}")
        os.replace(out + ".tmp", out)
    return out


# --- the peers -------------------------------------------------------------------------------------------------

DRAFT_N_MAX = 3  # llama.cpp's own default for --spec-draft-n-max (common/common.h), p_min 0 (greedy)
NGRAM_SIZE_N, NGRAM_SIZE_M = 3, 4  # lookup n-gram / drafted m-gram, as the ngram drafter and ORT-GenAI peer use
SPEC_TYPES = {"llamacpp": None, "llamacpp_draft": "draft-simple", "llamacpp_ngram": "ngram-simple",
              "llamacpp_eagle3": "draft-eagle3"}
# llama.cpp's other speculative modes read drafters in layouts of their own; ours are not written in them.
UNSUPPORTED = {
    "llamacpp_mtp": "llama.cpp's draft-mtp runs the NextN/MTP layers stored inside the target GGUF of the "
                    "architectures that have them (DeepSeek/GLM/Qwen3-Next style blk.N.nextn.*); a Llama target "
                    "has no such layers in llama.cpp, so edgespec's MTP head travels as sidecar safetensors",
    "llamacpp_dflash": "not run: the zoo bundles hold no DFlash drafter. edgespec's DFlash drafter keeps z-lab's "
                       "layout, which llama.cpp's converter (DFlashModel, Qwen3-style draft) reads, so a bundle with "
                       "one could be converted as EAGLE-3 is; that path is not written or checked yet",
}
RUN_ATTEMPTS = 8  # see LlamaCppPeer.generate: a run whose last log lines were lost
PEER_NAMES = tuple(SPEC_TYPES) + tuple(UNSUPPORTED)
LABELS = {"llamacpp": "llama.cpp plain", "llamacpp_draft": f"llama.cpp draft k={DRAFT_N_MAX}",
          "llamacpp_ngram": f"llama.cpp ngram {NGRAM_SIZE_N}/{NGRAM_SIZE_M}",
          "llamacpp_eagle3": f"llama.cpp eagle3 k={DRAFT_N_MAX}"}


def peer_command(name: str, tools: Dict[str, str], target_gguf: str, prompt_text: str, max_tokens: int,
                 draft_gguf: Optional[str] = None, threads: int = 0, ctx: int = 2048) -> List[str]:
    """The argv of one greedy generation of `max_tokens` tokens by the named llama.cpp peer.

    Flash attention off and the thread count given (both slow llama.cpp down on this CPU when left to auto);
    llama-speculative-simple stops once it holds MORE than -n tokens, so it is asked for one fewer."""
    if name not in SPEC_TYPES:
        raise PeerUnavailable(UNSUPPORTED.get(name, f"unknown llama.cpp peer {name!r}"))
    common = ["-m", target_gguf, "-p", prompt_text, "-c", str(ctx), "-b", str(ctx), "-ub", str(ctx),
              "-t", str(threads or os.cpu_count() or 1), "-fa", "off", "--temp", "0", "--top-k", "1",
              "--seed", "0", "-ngl", "0", "--no-escape"]
    spec = SPEC_TYPES[name]
    if spec is None:
        return [tools["llama-completion"], *common, "-n", str(max_tokens), "-no-cnv", "--no-display-prompt", "-sp",
                "--simple-io", "--no-warmup"]
    argv = [tools["llama-speculative-simple"], *common, "-n", str(max(max_tokens - 1, 0)), "--spec-type", spec]
    if spec.startswith("draft-"):
        if not draft_gguf:
            raise PeerUnavailable(f"llama.cpp {spec} needs its drafter as GGUF (edgespec export --to gguf writes the "
                                  "draft model's; the EAGLE-3 one is converted from the bundle by llama.cpp's "
                                  "converter)")
        argv += ["-md", draft_gguf, "--spec-draft-n-max", str(DRAFT_N_MAX), "--spec-draft-p-min", "0",
                 "-td", str(threads or os.cpu_count() or 1), "--spec-draft-ngl", "0"]
    else:
        argv += ["--spec-ngram-simple-size-n", str(NGRAM_SIZE_N), "--spec-ngram-simple-size-m", str(NGRAM_SIZE_M),
                 "--spec-draft-n-max", str(NGRAM_SIZE_M)]
    return argv


_NUM = r"([0-9]+(?:\.[0-9]+)?)"


def parse_output(stdout: bytes, stderr: str, prompt_text: bytes, speculative: bool) -> Tuple[bytes, Dict[str, float]]:
    """(the generated text, {stat: value}) from a llama.cpp tool's output: stdout carries the text (after the
    echoed prompt for llama-speculative-simple), stderr its own timings and draft tallies. Stats:
    wall_s (its measured prompt + generation time, model load and warm-up excluded), drafted, accepted,
    cycles (target forwards after the prompt), tokens. A missing timing raises ValueError."""
    stats: Dict[str, float] = {}
    if speculative:
        head = b"\n\n" + prompt_text
        if not stdout.startswith(head):
            raise ValueError("llama-speculative-simple did not echo the prompt as sent")
        text = stdout[len(head):]
        for _ in range(2):  # two "\n\n" after the generation (end of decoding, end of program)
            text = text[:-2] if text.endswith(b"\n\n") else text
        enc = re.search(rf"encoded\s+([0-9]+) tokens in\s+{_NUM} seconds", stderr)
        dec = re.search(rf"decoded\s+([0-9]+) tokens in\s+{_NUM} seconds", stderr)
        if not (enc and dec):
            raise ValueError("llama-speculative-simple printed no encoded/decoded timings")
        stats["wall_s"] = float(enc.group(2)) + float(dec.group(2))
        tallies = {k: re.search(rf"\bn_{k}\s*=\s*([0-9]+)", stderr) for k in ("predict", "drafted", "accept")}
        if all(tallies.values()):
            n = {k: int(m.group(1)) for k, m in tallies.items()}
            stats.update(tokens=n["predict"], drafted=n["drafted"], accepted=n["accept"],
                         cycles=n["predict"] - n["accept"])
        return text, stats
    times = {}
    for key, pat in (("prompt", r"prompt eval time\s*=\s*"), ("eval", r"\beval time\s*=\s*"),
                     ("sampling", r"sampling time\s*=\s*")):
        m = [x for x in re.finditer(pat + _NUM + r" ms", stderr)
             if key != "eval" or "prompt" not in stderr[max(0, x.start() - 8):x.start()]]
        if m:
            times[key] = float(m[-1].group(1)) / 1e3
    if "prompt" not in times or "eval" not in times:
        raise ValueError("llama-completion printed no prompt eval / eval timings")
    stats["wall_s"] = sum(times.values())
    text = stdout[:-2] if stdout.endswith(b"\n\n") else stdout  # printed once at the end, after the generation
    end = b" [end of text]\n"  # llama-completion's note that the model emitted EOS (not the model's text)
    return (text[:-len(end)] if text.endswith(end) else text), stats


class GgufVocab:
    """The GGUF's own vocabulary through llama-cpp-python (the llama.cpp these tools are built from): token ids
    to the text the tools print, and text to ids as the tools tokenise a prompt (special tokens parsed)."""

    def __init__(self, gguf_path: str):
        try:
            import llama_cpp
        except ImportError as exc:
            raise PeerUnavailable(f"llama-cpp-python is not installed ({exc}); scripts/bootstrap.sh llama_cpp")
        self.ll = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), params)
        if not self.model:
            raise PeerUnavailable(f"{gguf_path}: llama.cpp could not read this GGUF")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def text(self, ids: Sequence[int]) -> bytes:
        import ctypes
        buf, out = ctypes.create_string_buffer(512), []
        for t in ids:
            n = self.ll.llama_token_to_piece(self.vocab, int(t), buf, len(buf), 0, True)
            out.append(buf.raw[:max(n, 0)])
        return b"".join(out)

    def tokenize(self, text: bytes) -> List[int]:
        cap = len(text) + 16
        arr = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(self.vocab, text, len(text), arr, cap, True, True)
        return list(arr[:n]) if n >= 0 else []

    def close(self) -> None:
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None


class LlamaCppPeer(Peer):
    """One of llama.cpp's tools run as a subprocess per generation on the bundle's GGUF files. The prompt goes
    in as text that llama.cpp tokenises back to exactly edgespec's prompt ids (checked per prompt); the printed
    generation is tokenised the same way. Timed by llama.cpp's own printed prompt + generation times."""

    def __init__(self, name: str, models, cache_dir: str, log: Callable[[str], None] = print):
        if name in UNSUPPORTED:
            raise PeerUnavailable(UNSUPPORTED[name])
        target = getattr(models, "gguf_target", None)
        if not target or not os.path.isfile(target):
            raise PeerUnavailable("the llama.cpp peers run on the bundle's GGUF files: export them (edgespec export "
                                  "--to gguf --bundle DIR) and bench with --backend gguf")
        self.name, self.label = name, LABELS[name]
        self.target, self.draft = target, getattr(models, "gguf_draft", None)
        self.eos = list(models.eos_ids)
        self.threads = int(getattr(models, "threads", 0) or 0)
        self.tools = build_tools(cache_dir, log=log)
        if name == "llamacpp_eagle3":
            self.draft = eagle3_gguf(os.path.dirname(os.path.dirname(os.path.abspath(target))), cache_dir, log)
        peer_command(name, self.tools, target, "", 1, draft_gguf=self.draft)  # a missing draft GGUF fails here
        self.vocab = GgufVocab(target)
        self.drafted = self.accepted = 0

    def accept_rate(self) -> Optional[float]:
        """llama.cpp's printed acceptance (accepted / drafted tokens) over every generation so far."""
        return self.accepted / self.drafted if self.drafted else None

    def generate(self, prompt_ids, max_tokens):
        text = self.vocab.text(prompt_ids)
        if self.vocab.tokenize(text) != [int(t) for t in prompt_ids]:
            raise RuntimeError("llama.cpp tokenises this prompt's text to other ids than edgespec's; the peer "
                               "cannot be given the same prompt")
        argv = peer_command(self.name, self.tools, self.target, text.decode("utf-8", "surrogateescape"),
                            max_tokens, draft_gguf=self.draft, threads=self.threads)
        for attempt in range(RUN_ATTEMPTS):
            res = subprocess.run(argv, capture_output=True, timeout=600)
            stderr = res.stderr.decode("utf-8", "replace")
            if res.returncode != 0:
                raise RuntimeError(f"{os.path.basename(argv[0])} exited with {res.returncode}: "
                                   f"{' / '.join(stderr.strip().splitlines()[-2:])[:300]}")
            try:
                out, stats = parse_output(res.stdout, stderr, text, SPEC_TYPES[self.name] is not None)
                break
            except ValueError:
                # llama.cpp's logger is a thread its tools do not flush at exit (it says so in common/log.cpp),
                # so on a loaded machine the last lines (timings) can be lost: run again.
                if attempt == RUN_ATTEMPTS - 1:
                    raise
        full = self.vocab.tokenize(text + out)
        if full[:len(prompt_ids)] != [int(t) for t in prompt_ids]:
            raise RuntimeError("llama.cpp's printed output does not tokenise back onto the prompt")
        ids = cut_at_eos(full[len(prompt_ids):], self.eos)[:max_tokens]
        made = int(stats.get("tokens", 0))
        if made > len(ids) > 0:  # it verified past -n (a whole draft accepted at the end): time the tokens kept
            stats["wall_s"] *= len(ids) / made
        self.drafted += int(stats.get("drafted", 0))
        self.accepted += int(stats.get("accepted", 0))
        return ids, stats

    def close(self) -> None:
        if getattr(self, "vocab", None) is not None:
            self.vocab.close()
