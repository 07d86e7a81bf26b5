#!/usr/bin/env python3
"""Checks the float64 reference (model.py) for self-consistency and against independent implementations
installable from PyPI.  Not run in CI; results are recorded in tools/reference/README.md.

  pip install torch safetensors numpy transformers einops
  pip install flash-linear-attention fla-core      # fla 0.6 splits ops (fla-core) from layers/models

usage: check_upstream.py [--k3 DIR] [--linear DIR] [--skip-tf] [--skip-fla]
  --k3 / --linear default to random checkpoints made by make_random_ckpt.py in a temp folder.

Sections
  self   : chunked KDA (§3.6) == naive recurrence (§3.4); MLA absorbed (§4.4) == expanded (§4.3);
           prefill-then-decode == full forward (KDA conv + recurrent state, MLA latent cache);
           group-limited router == a brute-force per-token router, weights sum to routed_scaling_factor;
           AttnRes candidate counts (§12); MXFP4 dequantisation round trip.
  fla    : fla.ops.kda.naive (naive_recurrent_kda, naive_chunk_kda), fla.ops.kda.gate (naive_kda_gate,
           naive_kda_lowerbound_gate), fla.ops.attnres.naive.naive_attnres, and fla's own KDAModel /
           KDABlock AttnRes schedule (sublayer-counted, attnres_block_size = 2N) driving the reference's
           mixers and FFNs on the K3-layout checkpoint.
  tf     : transformers KimiLinearForCausalLM (models/kimi_linear) loaded from the kimi_linear-layout
           checkpoint: stock (its KDA path casts to fp32) and with its fp32 casts promoted to fp64;
           also its cached prefill + single-token decode path.
"""
import argparse
import math
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS = []


def report(name, err, tol):
    ok = bool(err <= tol) and not math.isnan(err)
    RESULTS.append((name, err, tol, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {err:.3e} (tol {tol:.0e})", flush=True)


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


# ---------------------------------------------------------------------------------------------------
# self-consistency
# ---------------------------------------------------------------------------------------------------


def check_self(k3_dir, lin_dir):
    import model as M

    g = torch.Generator().manual_seed(0)
    T, H, dk = 150, 3, 16
    q = M.l2_norm(torch.randn(T, H, dk, generator=g, dtype=M.DT)) * dk ** -0.5
    k = M.l2_norm(torch.randn(T, H, dk, generator=g, dtype=M.DT))
    v = torch.randn(T, H, dk, generator=g, dtype=M.DT)
    beta = torch.rand(T, H, generator=g, dtype=M.DT)
    S0 = torch.randn(H, dk, dk, generator=g, dtype=M.DT)
    for lo, tag in ((-5.0, "lb=-5"), (-0.3, "mild")):
        gg = lo * torch.rand(T, H, dk, generator=g, dtype=M.DT)
        o1, s1 = M.kda_recurrence(q, k, v, gg, beta, S0)
        for C in (64, 16, 7):
            o2, s2 = M.kda_chunked(q, k, v, gg, beta, S0, C)
            report(f"self: KDA chunked(C={C}) == naive, {tag} [out, state]", max(rel(o2, o1), rel(s2, s1)), 1e-12)

    for d in (k3_dir, lin_dir):
        tag = os.path.basename(d.rstrip("/"))
        ref = M.ReferenceModel.from_dir(d)
        ids = np.random.default_rng(1).integers(0, ref.cfg.vocab_size, 150)
        full = ref.forward(ids)
        if ref.w.unused():
            report(f"self[{tag}]: every checkpoint tensor used (unused: {ref.w.unused()[:3]})", 1.0, 0.0)
        inc = ref.forward_incremental(ids, chunks=[61, 1, 1, 1, 5, 1, 30, 1])
        e = max([rel(inc.logits, full.logits), rel(inc.final_hidden, full.final_hidden)]
                + [rel(a, b) for a, b in zip(inc.hidden, full.hidden)])
        report(f"self[{tag}]: prefill(61)+decode/chunks == full forward [logits, hidden.*]", e, 1e-10)
        one = ref.forward_incremental(ids[:40], chunks=[1])
        report(f"self[{tag}]: token-by-token == full forward (40 tokens)", rel(one.logits, full.logits[:40]), 1e-10)
        ch = M.ReferenceModel(ref.cfg, ref.w, kda_mode="chunk", mla_form="absorbed").forward(ids)
        report(f"self[{tag}]: full forward with chunked KDA + absorbed MLA == naive + expanded",
               rel(ch.logits, full.logits), 1e-10)

        # router: brute force per token, §5.3
        cfg = ref.cfg
        errs, sums = [], []
        for i, f in enumerate(ref.ffns):
            if not isinstance(f, M.MoE):
                continue
            x = torch.randn(64, cfg.hidden_size, generator=g, dtype=M.DT)
            idx, wts = f.route(x)
            s = torch.sigmoid(x @ f.Wr.T)
            for t in range(x.shape[0]):
                sel = (s[t] + f.bias).tolist()
                allowed = list(range(f.E))
                G = cfg.num_expert_group
                if cfg.use_grouped_topk and G > 1 and G > cfg.topk_group:
                    gs = f.E // G
                    gscore = [sum(sorted(sel[j * gs:(j + 1) * gs], reverse=True)[:2]) for j in range(G)]
                    keep = sorted(range(G), key=lambda j: -gscore[j])[: cfg.topk_group]
                    allowed = [e for e in allowed if e // gs in keep]
                top = sorted(allowed, key=lambda e: -sel[e])[: f.k]
                w = [s[t, e].item() for e in top]
                w = [x_ / (sum(w) + 1e-20) * cfg.routed_scaling_factor for x_ in w] if cfg.moe_renormalize \
                    else [x_ * cfg.routed_scaling_factor for x_ in w]
                got = dict(zip(idx[t].tolist(), wts[t].tolist()))
                errs.append(0.0 if set(got) == set(top) and all(abs(got[e] - ww) < 1e-12 for e, ww in zip(top, w))
                            else 1.0)
            sums.append((wts.sum(-1) - cfg.routed_scaling_factor).abs().max().item())
        report(f"self[{tag}]: router == brute force (groups={cfg.num_expert_group}, topk_group={cfg.topk_group})",
               max(errs), 0.0)
        report(f"self[{tag}]: routed weights sum to routed_scaling_factor={cfg.routed_scaling_factor}", max(sums),
               1e-12)

        if cfg.attn_res_block_size:
            N, counts = cfg.attn_res_block_size, []
            orig = M.attnres_mix
            M.attnres_mix = lambda c, qv, eps: (counts.append(len(c)), orig(c, qv, eps))[1]
            try:
                ref.forward(ids[:3])
            finally:
                M.attnres_mix = orig
            want = []
            for i in range(cfg.num_hidden_layers):
                want += [math.ceil(i / N) + 1, i // N + 2]
            want.append(len(range(0, cfg.num_hidden_layers, N)) + 1)
            report(f"self[{tag}]: AttnRes candidate counts == ceil(i/N)+1 / floor(i/N)+2 / banks+1 (N={N})",
                   0.0 if counts == want else 1.0, 0.0)

    from make_random_ckpt import quant_mxfp4
    w = torch.randn(48, 64, generator=g, dtype=M.DT)
    pk, sc = quant_mxfp4(w)
    dq = M.dequant_mxfp4(pk, sc)
    pk2, sc2 = quant_mxfp4(dq)
    same = torch.equal(M.dequant_mxfp4(pk2, sc2), dq)  # values only: ±0 and a smaller exact scale may differ
    # bit layout (§5.4): byte 0x9B -> element 0 = low nibble 0xB = -1.5, element 1 = high nibble 0x9 = -0.5;
    # scale byte 128 -> x2; the other 30 elements of the group are code 0x7 / 0x0 = 6 / 0
    pk3 = torch.tensor([[0x9B] + [0x07] * 15], dtype=torch.uint8)
    want = torch.tensor([[-3.0, -1.0] + [12.0, 0.0] * 15], dtype=M.DT)
    same = same and torch.equal(M.dequant_mxfp4(pk3, torch.tensor([[128]], dtype=torch.uint8)), want)
    report("self: MXFP4 dequant(quant(w)) is a fixed point; |dq - w| / max|w| within FP4 step",
           0.0 if same and rel(dq, w) < 0.2 else 1.0, 0.0)


# ---------------------------------------------------------------------------------------------------
# flash-linear-attention
# ---------------------------------------------------------------------------------------------------


def check_fla(k3_dir):
    import model as M
    from fla.ops.attnres.naive import naive_attnres
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    g = torch.Generator().manual_seed(1)
    T, H, K = 128, 4, 16
    qn = M.l2_norm(torch.randn(T, H, K, generator=g, dtype=M.DT))
    kn = M.l2_norm(torch.randn(T, H, K, generator=g, dtype=M.DT))
    v = torch.randn(T, H, K, generator=g, dtype=M.DT)
    beta = torch.rand(T, H, generator=g, dtype=M.DT)
    S0 = torch.randn(H, K, K, generator=g, dtype=M.DT)
    for lo, tag in ((-5.0, "g in (-5,0)"), (-0.5, "g in (-0.5,0)")):
        gg = lo * torch.rand(T, H, K, generator=g, dtype=M.DT)
        o_ref, s_ref = M.kda_recurrence(qn * K ** -0.5, kn, v, gg, beta, S0)
        args = [x.unsqueeze(0) for x in (qn, kn, v, gg, beta)]
        o1, s1 = naive_recurrent_kda(*args, initial_state=S0.unsqueeze(0), output_final_state=True)
        report(f"fla naive_recurrent_kda vs reference recurrence, {tag} [out, state] (fla computes fp32)",
               max(rel(o1[0], o_ref), rel(s1[0], s_ref)), 1e-5)
        if lo > -1:  # fla's naive chunk exponentiates unmasked positive differences: keep the span small
            o2, s2 = naive_chunk_kda(*args, initial_state=S0.unsqueeze(0), output_final_state=True, chunk_size=64)
            report(f"fla naive_chunk_kda vs reference recurrence, {tag} [out, state]",
                   max(rel(o2[0], o_ref), rel(s2[0], s_ref)), 1e-5)
        ck, sk = M.kda_chunked(qn * K ** -0.5, kn, v, gg, beta, S0, 64)
        report(f"reference chunked vs reference recurrence, {tag}", max(rel(ck, o_ref), rel(sk, s_ref)), 1e-12)

    f = torch.randn(T, H, K, generator=g, dtype=M.DT) * 3
    dtb = torch.randn(H * K, generator=g, dtype=M.DT)
    A_log = torch.log(1 + 15 * torch.rand(H, generator=g, dtype=M.DT))
    report("fla naive_kda_gate vs reference softplus gate (KL form)",
           rel(naive_kda_gate(f, A_log, dtb, output_dtype=torch.float64), M.kda_gate(f, dtb, A_log, None)), 1e-6)
    report("fla naive_kda_lowerbound_gate vs reference lower-bound gate (K3 form, lb=-5)",
           rel(naive_kda_lowerbound_gate(f, A_log, dtb, -5.0, output_dtype=torch.float64),
               M.kda_gate(f, dtb, A_log, -5.0)), 1e-6)

    D = 64
    cands = [torch.randn(T, D, generator=g, dtype=M.DT) * s for s in (1.0, 3.0, 0.2, 1.5)]
    n = 1 + 0.1 * torch.randn(D, generator=g, dtype=M.DT)
    p = torch.randn(D, generator=g, dtype=M.DT) * 2 / math.sqrt(D)
    for m in (1, 2, 4):
        report(f"fla naive_attnres vs reference mix, {m} candidate(s)",
               rel(naive_attnres(p, cands[:m], n, rms_eps=1e-5), M.attnres_mix(cands[:m], n * p, 1e-5)), 1e-5)

    # fla's whole-model AttnRes schedule (fla/models/kda/modeling_kda.py, models/modeling_utils.py) with the
    # reference's mixers and FFNs plugged in.  fla counts sub-layers, so K3's N corresponds to fla's 2N.
    import fla.models.kda.modeling_kda as mkd
    import fla.models.modeling_utils as mu
    from fla.models.kda import KDAConfig, KDAModel

    ref = M.ReferenceModel.from_dir(k3_dir)
    cfg = ref.cfg
    if not cfg.attn_res_block_size:
        print("skip: fla AttnRes schedule (checkpoint has no AttnRes)")
        return
    mkd.fused_attnres = mu.fused_attnres = naive_attnres  # the triton kernel needs a GPU; naive is its reference
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    fc = KDAConfig(hidden_size=D, num_hidden_layers=L, num_heads=2, head_dim=16, vocab_size=8,
                   attnres_block_size=2 * cfg.attn_res_block_size, norm_eps=cfg.rms_norm_eps, fuse_norm=False,
                   fuse_swiglu=False, fuse_cross_entropy=False)
    fm = KDAModel(fc).to(torch.float64).eval()

    class Mixer(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, hidden_states, **kw):
            out, _ = ref._mixer(self.i, hidden_states[0], ref.mixers[self.i].new_state(), True)
            return out.unsqueeze(0), None, None

    class FFN(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, x, **kw):
            return ref.ffns[self.i](x[0]).unsqueeze(0)

    w = ref.w
    with torch.no_grad():
        for i, blk in enumerate(fm.layers):
            pfx = f"model.layers.{i}."
            blk.attn, blk.mlp = Mixer(i), FFN(i)
            blk.attn_norm.weight.copy_(w(pfx + "input_layernorm.weight"))
            blk.mlp_norm.weight.copy_(w(pfx + "post_attention_layernorm.weight"))
            blk.attn_res_norm.weight.copy_(w(pfx + "self_attention_res_norm.weight"))
            blk.attn_res_proj.weight.copy_(w(pfx + "self_attention_res_proj.weight").view(1, D))
            blk.mlp_res_norm.weight.copy_(w(pfx + "mlp_res_norm.weight"))
            blk.mlp_res_proj.weight.copy_(w(pfx + "mlp_res_proj.weight").view(1, D))
        fm.norm.weight.copy_(w("model.norm.weight"))
        fm.res_norm.weight.copy_(w("model.output_attn_res_norm.weight"))
        fm.res_proj.weight.copy_(w("model.output_attn_res_proj.weight").view(1, D))
        ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 150)
        out = ref.forward(ids)
        emb = ref.embed[torch.as_tensor(ids)].unsqueeze(0)
        fo32 = fm(inputs_embeds=emb, use_cache=False, output_hidden_states=True, return_dict=True)
        orig_float = torch.Tensor.float  # naive_attnres computes in fp32 via .float(): promote to fp64
        torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
        try:
            fo64 = fm(inputs_embeds=emb, use_cache=False, output_hidden_states=True, return_dict=True)
        finally:
            torch.Tensor.float = orig_float
    # fla's hidden_states: (input of layer 0, input of layer 1 = P after layer 0, ..., final normed)
    for fo, prec, tol in ((fo32, "fp32 mix", 1e-4), (fo64, "mix promoted to fp64", 1e-12)):
        e_h = max(rel(fo.hidden_states[i + 1][0], out.hidden[i]) for i in range(L - 1))
        report(f"fla KDAModel AttnRes schedule (bs={2 * cfg.attn_res_block_size}, {prec}) vs reference: "
               f"hidden.0..{L - 2} (taps P)", e_h, tol)
        report(f"fla KDAModel AttnRes schedule ({prec}) vs reference: final normed hidden",
               max(rel(fo.last_hidden_state[0], out.final_hidden), rel(fo.hidden_states[-1][0], out.final_hidden)),
               tol)


# ---------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------


def import_tf_kimi_linear():
    """transformers binds `chunk_kda` etc. to fla's triton kernels at import time when fla is importable;
    those need a GPU.  Hide fla while the modeling module is imported so the torch fallbacks are bound."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None
    try:
        import transformers.models.kimi_linear.modeling_kimi_linear as mk
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    return mk


class _Fp64Torch(types.ModuleType):
    def __getattr__(self, k):
        return torch.float64 if k in ("float32", "float") else getattr(torch, k)


def check_tf(lin_dir):
    import model as M

    mk = import_tf_kimi_linear()
    import transformers

    ref = M.ReferenceModel.from_dir(lin_dir)
    ids = np.random.default_rng(1).integers(0, ref.cfg.vocab_size, 150)
    out = ref.forward(ids)
    tid = torch.as_tensor(ids).unsqueeze(0)

    def load():
        m = mk.KimiLinearForCausalLM.from_pretrained(lin_dir, dtype=torch.float64, experts_implementation="eager",
                                                     attn_implementation="eager")
        return m.eval()

    print(f"transformers {transformers.__version__}")
    m = load()
    with torch.no_grad():
        o = m(tid, output_hidden_states=True)
    report("tf KimiLinearForCausalLM (fp64 weights, stock: KDA/gates/gated-norm in fp32) logits vs reference",
           rel(o.logits[0], out.logits), 1e-4)

    # promote transformers' explicit fp32 casts inside modeling_kimi_linear to fp64
    orig_torch, orig_float = mk.torch, torch.Tensor.float
    mk.torch = _Fp64Torch("torch_fp64_proxy")
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        m = load()
        with torch.no_grad():
            o = m(tid, output_hidden_states=True)
            hs = o.hidden_states  # (embeddings, after layer 0, ..., after layer L-2, final normed)
            L = ref.cfg.num_hidden_layers
            report("tf (fp32 casts promoted to fp64) logits vs reference", rel(o.logits[0], out.logits), 1e-12)
            report("tf (fp64) hidden_states[i+1] vs reference hidden.i, i < L-1",
                   max(rel(hs[i + 1][0], out.hidden[i]) for i in range(L - 1)), 1e-12)
            report("tf (fp64) last hidden_states vs reference final_hidden", rel(hs[-1][0], out.final_hidden), 1e-12)
            o1 = m(tid[:, :100], use_cache=True)
            cache = getattr(o1, "cache", None) or o1.past_key_values
            lg = [o1.logits[0]]
            for t in range(100, tid.shape[1]):
                ot = m(tid[:, t: t + 1], cache=cache, use_cache=True)
                cache = getattr(ot, "cache", None) or ot.past_key_values
                lg.append(ot.logits[0])
            report("tf (fp64) cached prefill(100) + 50 single-token decode steps vs reference full forward",
                   rel(torch.cat(lg), out.logits), 1e-12)
    finally:
        mk.torch, torch.Tensor.float = orig_torch, orig_float


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3")
    ap.add_argument("--linear")
    ap.add_argument("--skip-tf", action="store_true")
    ap.add_argument("--skip-fla", action="store_true")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    tmp = tempfile.mkdtemp(prefix="dsref_")
    if not a.k3 or not a.linear:
        from make_random_ckpt import build, write
        if not a.k3:
            a.k3 = os.path.join(tmp, "random-k3")
            write(a.k3, *build("k3", 0), shards=2)
        if not a.linear:
            a.linear = os.path.join(tmp, "random-linear")
            write(a.linear, *build("linear", 0), shards=1)
    print(f"K3-layout checkpoint: {a.k3}\nKL-layout checkpoint: {a.linear}")
    check_self(a.k3, a.linear)
    if not a.skip_tf:  # before fla is imported (see import_tf_kimi_linear)
        check_tf(a.linear)
    if not a.skip_fla:
        check_fla(a.k3)
    bad = [r for r in RESULTS if not r[3]]
    print(f"{len(RESULTS) - len(bad)} passed, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
