#!/usr/bin/env python3
"""Trains a small Kimi-K3 target on synthetic GSM8K-style problems, then a DSpark draft on it.

  train.py target --tokenizer DIR --out DIR --minutes M [--seed S] [--ckpt PATH] [--resume PATH]
  train.py draft  --target DIR --tokenizer DIR --out DIR --minutes M [--k 7] [--ckpt PATH] [--resume PATH]
  add --smoke to either for a ~1 minute CPU run with a tiny config.

The target is written as the C engine loads it: config.json (kimi_k3 + text_config), BF16 safetensors
shards of <= 12 MB + model.safetensors.index.json, the tokenizer files; the draft as config.json
(k3_dspark) + one BF16 model.safetensors.  Both also write train_log.jsonl and loss.png.  Training
stops after M minutes of training wall time (evaluation and saving not counted).  The BF16 model is
re-exported every --save-every-min minutes and on any failure (from the last finite weights), so an
interrupted run still leaves a loadable model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

T_START = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ckpt  # noqa: E402
import data  # noqa: E402
from dspark_torch import DSparkDraft  # noqa: E402
from k3_torch import (K3ForTraining, checkpoint_dtype, export_tensors, init_weights, load_k3,  # noqa: E402
                      param_count)
from tok import Tokenizer  # noqa: E402

# Model sizes.  Real run (vocab 2240): 16.5M target (33.0 MB BF16) + 3.6M draft (7.3 MB) = 40.3 MB.
TARGET = dict(hidden=256, layers=12, intermediate=768, kda_heads=4, kda_head_dim=64, mla_heads=8, q_lora=128,
              kv_lora=128, nope=32, rope=16, v_head=32, experts=16, topk=2, moe_inter=128, shared=1,
              latent=128, expert_groups=4, topk_group=2, attn_res_block=4)
TARGET_SMOKE = dict(hidden=64, layers=5, intermediate=128, kda_heads=2, kda_head_dim=32, mla_heads=2, q_lora=32,
                    kv_lora=32, nope=16, rope=8, v_head=16, experts=8, topk=2, moe_inter=32, shared=1,
                    latent=32, expert_groups=4, topk_group=2, attn_res_block=2)
DRAFT = dict(layers=3, heads=8, intermediate=768, q_lora=128, kv_lora=128, nope=32, rope=16, v_head=32,
             markov_rank=64)
# Issue 37's bundled model ("m20"): wider (hidden 384, dense MLP 1152), 8 routed experts so the
# BF16 files stay about the size of v1's (the repository travels to the device machine within
# 64 MiB); served and trained up to 2048 tokens (max_position_embeddings = the server's default
# max_model_len), the draft trained on the same 2048-token rows.  Vocab 2496: 18.7M target (37.6 MB
# BF16) + 4.0M draft (8.0 MB); the v1 pair is 16.6M + 3.7M (40.3 MB).
TARGET_M20 = dict(TARGET, hidden=384, intermediate=1152, kda_heads=6, experts=8, moe_inter=128, latent=128,
                  max_pos=2048)
DRAFT_M20 = dict(DRAFT, layers=2, intermediate=640)
# "m21": m20 with 12 KDA heads of dim 32 (same 384 width, same parameter count and file size) so
# that TP 1, 2 and 4 all divide the KDA heads (m20's 6 heads cannot be split 4 ways for PP 2 x TP 4).
TARGET_M21 = dict(TARGET_M20, kda_heads=12, kda_head_dim=32)
SIZES = {"v1": (TARGET, DRAFT, 512), "m20": (TARGET_M20, DRAFT_M20, 2048), "m21": (TARGET_M21, DRAFT_M20, 2048)}
DRAFT_SMOKE = dict(layers=1, heads=2, intermediate=128, q_lora=32, kv_lora=32, nope=16, rope=8, v_head=16,
                   markov_rank=16)


# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------


def past_deadline(a, reserve_s=0.0):
    """--max-wall-min: wall clock since process start after which training stops, so that the
    final export and evaluation finish inside an outer time limit."""
    return a.max_wall_min is not None and time.time() - T_START + reserve_s > a.max_wall_min * 60


MAIN_PID = os.getpid()


def _sigterm(signum, frame):
    # `timeout`/job limits send SIGTERM: turn it into an exception so the failure export runs
    # (main process only; a forked child falls back to the default action)
    if os.getpid() != MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


def pick_device(a):
    if a.device:
        dev = torch.device(a.device)
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    else:
        # the fp32 matmuls are the KDA core / router / AttnRes: keep them full fp32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
    return dev


def amp_ctx(dev, enabled=True):
    # bf16 autocast on the GPU; plain fp32 on the CPU (bf16 matmuls are slow there)
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=enabled and dev.type == "cuda")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bf16_bytes(model) -> int:
    return sum(v.numel() * (4 if checkpoint_dtype(k) == torch.float32 else 2) for k, v in model.state_dict().items())


def make_optimizer(model, lr, wd, dev):
    """AdamW; weight decay on matrices only (not embeddings, norms, gates' vectors)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed_tokens" not in name and "markov_w1" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if dev.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def time_budget(a, ck, state):
    """(total training seconds the cosine runs over, training seconds at which this process stops).

    --minutes is the total over every part of a resumed run.  A run in one part (no --resume, no
    --session-min) that has a --max-wall-min anneals inside what the deadline leaves, as before;
    a run in parts (--session-min, or resumed from --resume) keeps the cosine over the whole
    --minutes and stops this part after --session-min minutes of training (or at the deadline),
    saving the resumable checkpoint so that the next part carries on where it stopped."""
    budget = a.minutes * 60.0
    parts = ck is not None or a.session_min is not None
    if a.max_wall_min is not None and not parts:  # anneal within the deadline (~10% kept for evals)
        budget = min(budget, 0.9 * (a.max_wall_min * 60 - (time.time() - T_START)))
    if ck is not None and abs(ck["state"].get("budget_s", budget) - budget) > 1:
        print(f"note: total budget {budget / 60:.2f} min differs from the checkpoint's "
              f"{ck['state']['budget_s'] / 60:.2f} min: the cosine follows the new one", flush=True)
    state["budget_s"] = budget
    session_end = state["train_s"] + a.session_min * 60 if a.session_min is not None else float("inf")
    if state["train_s"] >= budget:
        print(f"the checkpoint has trained {state['train_s'] / 60:.2f} of {budget / 60:.2f} min: nothing left",
              flush=True)
    return budget, session_end


class Schedule:
    """Linear warmup over steps, then cosine over the training-time budget (the step count of a
    time-bounded run is unknown in advance) down to min_ratio · peak."""

    def __init__(self, peak, warmup, budget_s, min_ratio=0.1):
        self.peak, self.warmup, self.budget, self.min_ratio = peak, warmup, budget_s, min_ratio

    def __call__(self, step, train_s):
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        frac = min(1.0, train_s / max(self.budget, 1e-9))
        return self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class RunLog:
    def __init__(self, out_dir, resume_rows=None):
        self.path = os.path.join(out_dir, "train_log.jsonl")
        self.rows = list(resume_rows or [])
        os.makedirs(out_dir, exist_ok=True)
        with open(self.path, "w") as f:
            for r in self.rows:
                f.write(json.dumps(r) + "\n")

    def add(self, row):
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def plot(self, out_dir, title, keys=("loss",)):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(matplotlib missing: loss.png skipped)")
            return
        rows = [r for r in self.rows if "loss" in r]
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in keys:
            ax.plot([r["tokens"] / 1e6 for r in rows if k in r], [r[k] for r in rows if k in r], label=k)
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
        plt.close(fig)


def all_finite(model) -> bool:
    return all(torch.isfinite(p).all().item() for p in model.parameters())


def snapshot(model, opt):
    """CPU copy of weights + optimizer (the last good state to fall back to after a NaN)."""
    return ({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            _to_cpu(opt.state_dict()))


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def save_resumable(path, model, opt, state, root, kind, log_rows):
    if not path:
        return
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"kind": kind, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "opt": opt.state_dict(), "state": state, "config": root, "log": log_rows}, tmp)
    os.replace(tmp, path)


