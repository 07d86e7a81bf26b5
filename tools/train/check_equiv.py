#!/usr/bin/env python3
"""float64 CPU check that the trainer's models compute exactly what tools/reference computes.

  1. a random K3 checkpoint in the published layout (tools/reference/make_random_ckpt.py, the
     models/tiny-k3 shape: every K3 feature on, padded A_log, two shards) loaded into k3_torch:
     logits, every tap (hidden after each layer) and the final hidden vs ReferenceModel, batch of 2,
     T = 1, 37, 130 (not multiples of the KDA chunk 64);
  2. the trainer's own path: k3_torch init + ckpt.save_model_dir (BF16 shards, F32 where K3 has F32)
     read back by the reference -> same comparison (catches naming / dtype / config mistakes);
  3. the DSpark draft from the trainer (random weights, written by ckpt.save_model_dir) vs
     tools/reference/draft.py: one multi-anchor block pass (the training mask) against propose() per
     anchor: U + Markov bias per row and the greedy walk; taps incl. -1.
Asserts rel err = max|a-b| / max|b| < 1e-9.  Runs in about a minute on 2 cores.

usage: check_equiv.py [--keep DIR]
"""
import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))

import ckpt  # noqa: E402
import make_random_ckpt  # noqa: E402
from draft import ReferenceDraft  # noqa: E402
from dspark_torch import DSparkDraft  # noqa: E402
from k3_torch import K3ForTraining, export_tensors, init_weights, load_k3  # noqa: E402
from model import ReferenceModel  # noqa: E402

TOL = 1e-9
DT = torch.float64


def rel(a, b):
    a, b = a.detach().to(DT), b.detach().to(DT)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


class FakeTok:
    """The ids a config needs, for a vocabulary of n_ranks + 256 specials."""

    def __init__(self, n_ranks):
        self.vocab_size = n_ranks + 256
        self.bos_id, self.eos_id, self.pad_id = n_ranks, n_ranks + 2, n_ranks + 255
        self.media_pad_id, self.mask_id = n_ranks + 21, n_ranks + 253


def check_target(folder, lengths, label, B=2, seed=0):
    ref = ReferenceModel.from_dir(folder)
    unused = ref.w.unused()
    assert not unused, f"{label}: checkpoint tensors the reference does not read: {unused[:5]}"
    mine = load_k3(folder, dtype=DT)
    L = ref.cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for T in lengths:
        ids = torch.randint(0, ref.cfg.vocab_size, (B, T), generator=g)
        with torch.no_grad():
            out = mine(ids, taps=[-1] + list(range(L)), all_hidden=True, return_final=True)
            for b in range(B):
                r = ref.forward(ids[b])
                errs = [rel(out["logits"][b], r.logits), rel(out["final"][b], r.final_hidden)]
                errs += [rel(out["hidden"][i][b], r.hidden[i]) for i in range(L)]
                errs += [rel(out["taps"][i][b], r.hidden[i]) for i in range(L)]
                errs.append(rel(out["taps"][-1][b], ref.embed[ids[b]]))
                e = max(errs)
                worst = max(worst, e)
                assert e < TOL, f"{label}: T={T} row {b}: rel err {e:.3e} (logits {errs[0]:.3e})"
            # logits_index path (used by the evaluators) agrees with the full logits
            li = torch.stack([torch.arange(T), torch.arange(T).flip(0)])[:B]
            sub = mine(ids, logits_index=li)["logits"]
            assert rel(sub, out["logits"].gather(1, li.unsqueeze(-1).expand(-1, -1, sub.shape[-1]))) < 1e-12
    print(f"[ok] {label}: k3_torch vs reference, T={lengths}, B={B}: max rel err {worst:.2e}")
    return mine, ref


