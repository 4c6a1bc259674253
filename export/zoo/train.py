"""`edgespec zoo build`: data -> tokenizer -> target (+MTP aux loss) -> draft (distilled) -> HF dirs + MANIFEST.

Every stage is deterministic from the seed. Training state is checkpointed to <out>/_work every few minutes;
`--resume` continues an interrupted build from its last checkpoint (a finished stage is not redone).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from export.training import lr_at, save_checkpoint
from export.zoo.action_data import action_text, split_actions
from export.zoo.loss_weights import ValueMarkers, prompt_and_answer, token_weights, value_mask
from export.zoo.model import LlamaConfig, LlamaLM, load_hf, save_hf
from export.zoo.planner_data import split_planner
from export.zoo.text_data import load_works, split_text, training_corpus
from export.zoo.tokenizer import strip_specials, train_tokenizer
from runtime.text.prompts import BOS, EOS, TEXT

DOMAINS = ("planner", "action", "text")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO_ROOT, "zoo")
# The extracted Shakespeare texts are shared by every build (quick builds reuse what a full build fetched).
TEXT_CACHE = os.environ.get("EDGESPEC_ZOO_CACHE", os.path.join(DEFAULT_OUT, "_work"))
IGNORE = -100


@dataclass(frozen=True)
class BuildConfig:
    seed: int = 1234
    vocab_size: int = 3072
    n_planner: int = 50000
    n_action: int = 20000
    n_text: int = 6000
    n_heldout: int = 300  # per domain (text: a third of it)
    token_mix: Tuple[float, float, float] = (0.65, 0.25, 0.10)  # planner, action, text share of trained tokens
    seq_len: int = 256
    batch: int = 8
    target: LlamaConfig = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      num_nextn_predict_layers=1)
    draft: LlamaConfig = LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=6, num_key_value_heads=3, head_dim=32)
    # Steps are capped twice: by a count and by a wall-clock budget (the CPU is shared, so its speed varies);
    # the LR schedule follows whichever is further along, and the manifest records the steps actually run.
    target_steps: int = 4000
    draft_steps: int = 2500
    target_budget_s: float = 44 * 60
    draft_budget_s: float = 9 * 60
    lr: float = 2e-3
    draft_lr: float = 3e-3
    mtp_weight: float = 0.3
    # Loss weight of prompt tokens (up to and including SEP) relative to answer tokens; prose (no SEP) is all
    # answer. The prompts are given at inference, so capacity goes to the answers, above all to copying.
    prompt_weight: float = 0.3
    # Loss weight of the argument values of a plan (objects, rooms, people, counts: the tokens copied from the
    # instruction) and of the EOS that ends an answer. At weight 1 a half-hour build learned the plan syntax but
    # matched 2 % of the held-out objects.
    value_weight: float = 4.0
    warmup: int = 60
    checkpoint_every_s: float = 180.0
    report_examples: int = 200
    threads: int = 2


FULL = BuildConfig()
QUICK = replace(
    FULL, vocab_size=800, n_planner=600, n_action=600, n_text=150, n_heldout=40, seq_len=128, batch=4,
    target=replace(FULL.target, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1),
    draft=replace(FULL.draft, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1),
    target_steps=30, draft_steps=20, target_budget_s=60.0, draft_budget_s=30.0, warmup=5, checkpoint_every_s=20.0, report_examples=8)


def log(msg: str) -> None:
    print(f"[zoo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- data ---------------------------------------------------------------------------------------------------------

def build_data(cfg: BuildConfig, work: str, quick: bool):
    """Generate the three domains, train the tokenizer, tokenize; cached in work/data.npz + work/tokenizer.json."""
    tok_path = os.path.join(work, "tokenizer.json")
    data_path = os.path.join(work, "data.npz")
    from tokenizers import Tokenizer

    if os.path.exists(tok_path) and os.path.exists(data_path):
        z = np.load(data_path, allow_pickle=True)
        return Tokenizer.from_file(tok_path), {k: list(z[k]) for k in z.files}
    t0 = time.time()
    plan_tr, plan_he = split_planner(cfg.seed, cfg.n_planner, cfg.n_heldout)
    act_tr, act_he = split_actions(cfg.seed, cfg.n_action, cfg.n_heldout)
    works = load_works(TEXT_CACHE, quiet=False, allow_fallback=quick)
    text_tr, text_he = split_text(works, cfg.seed, cfg.n_text, max(cfg.n_heldout // 3, 4))
    log(f"generated data in {time.time() - t0:.0f}s: planner {len(plan_tr)}+{len(plan_he)}, "
        f"action {len(act_tr)}+{len(act_he)}, text {len(text_tr)}+{len(text_he)} passages")
    texts = {
        "planner_train": [e.text for e in plan_tr], "planner_heldout": [e.text for e in plan_he],
        "action_train": [action_text(e) for e in act_tr], "action_heldout": [action_text(e) for e in act_he],
        "text_train": [f"{BOS}{TEXT}{x}{EOS}" for x in text_tr], "text_heldout": [f"{BOS}{TEXT}{x}{EOS}" for x in text_he],
    }
    corpus = ([strip_specials(x) for x in texts["planner_train"][:5000]]
              + [strip_specials(x) for x in texts["action_train"][:5000]] + [training_corpus(works)])
    tok = train_tokenizer(corpus, cfg.vocab_size)
    tok.save(tok_path)
    data = {k: [np.asarray(e.ids, dtype=np.int16) for e in tok.encode_batch(v)] for k, v in texts.items()}
    arrays = {k: np.array(v, dtype=object) for k, v in data.items()}
    np.savez(data_path, **arrays)
    # The held-out prompts/answers for the quality report, in plain JSON (kept with the work files).
    with open(os.path.join(work, "heldout.json"), "w") as f:
        json.dump({"planner": [{"instruction": e.instruction, "context": e.context, "plan": list(e.plan)}
                               for e in plan_he],
                   "action": [{"instruction": e.instruction, "observation": list(e.observation),
                               "actions": [list(a) for a in e.actions]} for e in act_he]}, f)
    log(f"tokenizer ({tok.get_vocab_size()} tokens) and tokenized data ready in {time.time() - t0:.0f}s")
    return tok, data


class Batcher:
    """Packs examples into full rows of seq_len+1 tokens (the last one cut); batch i is a pure function of (seed, i)."""

    def __init__(self, data: Dict[str, list], cfg: BuildConfig):
        self.pools = [data[f"{d}_train"] for d in DOMAINS]
        mean_len = [np.mean([len(x) for x in p]) for p in self.pools]
        w = np.array(cfg.token_mix) / np.array(mean_len)  # example probabilities giving the token mix
        self.p = w / w.sum()
        self.cfg = cfg

    def batch(self, i: int):
        """-> ids (B, T+1), doc (B, T+1) document index (-1 = pad), dom (B, T+1) domain index."""
        rng = np.random.default_rng([self.cfg.seed, i])
        B, T1 = self.cfg.batch, self.cfg.seq_len + 1
        ids = np.zeros((B, T1), np.int64)
        doc = np.full((B, T1), -1, np.int64)
        dom = np.zeros((B, T1), np.int64)
        for b in range(B):
            pos, n = 0, 0
            while pos < T1:
                d = rng.choice(3, p=self.p)
                x = self.pools[d][rng.integers(len(self.pools[d]))][:T1]
                # The last example is cut at the row's end (no padding): a cut example still trains its prefix,
                # and keeping examples whole left a quarter of every row as padding.
                x = x[:T1 - pos]
                ids[b, pos:pos + len(x)] = x
                doc[b, pos:pos + len(x)] = n
                dom[b, pos:pos + len(x)] = d
                pos += len(x)
                n += 1
        return torch.from_numpy(ids), torch.from_numpy(doc), torch.from_numpy(dom)


def packed_inputs(ids, doc):
    """Rows (B, T+1) -> (x, positions, mask, labels, mtp_labels) for block-diagonal causal training.

    Padding is its own 'document' (id B*T-ish), so no query row is fully masked."""
    B, T1 = ids.shape
    T = T1 - 1
    d = doc.clone()
    d[d < 0] = 10_000  # padding attends to padding only
    x, dx = ids[:, :T], d[:, :T]
    same = dx[:, :, None] == dx[:, None, :]  # (B, T, T)
    mask = (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]  # (B, 1, T, T)
    start = torch.zeros_like(dx, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = dx[:, 1:] != dx[:, :-1]
    idx = torch.arange(T).expand(B, T)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    positions = idx - first  # (B, T) restarts at 0 at each document
    valid_next = (d[:, 1:] == d[:, :-1]) & (doc[:, 1:] >= 0)
    labels = torch.where(valid_next, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))  # (B, T)
    valid2 = (d[:, 2:] == d[:, :-2]) & (doc[:, 2:] >= 0)
    mtp_labels = torch.where(valid2, ids[:, 2:], torch.full_like(ids[:, 2:], IGNORE))  # (B, T-1)
    return x, positions, mask, labels, mtp_labels


def make_optimizer(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


# ---- training loops -------------------------------------------------------------------------------------------------

class ThreadTuner:
    """Picks the faster of 1..max threads by timing a few steps with each, at the start and then periodically.

    On a shared CPU, 2 OpenMP threads can be ten times slower than 1 (every op waits at its barrier for a
    descheduled thread); on an idle one they are nearly twice as fast. A probe costs the loser's slow steps, so
    when one option loses clearly the interval between probes doubles. Only the speed changes, not the maths."""

    def __init__(self, max_threads: int, start_step: int, probe: int = 4, every: int = 100):
        self.options = list(range(1, max_threads + 1))
        self.probe, self.every, self.base_every = probe, every, every
        self.best_time = float("inf")
        self.recent: List[float] = []
        self.next_probe = start_step
        self.best = max_threads
        self.times: Dict[int, List[float]] = {}

    def _slot(self, step: int):
        i = (step - self.next_probe) // self.probe
        return self.options[i] if len(self.options) > 1 and 0 <= i < len(self.options) else None

    def before(self, step: int) -> None:
        n = self._slot(step)
        torch.set_num_threads(n if n is not None else self.best)

    def after(self, step: int, seconds: float) -> None:
        n = self._slot(step)
        if n is None:
            self.recent = (self.recent + [seconds])[-5:]
            if len(self.recent) == 5 and np.median(self.recent) > 2 * self.best_time and step + 1 < self.next_probe:
                self.every, self.next_probe, self.recent = self.base_every, step + 1, []  # the load changed
            return
        self.times.setdefault(n, []).append(seconds)
        if step == self.next_probe + len(self.options) * self.probe - 1:
            med = {k: float(np.median(v)) for k, v in self.times.items()}  # medians: skip one-off costs
            self.best = min(med, key=med.get)
            self.best_time = med[self.best]
            if max(med.values()) > 1.5 * med[self.best]:
                self.every *= 2
            self.next_probe = step + 1 + self.every
            log("threads: " + ", ".join(f"{k}: {v:.2f}s/step" for k, v in sorted(med.items()))
                + f" -> using {self.best}, next probe at step {self.next_probe}")
            self.times = {}


def _train_loop(name: str, model, steps: int, budget_s: float, peak_lr: float, cfg: BuildConfig,
                batcher: Batcher, ckpt: str, resume: bool, loss_fn) -> Tuple[float, int]:
    """Train until `steps` or `budget_s` of training time, whichever comes first -> (seconds, steps run)."""
    opt = make_optimizer(model, peak_lr)
    start, elapsed = 0, 0.0
    if resume and os.path.exists(ckpt):
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, elapsed = st["step"], st["elapsed"]
        log(f"{name}: resumed at step {start} ({elapsed / 60:.1f} min already trained)")
        if st.get("finished"):
            return elapsed, start
    model.train()
    t_last_ckpt = time.time()
    t0, tokens0 = time.time(), 0
    running = {d: [] for d in DOMAINS}
    step, finished = start, False
    tuner = ThreadTuner(cfg.threads, start)
    while not finished:
        tuner.before(step)
        t_step = time.time()
        progress = max(step / steps, (elapsed + time.time() - t0) / budget_s)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, peak_lr, cfg.warmup)
        ids, doc, dom = batcher.batch(step)
        loss, extra, tok_losses, labels = loss_fn(model, ids, doc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            valid = labels != IGNORE
            for i, d in enumerate(DOMAINS):
                m = valid & (dom[:, :-1] == i)
                if m.any():
                    running[d].append(float(tok_losses[m].mean()))
        tokens0 += int((doc[:, :-1] >= 0).sum())
        now = time.time()
        tuner.after(step, now - t_step)
        done = step + 1 - start
        progress = max((step + 1) / steps, (elapsed + now - t0) / budget_s)
        finished = progress >= 1.0
        if step % 10 == 0 or finished:
            rate = tokens0 / (now - t0)
            eta = min((now - t0) / done * (steps - step - 1), budget_s - elapsed - (now - t0))
            log(f"{name} step {step + 1} ({progress:.0%}) loss {loss.item():.3f}{extra} lr {opt.param_groups[0]['lr']:.2e} "
                f"{rate:.0f} tok/s elapsed {(elapsed + now - t0) / 60:.1f} min ETA {eta / 60:.1f} min")
        if (step + 1) % 100 == 0:
            log(f"{name} train loss by domain (last 100 steps): "
                + " ".join(f"{d} {np.mean(v[-100:]):.3f}" for d, v in running.items() if v))
        if now - t_last_ckpt > cfg.checkpoint_every_s or finished:
            save_checkpoint(ckpt, model=model.state_dict(), opt=opt.state_dict(), step=step + 1,
                       elapsed=elapsed + now - t0, finished=finished)
            t_last_ckpt = now
        step += 1
    return elapsed + time.time() - t0, step


def target_loss(mtp_weight: float, weigh):
    """`weigh(ids, doc)` -> (B, T+1) loss weight of each token as a label (see loss_weights.token_weights)."""
    def fn(model, ids, doc):
        x, pos, mask, labels, mtp_labels = packed_inputs(ids, doc)
        w = weigh(ids, doc)  # (B, T+1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, h = model(x, pos, mask)
            T = x.shape[1]
            mlog = model.mtp_logits(h[:, :T - 1], x[:, 1:T], pos[:, :T - 1], mask[:, :, :T - 1, :T - 1])
        tok = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                              reduction="none").view_as(labels)
        valid, w1 = labels != IGNORE, w[:, 1:]
        main = (tok * w1)[valid].sum() / w1[valid].sum()
        mtok = F.cross_entropy(mlog.float().flatten(0, 1), mtp_labels.flatten(), ignore_index=IGNORE,
                               reduction="none").view_as(mtp_labels)
        valid2, w2 = mtp_labels != IGNORE, w[:, 2:]
        mtp = (mtok * w2)[valid2].sum() / w2[valid2].sum()
        return main + mtp_weight * mtp, f" (next {main.item():.3f} mtp {mtp.item():.3f})", tok.detach(), labels
    return fn


def draft_loss(target: LlamaLM, weigh):
    def fn(model, ids, doc):
        x, pos, mask, labels, _ = packed_inputs(ids, doc)
        w = weigh(ids, doc)[:, 1:]  # (B, T)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            t_logits, _ = target(x, pos, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = model(x, pos, mask)
        valid = labels != IGNORE
        logp = F.log_softmax(logits.float()[valid], -1)  # (n, V)
        p_t = F.softmax(t_logits.float()[valid], -1)
        kl_tok = (p_t * (torch.log(p_t.clamp_min(1e-9)) - logp)).sum(-1)  # (n,) KL(target || draft)
        kl = (kl_tok * w[valid]).sum() / w[valid].sum()
        tok = torch.zeros_like(labels, dtype=torch.float32)
        tok[valid] = F.nll_loss(logp, labels[valid], reduction="none").detach()
        return kl, f" (kl {kl.item():.3f} ce {tok[valid].mean().item():.3f})", tok, labels
    return fn


# ---- evaluation ---------------------------------------------------------------------------------------------------

def _pad(seqs: List[np.ndarray]):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    valid = torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
        valid[i, :len(s)] = True
    return ids, valid


@torch.no_grad()
def heldout_metrics(target: LlamaLM, draft: Optional[LlamaLM], data: Dict[str, list], limit: int = 200,
                    batch: int = 16, markers: Optional[ValueMarkers] = None) -> Dict[str, Dict[str, float]]:
    """Per domain: target next-token loss, MTP loss (x_{t+2}), MTP top-1 agreement with the target's own next-next
    prediction, draft loss and draft top-1 agreement with the target (teacher-forced on held-out examples).
    With `markers`, planner also gets `args_acc`: the target's top-1 accuracy on the argument values of the plans
    (the tokens copied from the instruction)."""
    out = {}
    for d in DOMAINS:
        seqs = data[f"{d}_heldout"][:limit]
        acc = {k: [0.0, 0] for k in ("loss", "mtp_loss", "mtp_agree", "draft_loss", "draft_agree", "args_acc")}
        for i in range(0, len(seqs), batch):
            ids, valid = _pad(seqs[i:i + batch])
            logits, h = target(ids)
            lab = torch.where(valid[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
            m = lab != IGNORE
            l = F.cross_entropy(logits[:, :-1].flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
            acc["loss"][0] += l.item(); acc["loss"][1] += int(m.sum())
            t_arg = logits.argmax(-1)  # (B, L)
            if markers is not None and d == "planner":
                _, answer = prompt_and_answer(ids, torch.where(valid, 0, -1))  # one document per row
                args = (value_mask(ids, markers) & answer)[:, 1:] & m
                acc["args_acc"][0] += int(((t_arg[:, :-1] == ids[:, 1:]) & args).sum())
                acc["args_acc"][1] += int(args.sum())
            if target.mtp is not None and ids.shape[1] > 2:
                ml = target.mtp_logits(h[:, :-2], ids[:, 1:-1])  # predicts x_{t+2}
                lab2 = torch.where(valid[:, 2:], ids[:, 2:], torch.full_like(ids[:, 2:], IGNORE))
                m2 = lab2 != IGNORE
                acc["mtp_loss"][0] += F.cross_entropy(ml.flatten(0, 1), lab2.flatten(), ignore_index=IGNORE,
                                                      reduction="sum").item()
                acc["mtp_loss"][1] += int(m2.sum())
                agree = (ml.argmax(-1) == t_arg[:, 1:-1]) & m2  # target's argmax at t+1 = its next-next token
                acc["mtp_agree"][0] += int(agree.sum()); acc["mtp_agree"][1] += int(m2.sum())
            if draft is not None:
                dl, _ = draft(ids)
                acc["draft_loss"][0] += F.cross_entropy(dl[:, :-1].flatten(0, 1), lab.flatten(),
                                                        ignore_index=IGNORE, reduction="sum").item()
                acc["draft_loss"][1] += int(m.sum())
                agree = (dl[:, :-1].argmax(-1) == t_arg[:, :-1]) & m
                acc["draft_agree"][0] += int(agree.sum()); acc["draft_agree"][1] += int(m.sum())
        out[d] = {k: round(s / n, 4) for k, (s, n) in acc.items() if n}
    return out


# ---- the build ----------------------------------------------------------------------------------------------------

def build(out: str, quick: bool = False, resume: bool = False, command: str = "edgespec zoo build") -> dict:
    """Train the zoo into `out` and write its MANIFEST; the quality report (export/zoo/report.py) is the CLI's
    next step, so that the report may read this module's held-out sets without a circle."""
    cfg = QUICK if quick else FULL
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = os.path.join(out, "_work")
    if not resume and os.path.isdir(work):
        for name in ("target.pt", "draft.pt", "data.npz", "tokenizer.json", "heldout.json", "times.json"):
            if os.path.exists(os.path.join(work, name)):
                os.remove(os.path.join(work, name))
    os.makedirs(work, exist_ok=True)
    times_path = os.path.join(work, "times.json")
    times = json.load(open(times_path)) if resume and os.path.exists(times_path) else {}
    log(f"building the {'QUICK (toy) ' if quick else ''}zoo into {out} (seed {cfg.seed}, "
        f"{'resuming' if resume else 'fresh'})")

    t = time.time()
    tok, data = build_data(cfg, work, quick)
    times.setdefault("data_and_tokenizer_s", round(time.time() - t, 1))
    json.dump(times, open(times_path, "w"))
    tcfg = replace(cfg.target, vocab_size=tok.get_vocab_size())
    dcfg = replace(cfg.draft, vocab_size=tok.get_vocab_size())
    batcher = Batcher(data, cfg)
    markers = ValueMarkers.from_tokenizer(tok)

    def weigh(ids, doc):
        return token_weights(ids, doc, cfg.prompt_weight, cfg.value_weight, markers)

    tok_path = os.path.join(work, "tokenizer.json")

    torch.manual_seed(cfg.seed)
    target = LlamaLM(tcfg)
    log(f"target: {target.num_params(False) / 1e6:.2f}M params + MTP {(target.num_params() - target.num_params(False)) / 1e6:.2f}M; "
        f"up to {cfg.target_steps} steps of {cfg.batch}x{cfg.seq_len} tokens or {cfg.target_budget_s / 60:.0f} min")
    secs, steps = _train_loop("target", target, cfg.target_steps, cfg.target_budget_s, cfg.lr, cfg, batcher,
                              os.path.join(work, "target.pt"), resume,
                              target_loss(cfg.mtp_weight, weigh))
    times["target_train_s"], steps_run = round(secs, 1), {"target": steps}
    json.dump(times, open(times_path, "w"))
    target.eval()
    save_hf(target, os.path.join(out, "target"), tok_path)

    torch.manual_seed(cfg.seed + 1)
    draft = LlamaLM(dcfg)
    log(f"draft: {draft.num_params() / 1e6:.2f}M params, distilled from the target (up to {cfg.draft_steps} steps or {cfg.draft_budget_s / 60:.0f} min)")
    secs, steps = _train_loop("draft", draft, cfg.draft_steps, cfg.draft_budget_s, cfg.draft_lr, cfg, batcher,
                              os.path.join(work, "draft.pt"), resume,
                              draft_loss(target, weigh))
    times["draft_train_s"], steps_run["draft"] = round(secs, 1), steps
    json.dump(times, open(times_path, "w"))
    draft.eval()
    save_hf(draft, os.path.join(out, "draft"), tok_path)

    # Held-out numbers from the shipped fp16 weights, read back as the runtime would see them.
    t16, d16 = load_hf(os.path.join(out, "target")), load_hf(os.path.join(out, "draft"))
    metrics = heldout_metrics(t16, d16, data, markers=markers)
    log("held-out: " + json.dumps(metrics))
    manifest = write_manifest(out, cfg, command, times, metrics, t16, d16, steps_run)
    log(f"done: {out}")
    return manifest


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def read_manifest(out: str) -> dict:
    import yaml

    with open(os.path.join(out, "MANIFEST.yaml")) as f:
        return yaml.safe_load(f)