def greedy_generate(model, prompts, max_new, dev, tok, stop=data.SEP):
    """Batched greedy decoding without a cache (full forward per token; right-padded rows are
    harmless because the model is causal).  prompts: list of id lists -> list of generated id lists."""
    B = len(prompts)
    plen = [len(p) for p in prompts]
    lens = torch.tensor(plen, device=dev)
    buf = torch.zeros(B, int(lens.max()) + max_new + 1, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = torch.tensor(p, device=dev)
    cur, active = lens.clone(), torch.ones(B, dtype=torch.bool, device=dev)
    ar = torch.arange(B, device=dev)
    for _ in range(max_new):
        with torch.no_grad(), amp_ctx(dev):
            y = model(buf[:, : int(cur.max())], logits_index=(cur - 1).unsqueeze(1))["logits"][:, 0].argmax(-1)
        buf[ar, cur] = torch.where(active, y, buf[ar, cur])
        cur = cur + active.long()
        rows, cc, act = buf.tolist(), cur.tolist(), active.tolist()   # one host copy per step
        for b in range(B):
            if act[b] and stop in tok.decode(rows[b][plen[b]: cc[b]]):
                active[b] = False
        if not active.any():
            break
    rows, cc = buf.tolist(), cur.tolist()
    return [rows[b][plen[b]: cc[b]] for b in range(B)]


def accuracy(gens, answers, tok):
    ok = sum(data.extract_answer(tok.decode(g)) == ans for g, ans in zip(gens, answers))
    return ok / max(1, len(answers))


# ------------------------------------------------------------------------------------------------
# Target
# ------------------------------------------------------------------------------------------------


def export_target(out, model, root, tok):
    t = export_tensors(model)
    ckpt.save_model_dir(out, root, t, shard=True,
                        extra_files=[os.path.join(tok.folder, "tiktoken.model"),
                                     os.path.join(tok.folder, "tokenizer_config.json")])


def eval_target(model, prompts, dev, tok, max_new, batch=64):
    model.eval()
    gens = []
    for i in range(0, len(prompts), batch):
        gens += greedy_generate(model, [p for p, _ in prompts[i: i + batch]], max_new, dev, tok)
    model.train()
    return accuracy(gens, [a for _, a in prompts], tok), gens


def cmd_target(a):
    dev = pick_device(a)
    smoke = a.smoke
    tok = Tokenizer(a.tokenizer)
    gsm = data.load_gsm(a.gsm)
    ck = torch.load(a.resume, map_location="cpu", weights_only=False) if a.resume else None
    if ck and a.init_from:
        raise SystemExit("--resume and --init-from exclude each other")
    if a.init_from:  # an exported model's weights (BF16 as shipped), a fresh optimizer and schedule
        model = load_k3(a.init_from, dtype=torch.float32)
        root = model.root_config
        print(f"initialized from {a.init_from} (its weights; optimizer, schedule and data stream new)", flush=True)
    else:
        root = ck["config"] if ck else ckpt.target_config(tok, **(TARGET_SMOKE if smoke else SIZES[a.size][0]))
    if root["text_config"]["vocab_size"] != tok.vocab_size:
        raise SystemExit(f"tokenizer vocab {tok.vocab_size} != config vocab {root['text_config']['vocab_size']}")
    if not a.init_from:
        model = K3ForTraining(root)
        init_weights(model, std=0.02, seed=a.seed)
    state = {"step": 0, "tokens": 0, "train_s": 0.0, "lr_scale": 1.0}
    if ck:
        model.load_state_dict(ck["model"])
        state.update(ck["state"])
    model.to(dev)
    V = tok.vocab_size
    n_params = param_count(model)
    n_embed = 2 * V * root["text_config"]["hidden_size"]
    print(f"target: {n_params / 1e6:.2f}M params ({(n_params - n_embed) / 1e6:.2f}M without embed/lm_head), "
          f"BF16 checkpoint {bf16_bytes(model) / 1e6:.2f} MB, vocab {V}, device {dev}", flush=True)
    seq, B = a.seq_len or (128 if smoke else SIZES[a.size][2]), a.batch or (8 if smoke else 64)
    lr_peak = a.lr or (3e-3 if smoke else 2e-3)
    opt = make_optimizer(model, lr_peak, 0.1, dev)
    if ck:
        opt.load_state_dict(ck["opt"])
    budget, session_end = time_budget(a, ck, state)
    sched = Schedule(lr_peak, a.warmup or (20 if smoke else 200), budget)
    loader = data.make_loader(a.tokenizer, seq, B, a.seed + 7919 * state["step"], a.workers, dev.type == "cuda", a.gsm)
    fwd = torch.compile(model) if a.compile else model
    moes = model.moe_layers()
    for m in moes:
        m.track_load = True
    eval_set = data.eval_prompts(gsm, tok, a.eval_n or (4 if smoke else 32), shots=a.shots)
    log = RunLog(a.out, ck["log"] if ck else None)
    eval_every = a.eval_every or (100 if smoke else 1000)
    log_every = a.log_every or (5 if smoke else 25)
    good = snapshot(model, opt)
    exported_step = -1
    loss_acc, n_acc, tok_acc, t_log = torch.zeros((), device=dev), 0, 0, state["train_s"]
    last_save = state["train_s"]
    print(f"training {a.minutes:.2f} min: batch {B} x {seq} tokens, lr {lr_peak}, data workers {a.workers}",
          flush=True)

    def export(tag):
        nonlocal exported_step
        sync(dev)
        if not all_finite(model):
            print(f"[{tag}] weights not finite: restoring the last good state before export", flush=True)
            model.load_state_dict(good[0])
        export_target(a.out, model, root, tok)
        save_resumable(a.ckpt, model, opt, state, root, "target", log.rows)
        exported_step = state["step"]
        log.plot(a.out, f"target {os.path.basename(os.path.abspath(a.out))}")

    try:
        t_prev = time.perf_counter()
        while state["train_s"] < min(budget, session_end) and not past_deadline(a):
            batch = next(loader).to(dev, non_blocking=True)
            x, y = batch[:, :-1], batch[:, 1:]
            lr = sched(state["step"], state["train_s"]) * state["lr_scale"]
            for g in opt.param_groups:
                g["lr"] = lr
            with amp_ctx(dev):
                logits = fwd(x)["logits"]
            loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
            loss.backward()
            # no host sync per step: a non-finite loss is caught at the next log line, which
            # rolls back to the last good snapshot
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # aux-loss-free balancing: push the bias toward under-used experts
                for m in moes:
                    if m.load is not None and a.bias_rate:
                        m.gate.e_score_correction_bias.add_(a.bias_rate * torch.sign(m.load.mean() - m.load))
            loss_acc += loss.detach()
            n_acc += 1
            tok_acc += x.numel()
            state["step"] += 1
            state["tokens"] += x.numel()
            now = time.perf_counter()
            state["train_s"] += now - t_prev
            t_prev = now
            if state["step"] % log_every == 0 or state["train_s"] >= min(budget, session_end):
                sync(dev)
                now = time.perf_counter()
                state["train_s"] += now - t_prev
                t_prev = now
                lval = (loss_acc / max(n_acc, 1)).item()
                dt = state["train_s"] - t_log
                tps = tok_acc / max(dt, 1e-9)
                row = {"step": state["step"], "tokens": state["tokens"], "loss": lval, "lr": lr,
                       "wall": round(state["train_s"], 2), "tok_s": round(tps)}
                log.add(row)
                mem = f"  {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB peak" if dev.type == "cuda" else ""
                print(f"step {state['step']:6d}  loss {lval:.4f}  lr {lr:.2e}  {tps / 1e3:8.1f}k tok/s  "
                      f"{state['train_s'] / 60:5.2f}/{a.minutes:.2f} min{mem}", flush=True)
                if not math.isfinite(lval) or not all_finite(model):
                    print("non-finite loss/weights: back to the last good state, lr halved", flush=True)
                    model.load_state_dict(good[0])
                    opt.load_state_dict(good[1])
                    state["lr_scale"] *= 0.5
                elif state["step"] % (4 * log_every) == 0:
                    good = snapshot(model, opt)
                    t_prev = time.perf_counter()
                loss_acc.zero_()
                n_acc, tok_acc, t_log = 0, 0, state["train_s"]
            if state["step"] % eval_every == 0:
                sync(dev)
                acc, gens = eval_target(model, eval_set, dev, tok, a.max_new)
                log.add({"step": state["step"], "tokens": state["tokens"], "wall": round(state["train_s"], 2),
                         "eval_acc": acc})
                print(f"  eval (held-out train problems, {len(eval_set)}, {a.shots}-shot greedy): acc {acc:.3f}  "
                      f"sample: {tok.decode(gens[0])[:160]!r}", flush=True)
                good = snapshot(model, opt)
                t_prev = time.perf_counter()
            if state["train_s"] - last_save >= a.save_every_min * 60:
                good = snapshot(model, opt)
                export("periodic")
                last_save = state["train_s"]
                t_prev = time.perf_counter()
    except BaseException as e:  # noqa: BLE001 - also Ctrl-C: always leave a loadable model
        print(f"training stopped by {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        try:
            export("failure")
            print(f"wrote the last good BF16 model to {a.out} (step {exported_step})", flush=True)
        finally:
            raise
    export("final")
    print(f"done: {state['step']} steps, {state['tokens'] / 1e6:.1f}M tokens in {state['train_s'] / 60:.2f} min "
          f"({state['tokens'] / max(state['train_s'], 1e-9) / 1e3:.1f}k tok/s); wrote {a.out} "
          f"[{time.time() - T_START:.0f} s since start]", flush=True)
    if a.final_eval_n and not past_deadline(a, reserve_s=-30.0):
        test = data.eval_prompts(gsm, tok, a.final_eval_n, shots=a.shots, split="test")
        acc, gens = eval_target(model, test, dev, tok, a.max_new)
        log.add({"step": state["step"], "tokens": state["tokens"], "wall": round(state["train_s"], 2),
                 "test_acc": acc, "test_n": len(test)})
        print(f"final: test split, first {len(test)} problems, {a.shots}-shot greedy accuracy {acc:.3f}", flush=True)
        print("  e.g. " + repr(tok.decode(gens[0])[:200]) + f" [{time.time() - T_START:.0f} s since start]", flush=True)


# ------------------------------------------------------------------------------------------------
# Draft
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def init_draft(draft: DSparkDraft, target: K3ForTraining, std=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = draft.dc.num_hidden_layers
    for name, mod in draft.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            s = std / math.sqrt(2 * L) if name.endswith(("o_proj", "down_proj")) else std
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * s)
            if getattr(mod, "bias", None) is not None:
                mod.bias.zero_()
        elif hasattr(mod, "eps") and hasattr(mod, "weight"):
            mod.weight.fill_(1.0)
    draft.markov_head.markov_w2.weight.zero_()   # Markov bias starts at 0
    if hasattr(draft, "confidence_head"):
        draft.confidence_head.proj.weight.zero_()
    draft.embed_tokens.weight.copy_(target.lm.model.embed_tokens.weight.detach().float().cpu())


@torch.no_grad()
def spec_sim(target, draft, lm_w, prompts, K, max_new, dev, tok, stop=data.SEP):
    """Greedy speculative decoding, simulated without caches: each step the draft proposes K tokens
    after the accepted prefix (context rows = taps of the last target pass), one target pass over
    prefix + drafts verifies them (§8.8 greedy rule) and gives the bonus token.  Returns
    (generated ids per prompt, accepted-count histogram [K+1], target passes, emitted tokens)."""
    taps_ids = draft.dc.target_layer_ids
    B = len(prompts)
    ar = torch.arange(B, device=dev)
    plen = [len(p) for p in prompts]
    lens = torch.tensor(plen, device=dev)
    buf = torch.zeros(B, int(lens.max()) + max_new + K + 3, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = torch.tensor(p, device=dev)
    with amp_ctx(dev):
        out = target(buf[:, : int(lens.max())], taps=taps_ids, logits_index=(lens - 1).unsqueeze(1))
    buf[ar, lens] = out["logits"][:, 0].argmax(-1)          # x0 from the prefill
    cur = lens + 1
    taps = out["taps"]
    active = torch.ones(B, dtype=torch.bool, device=dev)
    hist = torch.zeros(K + 1, dtype=torch.long)
    passes = emitted = 0
    kk = torch.arange(K, device=dev)
    while active.any():
        x0 = buf[ar, cur - 1]
        block = torch.full((B, 1, K), draft.dc.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0, 0] = x0
        with amp_ctx(dev):
            ctx = draft.context([taps[L] for L in taps_ids])
            hid = draft(ctx, (cur - 2).unsqueeze(1), block)
        d = draft.walk(hid[:, 0].float(), lm_w.float(), x0)   # [B, K]
        buf.scatter_(1, cur.unsqueeze(1) + kk, d)
        T = int((cur + K).max())
        with amp_ctx(dev):
            out = target(buf[:, :T], taps=taps_ids, logits_index=(cur - 1).unsqueeze(1) + torch.arange(K + 1, device=dev))
        y = out["logits"].argmax(-1)                           # [B, K+1]
        acc = (d == y[:, :K]).long().cumprod(1).sum(1)         # accepted prefix length
        buf[ar, cur + acc] = y[ar, acc]                        # bonus after the accepted drafts
        taps = out["taps"]
        for b, (ac, n, c) in enumerate(zip(active.tolist(), acc.tolist(), cur.tolist())):
            left = max_new - (c - plen[b])
            # as the engine counts: a step that runs past max_new counts only what it may emit, and
            # with one token left it is a plain decode, not a verify
            if ac and left > 1:
                n = min(n, left - 1)
                hist[n] += 1
                passes += 1
                emitted += n + 1
        cur = torch.where(active, cur + acc + 1, cur)
        rows, cc, act = buf.tolist(), cur.tolist(), active.tolist()
        for b in range(B):
            if act[b] and (cc[b] - plen[b] >= max_new or stop in tok.decode(rows[b][plen[b]: cc[b]])):
                active[b] = False
    rows, cc = buf.tolist(), cur.tolist()
    return [rows[b][plen[b]: cc[b]] for b in range(B)], hist, passes, emitted


def eval_draft(target, draft, lm_w, prompts, K, dev, tok, max_new, check_greedy=False, batch=64):
    draft.eval()
    gens, hist, passes, emitted = [], torch.zeros(K + 1, dtype=torch.long), 0, 0
    for i in range(0, len(prompts), batch):
        g, h, p, e = spec_sim(target, draft, lm_w, [q for q, _ in prompts[i: i + batch]], K, max_new, dev, tok)
        gens += g
        hist += h
        passes += p
        emitted += e
    draft.train()
    res = {"tokens_per_forward": emitted / max(passes, 1), "mean_accepted": emitted / max(passes, 1) - 1,
           "hist": hist.tolist(), "acc": accuracy(gens, [a for _, a in prompts], tok)}
    if check_greedy:  # lossless check: speculative output == plain greedy output (up to near-ties in bf16)
        same = 0
        for i in range(0, len(prompts), batch):
            ref = greedy_generate(target, [q for q, _ in prompts[i: i + batch]], max_new, dev, tok)
            for g1, g2 in zip(gens[i: i + batch], ref):
                n = min(len(g1), len(g2))
                same += g1[:n] == g2[:n]
        res["same_as_greedy"] = f"{same}/{len(prompts)}"
    return res


def draft_loss(target, draft, lm_w, ids, K, A, taps_ids, mask_id, wdecay, dev):
    """One batch of the DSpark objective.  ids [B, T] real text.  For A anchors p per row:
    block [x0 = ids[p+1], mask × (K-1)], label of row k = the target's greedy token at p+2+k, proxied
    by its argmax at p+1+k on the text; a row counts only while the text so far equals the target's
    own greedy choice (ids[p+1+j] == argmax[p+j] for j <= k), i.e. when the proxy label is exact.
    The Markov bias of row k uses the previous label (teacher forcing)."""
    B, T = ids.shape
    with torch.no_grad(), amp_ctx(dev):
        out = target(ids, taps=taps_ids)
        pred = out["logits"].argmax(-1)                                    # [B, T]
        taps = [out["taps"][L] for L in taps_ids]
    match = torch.zeros_like(pred, dtype=torch.bool)
    match[:, :-1] = pred[:, :-1] == ids[:, 1:]
    hi = T - 1 - K                                                        # p + K <= T - 1
    A = min(A, hi + 1)
    p = torch.rand(B, hi + 1, device=dev).argsort(1)[:, :A].sort(1).values   # distinct anchors
    kk = torch.arange(K, device=dev)
    rows = p.unsqueeze(-1) + 1 + kk                                       # positions p+1+k
    labels = pred.gather(1, rows.reshape(B, -1)).view(B, A, K)
    valid = match.gather(1, (p.unsqueeze(-1) + kk).reshape(B, -1)).view(B, A, K).long().cumprod(-1).bool()
    x0 = ids.gather(1, p + 1)
    block = torch.full((B, A, K), mask_id, dtype=torch.long, device=dev)
    block[..., 0] = x0
    prev = torch.cat([x0.unsqueeze(-1), labels[..., :-1]], dim=-1)
    with amp_ctx(dev):
        ctx = draft.context(taps)
        hid = draft(ctx, p, block)                                        # [B, A, K, D]
        logits = draft.block_logits(hid, lm_w, prev)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(B, A, K)
    w = (wdecay ** kk.float()).view(1, 1, K) * valid
    loss = (ce * w).sum() / w.sum().clamp_min(1.0)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        # teacher-forced estimate of accepted drafts per block: runs of correct rows from row 0
        run = correct.long().cumprod(-1).sum(-1).float()                  # [B, A]
        stats = {"row_acc": (correct.sum(dim=(0, 1)).float() / valid.sum(dim=(0, 1)).clamp_min(1)).tolist(),
                 "est_accept": run[valid[..., 0]].mean().item() if valid[..., 0].any() else 0.0,
                 "valid_frac": valid.float().mean().item()}
    if hasattr(draft, "confidence_head"):  # training-only head: P(row's greedy draft is right)
        feat = torch.cat([hid.detach().float(), draft.markov_head.markov_w1(prev).detach().float()], -1)
        conf = draft.confidence_head.proj(feat).squeeze(-1)
        closs = F.binary_cross_entropy_with_logits(conf, correct.float(), weight=valid.float(), reduction="sum")
        loss = loss + 0.1 * closs / valid.sum().clamp_min(1)
    return loss, stats


def cmd_draft(a):
    dev = pick_device(a)
    smoke = a.smoke
    tok = Tokenizer(a.tokenizer)
    gsm = data.load_gsm(a.gsm)
    target = load_k3(a.target, dtype=torch.float32, device=dev)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    if target.cfg.vocab_size != tok.vocab_size:
        raise SystemExit(f"tokenizer vocab {tok.vocab_size} != target vocab {target.cfg.vocab_size}")
    ck = torch.load(a.resume, map_location="cpu", weights_only=False) if a.resume else None
    droot = ck["config"] if ck else ckpt.draft_config(target.root_config, tok, **(DRAFT_SMOKE if smoke else SIZES[a.size][1]))
    draft = DSparkDraft(droot)
    init_draft(draft, target, seed=a.seed)
    state = {"step": 0, "tokens": 0, "train_s": 0.0, "lr_scale": 1.0}
    if ck:
        draft.load_state_dict(ck["model"])
        state.update(ck["state"])
    draft.to(dev)
    lm_w = target.lm.head_weight().detach()
    K, taps_ids = a.k, droot["target_layer_ids"]
    dbytes = sum(v.numel() * 2 for v in draft.state_dict().values())
    n_params = param_count(draft)
    V, D = tok.vocab_size, droot["hidden_size"]
    tbytes = bf16_bytes(target)
    print(f"draft: {n_params / 1e6:.2f}M params ({(n_params - V * D) / 1e6:.2f}M without the frozen embed copy), "
          f"BF16 {dbytes / 1e6:.2f} MB; target {tbytes / 1e6:.2f} MB; together {(dbytes + tbytes) / 1e6:.2f} MB; "
          f"taps {taps_ids}, K={K}, mask id {droot['mask_token_id']}, device {dev}", flush=True)
    if dbytes > ckpt.MAX_FILE_BYTES - ckpt.HEADER_SLACK:
        raise SystemExit("draft does not fit in one 12 MB model.safetensors; shrink it")
    seq, B = a.seq_len or (128 if smoke else SIZES[a.size][2]), a.batch or (4 if smoke else 32)
    A = a.anchors or (16 if smoke else 64)
    lr_peak = a.lr or (3e-3 if smoke else 2e-3)
    opt = make_optimizer(draft, lr_peak, 0.05, dev)
    if ck:
        opt.load_state_dict(ck["opt"])
    budget, session_end = time_budget(a, ck, state)
    sched = Schedule(lr_peak, a.warmup or (10 if smoke else 100), budget)
    loader = data.make_loader(a.tokenizer, seq, B, a.seed + 104729 + 7919 * state["step"], a.workers,
                              dev.type == "cuda", a.gsm)
    eval_prompts = data.eval_prompts(gsm, tok, a.eval_n or (4 if smoke else 50), shots=a.shots, split=a.accept_split)
    quick = eval_prompts[: max(4, len(eval_prompts) // 4)]
    log = RunLog(a.out, ck["log"] if ck else None)
    eval_every = a.eval_every or (60 if smoke else 400)
    log_every = a.log_every or (5 if smoke else 25)
    good = snapshot(draft, opt)
    max_new = a.max_new
    t_log, loss_acc, n_acc, last_save = state["train_s"], 0.0, 0, state["train_s"]
    stats_acc = []

    def export(tag):
        sync(dev)
        if not all_finite(draft):
            print(f"[{tag}] weights not finite: restoring the last good state before export", flush=True)
            draft.load_state_dict(good[0])
        t = export_tensors(draft, lambda n: torch.bfloat16)
        ckpt.save_model_dir(a.out, droot, t, shard=False)
        save_resumable(a.ckpt, draft, opt, state, droot, "draft", log.rows)
        log.plot(a.out, f"DSpark draft {os.path.basename(os.path.abspath(a.out))}")

    print(f"training {a.minutes:.2f} min: batch {B} x {seq}, {A} anchors x K={K} per row, lr {lr_peak}", flush=True)
    try:
        t_prev = time.perf_counter()
        while state["train_s"] < min(budget, session_end) and not past_deadline(a):
            ids = next(loader).to(dev, non_blocking=True)[:, :seq]
            lr = sched(state["step"], state["train_s"]) * state["lr_scale"]
            for g in opt.param_groups:
                g["lr"] = lr
            loss, st = draft_loss(target, draft, lm_w, ids, K, A, taps_ids, droot["mask_token_id"], a.row_decay, dev)
            loss.backward()
            nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            if math.isfinite(loss.item()):
                opt.step()
            opt.zero_grad(set_to_none=True)
            loss_acc += loss.item()
            n_acc += 1
            stats_acc.append(st)
            state["step"] += 1
            state["tokens"] += ids.numel()
            now = time.perf_counter()
            state["train_s"] += now - t_prev
            t_prev = now
            if state["step"] % log_every == 0 or state["train_s"] >= min(budget, session_end):
                dt = state["train_s"] - t_log
                lval = loss_acc / max(n_acc, 1)
                est = sum(s["est_accept"] for s in stats_acc) / len(stats_acc)
                ra = [sum(s["row_acc"][k] for s in stats_acc) / len(stats_acc) for k in range(K)]
                vf = sum(s["valid_frac"] for s in stats_acc) / len(stats_acc)
                row = {"step": state["step"], "tokens": state["tokens"], "loss": lval, "lr": lr,
                       "wall": round(state["train_s"], 2), "tok_s": round(n_acc * ids.numel() / max(dt, 1e-9)),
                       "est_tokens_per_forward": 1 + est, "row_acc": [round(x, 3) for x in ra]}
                log.add(row)
                print(f"step {state['step']:5d}  loss {lval:.4f}  lr {lr:.2e}  est tok/fwd {1 + est:.2f}  "
                      f"row acc {' '.join(f'{x:.2f}' for x in ra)}  valid {vf:.2f}  "
                      f"{row['tok_s'] / 1e3:.1f}k ctx tok/s  {state['train_s'] / 60:.2f}/{a.minutes:.2f} min"
                      + (f"  {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB peak" if dev.type == "cuda" else ""),
                      flush=True)
                if not math.isfinite(lval) or not all_finite(draft):
                    print("non-finite loss/weights: back to the last good state, lr halved", flush=True)
                    draft.load_state_dict(good[0])
                    opt.load_state_dict(good[1])
                    state["lr_scale"] *= 0.5
                t_log, loss_acc, n_acc, stats_acc = state["train_s"], 0.0, 0, []
            if state["step"] % eval_every == 0:
                r = eval_draft(target, draft, lm_w, quick, K, dev, tok, max_new)
                log.add({"step": state["step"], "tokens": state["tokens"], "wall": round(state["train_s"], 2),
                         "accept_tokens_per_forward": r["tokens_per_forward"]})
                print(f"  spec-decode sim ({len(quick)} prompts): {r['tokens_per_forward']:.2f} tokens/forward, "
                      f"accepted histogram {r['hist']}", flush=True)
                good = snapshot(draft, opt)
                t_prev = time.perf_counter()
            if state["train_s"] - last_save >= a.save_every_min * 60:
                good = snapshot(draft, opt)
                export("periodic")
                last_save = state["train_s"]
                t_prev = time.perf_counter()
    except BaseException as e:  # noqa: BLE001
        print(f"training stopped by {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        try:
            export("failure")
            print(f"wrote the last good BF16 draft to {a.out}", flush=True)
        finally:
            raise
    export("final")
    print(f"done: {state['step']} steps in {state['train_s'] / 60:.2f} min; wrote {a.out} "
          f"[{time.time() - T_START:.0f} s since start]", flush=True)
    r = eval_draft(target, draft, lm_w, eval_prompts, K, dev, tok, max_new, check_greedy=not a.no_greedy_check)
    log.add({"step": state["step"], "tokens": state["tokens"], "wall": round(state["train_s"], 2),
             "final_tokens_per_forward": r["tokens_per_forward"], "final_hist": r["hist"]})
    print(f"final acceptance ({len(eval_prompts)} {a.shots}-shot {a.accept_split} prompts, greedy, K={K}): "
          f"mean tokens per forward {r['tokens_per_forward']:.3f} (mean accepted {r['mean_accepted']:.3f} of {K}); "
          f"accepted histogram {r['hist']}; answer accuracy {r['acc']:.3f}"
          + (f"; identical to plain greedy {r['same_as_greedy']}" if "same_as_greedy" in r else ""), flush=True)
    print(f"[{time.time() - T_START:.0f} s since start]", flush=True)
    with open(os.path.join(a.out, "acceptance.json"), "w") as f:
        json.dump({"k": K, "prompts": len(eval_prompts), "shots": a.shots, "split": a.accept_split, **r}, f, indent=2)


# ------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--tokenizer", required=True, help="folder with tiktoken.model + tokenizer_config.json")
        p.add_argument("--out", required=True)
        p.add_argument("--minutes", type=float, default=None,
                       help="training wall time (eval/saving excluded); smoke default 0.5 target / 0.3 draft")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--ckpt", default=None, help="also keep a resumable fp32 checkpoint (weights + optimizer) here")
        p.add_argument("--resume", default=None, help="resume from a --ckpt file (--minutes = total budget)")
        p.add_argument("--session-min", type=float, default=None,
                       help="train at most this many minutes in this process (one part of a run in "
                            "parts; the cosine still spans --minutes); the resumable --ckpt is saved at the end")
        p.add_argument("--smoke", action="store_true", help="tiny config for a ~1 minute CPU check")
        p.add_argument("--device", default=None)
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU runs)")
        p.add_argument("--workers", type=int, default=None, help="data worker processes (default 6 GPU, 1 CPU)")
        p.add_argument("--batch", type=int, default=None)
        p.add_argument("--seq-len", type=int, default=None)
        p.add_argument("--lr", type=float, default=None)
        p.add_argument("--warmup", type=int, default=None, help="warmup steps")
        p.add_argument("--log-every", type=int, default=None)
        p.add_argument("--eval-every", type=int, default=None, help="steps between quick evals")
        p.add_argument("--eval-n", type=int, default=None)
        p.add_argument("--shots", type=int, default=None, help="few-shot examples in eval prompts (4; smoke 2)")
        p.add_argument("--max-new", type=int, default=None, help="tokens generated per eval prompt")
        p.add_argument("--save-every-min", type=float, default=2.0)
        p.add_argument("--max-wall-min", type=float, default=None,
                       help="stop training this many minutes after start whatever --minutes says "
                            "(the final export/eval run after it; keep ~1 min below an outer limit)")
        p.add_argument("--gsm", default=None,
                       help="data generator module (default tools/data/gsm.py) or a mix PATH:W,PATH:W,... "
                            "(each example drawn from a generator with its weight; the first one's few-shot "
                            "format and held-out draw are used by the evals)")
        p.add_argument("--size", choices=sorted(SIZES), default="v1",
                       help="model size: v1 (the first gsm-k3, 512-token rows), m20 (issue 37, 2048-token rows) or "
                            "m21 (m20 with 12 KDA heads of dim 32, splittable by TP 1/2/4)")

    t = sub.add_parser("target", help="train the K3 target")
    common(t)
    t.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    t.add_argument("--init-from", default=None,
                   help="start from an exported target folder's weights (e.g. models/gsm-k3: training that goes "
                        "on in a later session, whose resumable checkpoint is gone); use another --seed so the "
                        "data stream differs from the first run's")
    t.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free router bias step (0: off)")
    t.add_argument("--final-eval-n", type=int, default=None, help="test problems for the final accuracy")
    d = sub.add_parser("draft", help="train a DSpark draft on a frozen target")
    common(d)
    d.add_argument("--target", required=True)
    d.add_argument("--k", type=int, default=7, help="block width (drafts per step)")
    d.add_argument("--anchors", type=int, default=None, help="anchors per training row")
    d.add_argument("--row-decay", type=float, default=0.85, help="loss weight of block row k = decay^k")
    d.add_argument("--accept-split", default="test", help="split of the acceptance prompts")
    d.add_argument("--no-greedy-check", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    if a.minutes is None:
        if not a.smoke:
            ap.error("--minutes is required")
        a.minutes = 0.5 if a.cmd == "target" else 0.3
    if a.workers is None:
        a.workers = 1 if (a.smoke or not torch.cuda.is_available()) else 6
    if a.max_new is None:
        a.max_new = 32 if a.smoke else 96
    if a.shots is None:
        a.shots = 2 if a.smoke else 4
    if a.cmd == "target":
        if a.final_eval_n is None:
            a.final_eval_n = 4 if a.smoke else 128
        cmd_target(a)
    else:
        cmd_draft(a)


if __name__ == "__main__":
    main()