def check_draft(tgt_dir, draft_dir, mine_t, ref_t, label, n=130, K=7, anchors=(0, 5, 36, 64, 129)):
    rd = ReferenceDraft.from_dir(draft_dir, ref_t)
    assert not rd.w.unused(), f"{label}: unused draft tensors {rd.w.unused()}"
    with open(os.path.join(draft_dir, "config.json")) as f:
        droot = json.load(f)
    md = DSparkDraft(droot)
    sd = ckpt_load(draft_dir)
    md.load_state_dict(sd, strict=True)
    md = md.to(DT)
    cfg = md.dc
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
    lm_w = mine_t.lm.head_weight()
    worst = 0.0
    with torch.no_grad():
        out_t = mine_t(ids, taps=cfg.target_layer_ids)
        taps = [out_t["taps"][L] for L in cfg.target_layer_ids]
        r_out = ref_t.forward(ids[0])
        r_taps = rd.taps_from(r_out, ids[0])
        ctx = md.context(taps)
        r_ctx = rd.context(r_taps)
        worst = max(worst, rel(ctx[0], r_ctx))
        r_lat = rd.context_latents(r_ctx, 0)
        # all anchors in ONE pass (the training mask), each against its own reference proposal
        A = len(anchors)
        x0 = torch.randint(0, cfg.vocab_size, (A,), generator=g)
        block = torch.full((1, A, K), cfg.mask_token_id, dtype=torch.long)
        block[0, :, 0] = x0
        hid = md(ctx, torch.tensor([anchors]), block)                 # [1, A, K, D]
        for a, p in enumerate(anchors):
            res = rd.propose([lat[: p + 1] for lat in r_lat], int(x0[a]), K)
            prev = torch.tensor([int(x0[a])] + res.drafts[:-1])
            mine_logits = md.block_logits(hid[0, a], lm_w, prev)
            e = rel(mine_logits, res.logits + res.bias)
            worst = max(worst, e)
            assert e < TOL, f"{label}: anchor p={p}: block logits rel err {e:.3e}"
            walk = md.walk(hid[0, a: a + 1], lm_w, x0[a: a + 1])[0].tolist()
            assert walk == res.drafts, f"{label}: anchor p={p}: walk {walk} != reference {res.drafts}"
    print(f"[ok] {label}: draft block pass ({A} anchors in one pass, K={K}) + Markov walk vs reference "
          f"propose: max rel err {worst:.2e}")


def check_training_precision(model64):
    from k3_torch import GatedAct, kda_chunked
    from model import kda_recurrence

    g = torch.Generator().manual_seed(11)
    # the memory-saving activation's hand-written backward (SiTU / SwiGLU, with and without weights)
    for kind, beta, bl in (("situ", 4.0, 25.0), ("situ", 1.5, None), ("silu", 1.0, None)):
        a_, u_ = (torch.randn(3, 4, 5, dtype=DT, generator=g, requires_grad=True) * 3 for _ in range(2))
        a_, u_ = a_.detach().requires_grad_(True), u_.detach().requires_grad_(True)
        w_ = torch.rand(3, 4, dtype=DT, generator=g, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, y, z: GatedAct.apply(x, y, z, kind, beta, bl), (a_, u_, w_))
        assert torch.autograd.gradcheck(lambda x, y: GatedAct.apply(x, y, None, kind, beta, bl), (a_, u_))
    B, H, T, dk = 2, 2, 150, 32
    worst = 0.0
    for lo, hi in ((-5.0, -4.9), (-0.05, 0.0), (-5.0, 0.0)):
        q = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g), dim=-1)
        v = torch.randn(B, H, T, dk, generator=g)
        gg = lo + (hi - lo) * torch.rand(B, H, T, dk, generator=g)
        beta = torch.rand(B, H, T, generator=g)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gg, beta)]
        o = kda_chunked(*leaves)
        o.square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves), f"non-finite KDA grads for g in ({lo},{hi})"
        for b in range(B):
            r, _ = kda_recurrence(*(t[b].transpose(0, 1).to(DT) for t in (q, k, v, gg)), beta[b].T.to(DT),
                                  torch.zeros(H, dk, dk, dtype=DT))
            worst = max(worst, rel(o[b].transpose(0, 1), r))
    assert worst < 1e-4, f"fp32 chunked KDA vs float64 recurrence: {worst:.2e}"
    m = K3ForTraining(model64.root_config)
    init_weights(m, std=0.02, seed=4)  # a training-like init (the 0.3-std test weights are chaotic in bf16)
    m64 = K3ForTraining(model64.root_config)
    m64.load_state_dict(m.state_dict())
    m64 = m64.to(DT)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 100), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(ids, taps=[-1, 1, 3])
    loss = torch.nn.functional.cross_entropy(out["logits"].float().reshape(-1, m.cfg.vocab_size), ids.reshape(-1))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    with torch.no_grad():
        e = rel(out["logits"].float(), m64(ids)["logits"])
    assert e < 0.05, f"bf16 autocast logits differ from float64 by {e:.2e}"
    print(f"[ok] GatedAct backward == autograd (gradcheck); fp32 chunked KDA at gate extremes vs float64 recurrence: {worst:.2e} (grads finite); "
          f"bf16-autocast model fwd/bwd finite, logits rel err vs float64 {e:.2e}")