def write_manifest(out, cfg: BuildConfig, command, times, metrics, target, draft, steps_run) -> dict:
    import yaml

    total_s = sum(times.values())
    manifest = {
        "what": "edgespec embedded zoo: a toy target + MTP module + draft model trained from scratch on generated "
                "planner / action-token data and Shakespeare, made to exercise the real pipeline.",
        "seed": cfg.seed,
        "command": command,
        "build_config": json.loads(json.dumps(asdict(cfg))),
        "training_time_s": {**times, "total": round(total_s, 1)},
        "steps_run": steps_run,
        "tokens_per_step": cfg.batch * cfg.seq_len,
        "heldout": metrics,
        "models": {
            "target": {"dir": "target", "params": target.num_params(False),
                       "mtp_params": target.num_params() - target.num_params(False),
                       "bytes": dir_size(os.path.join(out, "target"))},
            "draft": {"dir": "draft", "params": draft.num_params(), "bytes": dir_size(os.path.join(out, "draft"))},
        },
        "mtp": {"format": "deepseek_v3", "layer_index": target.cfg.num_hidden_layers,
                "input_order": "concat[enorm(embed(x_{t+1})), hnorm(h_t)]",
                "hidden": "h_t = last decoder layer output BEFORE model.norm",
                "rotary_position": "the position of h_t (t)",
                "head": "shared_head.head is NOT stored: the head is the tied embedding model.embed_tokens.weight",
                "aux_loss_weight": cfg.mtp_weight},
        "dtype": "float16",
        "tokenizer": "byte-level BPE (tokenizers); words, punctuation runs and whitespace runs pre-split apart (a "
                     "word is one token sequence wherever it stands); specials first: see runtime/text/prompts.py "
                     "SPECIAL_TOKENS",
    }
    manifest["total_bytes"] = manifest["models"]["target"]["bytes"] + manifest["models"]["draft"]["bytes"]
    with open(os.path.join(out, "MANIFEST.yaml"), "w") as f:
        yaml.safe_dump(manifest, f, sort_keys=False, width=110)
    return manifest