def ckpt_load(folder):
    from k3_torch import load_safetensors_dir

    return load_safetensors_dir(folder)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=None, help="write the checkpoints here instead of a temp dir")
    a = ap.parse_args()
    torch.set_num_threads(2)
    base = a.keep or tempfile.mkdtemp(prefix="k3_equiv_")
    lengths = [1, 37, 130]

    # 1. published-layout random checkpoint (padded A_log, 2 shards, stray vision tensor)
    d1 = os.path.join(base, "random-k3")
    root, tensors = make_random_ckpt.build("k3", seed=3)
    make_random_ckpt.write(d1, root, tensors, shards=2)
    mine1, ref1 = check_target(d1, lengths, "make_random_ckpt k3")

    # 2. the trainer's own init + writer (smoke-size config, random AttnRes/router bias so every
    #    path is exercised), read back by the reference
    d2 = os.path.join(base, "trainer-k3")
    tok = FakeTok(400)
    root2 = ckpt.target_config(tok, hidden=64, layers=6, intermediate=96, kda_heads=2, kda_head_dim=32,
                               mla_heads=2, q_lora=32, kv_lora=32, nope=16, rope=8, v_head=16, experts=8,
                               topk=2, moe_inter=32, shared=1, latent=32, expert_groups=4, topk_group=2,
                               attn_res_block=2)
    m2 = K3ForTraining(root2)
    init_weights(m2, std=0.3, seed=1)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, p in m2.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for moe in m2.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(moe.E, generator=gen) * 0.1)
    ckpt.save_model_dir(d2, root2, export_tensors(m2), shard=True, max_file_bytes=150_000 + ckpt.HEADER_SLACK)
    n_shards = len([f for f in os.listdir(d2) if f.endswith(".safetensors")])
    assert n_shards > 1, "the small shard limit should have produced several shards"
    mine2, ref2 = check_target(d2, lengths, f"trainer init + writer ({n_shards} shards)")

    # 3. DSpark draft written by the trainer, on both targets (taps incl. -1 on the first)
    for label, tdir, mt, rt, taps in (("draft on random-k3", d1, mine1, ref1, [-1, 1, 4, 9]),
                                      ("draft on trainer-k3", d2, mine2, ref2, [1, 3, 5])):
        with open(os.path.join(tdir, "config.json")) as f:
            troot = json.load(f)
        ftok = FakeTok(mt.cfg.vocab_size - 256)
        droot = ckpt.draft_config(troot, ftok, layers=2, heads=4, intermediate=128, q_lora=32, kv_lora=32,
                                  nope=16, rope=8, v_head=16, markov_rank=16, taps=taps)
        md = DSparkDraft(droot)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in md.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
            md.embed_tokens.weight.copy_(mt.lm.model.embed_tokens.weight.float())
        ddir = os.path.join(base, label.replace(" ", "_"))
        ckpt.save_model_dir(ddir, droot, export_tensors(md, lambda n: torch.bfloat16), shard=False)
        check_draft(tdir, ddir, mt, rt, label)

    # 4. training precision: fp32 chunked KDA at the gate extremes (lb = -5 decays over a 64-chunk
    #    reach e^-320) stays finite and close to the float64 recurrence, gradients included; and a
    #    bf16-autocast forward/backward of the whole model runs (the GPU code path's dtypes).
    check_training_precision(mine2)

    # 5. the shipped tiny-k3 (init-model preset) with its draft, if present
    tiny = os.path.join(HERE, "..", "..", "models", "tiny-k3")
    if os.path.isdir(os.path.join(tiny, "draft")):
        mt, rt = check_target(tiny, [37], "models/tiny-k3", B=1)
        check_draft(tiny, os.path.join(tiny, "draft"), mt, rt, "models/tiny-k3/draft")
    print("all equivalence checks passed")


if __name__ == "__main__":
    main()
