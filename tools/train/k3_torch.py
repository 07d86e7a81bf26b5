"""Batched, differentiable Kimi-K3 text model for training (docs/model.md §2-§7).

Same math as tools/reference/model.py (checked to 1e-9 in float64 by check_equiv.py), but for [B, T]
batches with autograd and without any cache:
  * KDA in the chunked form of §3.6 (C = 64), vectorised over batch, heads and chunks; only the
    inter-chunk state pass is a Python loop (T/64 steps);
  * MLA in the expanded form of §4.3 through F.scaled_dot_product_attention (causal);
  * MoE: sigmoid router with group-limited top-k and e_score_correction_bias (a buffer, updated by the
    aux-loss-free sign rule if the trainer asks), experts evaluated densely with masked combine weights
    (two GEMMs over all experts: cheap for a few small experts, no gather/scatter);
  * latent MoE, SiTU, AttnRes (§6.3 schedule, mix-then-bank).
Parameter names are the checkpoint tensor names, so `state_dict()` is the checkpoint (the stacked
expert tensors are split into `experts.{e}.w{1,2,3}.weight` by state-dict hooks).

Precision: run under bf16 autocast with fp32 master weights; norms, gates, the KDA core, router,
AttnRes and activations are computed in fp32 (or float64 when the module is double, for the check).
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from model import parse_config  # noqa: E402  (the reference's reading of config.json, so both agree)

MLA_NORM_EPS = 1e-6  # target q_a / kv_a norms (§4.5, trap 1)


def hp(x: torch.Tensor) -> torch.Tensor:
    """The precision for sensitive math: fp32, or float64 when the model runs in float64."""
    return x if x.dtype == torch.float64 else x.float()


def no_autocast(x: torch.Tensor):
    return torch.autocast(device_type=x.device.type, enabled=False)


def rms_norm(x, w, eps):
    x = hp(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * hp(w)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        with no_autocast(x):
            return rms_norm(x, self.weight, self.eps)


class GatedAct(torch.autograd.Function):
    """y = act(a, u) [· w] in high precision, saving only the (bf16) inputs and recomputing the
    elementwise terms in backward: the dense-expert activation over all E·I lanes would otherwise keep
    ~8 fp32 intermediates per lane for backward (most of the activation memory)."""

    @staticmethod
    def _terms(a, u, kind, beta, bl):
        if kind == "situ":   # β tanh(a/β) σ(a) · φ(u), φ(u) = βl tanh(u/βl) or u
            ta, sa = torch.tanh(a / beta), torch.sigmoid(a)
            g = beta * ta * sa
            dg = (1 - ta * ta) * sa + beta * ta * sa * (1 - sa)
        else:                # silu(a) · u
            sa = torch.sigmoid(a)
            g = a * sa
            dg = sa * (1 + a * (1 - sa))
        if bl is None:
            phi, dphi = u, torch.ones_like(u)
        else:
            tu = torch.tanh(u / bl)
            phi, dphi = bl * tu, 1 - tu * tu
        return g, dg, phi, dphi

    @staticmethod
    def forward(ctx, a, u, w, kind, beta, bl):
        ctx.kind, ctx.beta, ctx.bl = kind, beta, bl
        ctx.save_for_backward(a, u, w)
        g, _, phi, _ = GatedAct._terms(hp(a), hp(u), kind, beta, bl)
        y = g * phi
        return y if w is None else y * hp(w).unsqueeze(-1)

    @staticmethod
    def backward(ctx, gy):
        a, u, w = ctx.saved_tensors
        g, dg, phi, dphi = GatedAct._terms(hp(a), hp(u), ctx.kind, ctx.beta, ctx.bl)
        gw = None
        if w is not None:
            if ctx.needs_input_grad[2]:
                gw = (gy * g * phi).sum(-1).to(w.dtype)
            gy = gy * hp(w).unsqueeze(-1)
        ga = (gy * phi * dg).to(a.dtype) if ctx.needs_input_grad[0] else None
        gu = (gy * g * dphi).to(u.dtype) if ctx.needs_input_grad[1] else None
        return ga, gu, gw, None, None, None


def make_act(cfg):
    """§5.1 in fp32: SiTU (HF-K3 semantics, trap 12) or SwiGLU.  act(a, u, w=None): w optionally
    scales the result per leading index (the dense experts' combine weights)."""
    if cfg.hidden_act == "situ":
        b, bl = cfg.situ_beta, cfg.situ_linear_beta
        return lambda a, u, w=None: GatedAct.apply(a, u, w, "situ", b, bl)
    return lambda a, u, w=None: GatedAct.apply(a, u, w, "silu", 1.0, None)


# ------------------------------------------------------------------------------------------------
# KDA (§3)
# ------------------------------------------------------------------------------------------------


def kda_chunked(q, k, v, g, beta, C: int = 64, S: int = 16):
    """Chunked KDA (§3.6), zero initial state.  q (scaled), k (L2-normed), g (log decay <= 0):
    [B, H, T, dk]; v: [B, H, T, dv]; beta: [B, H, T].  Returns o [B, H, T, dv].

    e^{Γ_i-Γ_j} is never formed from e^{Γ_i}·e^{-Γ_j} over a whole chunk (K3's lb = -5 makes a
    64-chunk span -320, far beyond fp32): the chunk is cut into sub-chunks of S rows and pair (a, b)
    of sub-chunks uses a reference Γ_ref(b) at the middle of b, so every factor is bounded by
    e^{|lb|·S/2} (e^40 for lb = -5) and products on valid (j <= i) pairs are <= 1."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % C
    if pad:  # zero rows at the end: no decay, no write, and later rows never feed earlier ones
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    Tp = T + pad
    N, nS = Tp // C, C // S
    q, k, g = (t.reshape(B, H, N, C, dk) for t in (q, k, g))
    v = v.reshape(B, H, N, C, dv)
    beta = beta.reshape(B, H, N, C, 1)
    G = g.cumsum(-2)                                                  # Γ, in-chunk cumulative
    Gs = G.view(B, H, N, nS, S, dk)
    ref = Gs[..., S // 2, :]                                          # [B,H,N,nS,dk]
    Ke = k.view(B, H, N, nS, S, dk) * torch.exp(ref.unsqueeze(-2) - Gs)       # k_j e^{Γref(b)-Γ_j}
    ab = torch.ones(nS, nS, dtype=torch.bool, device=q.device).tril()        # a >= b
    expo = Gs.unsqueeze(4) - ref.unsqueeze(3).unsqueeze(-2)                   # [B,H,N,a,b,S,dk]
    # Pairs a < b are masked out entirely; -inf there keeps their (huge) exponent from overflowing.
    E = torch.exp(expo.masked_fill(~ab.view(nS, nS, 1, 1), float("-inf")))
    Qe = q.view(B, H, N, nS, 1, S, dk) * E
    Kq = k.view(B, H, N, nS, 1, S, dk) * E
    A = torch.einsum("...abid,...bjd->...aibj", Qe, Ke).reshape(B, H, N, C, C)
    Lm = torch.einsum("...abid,...bjd->...aibj", Kq, Ke).reshape(B, H, N, C, C)
    idx = torch.arange(C, device=q.device)
    A = A.masked_fill(idx.view(C, 1) < idx.view(1, C), 0.0)                  # keep j <= i
    Lm = Lm.masked_fill(idx.view(C, 1) <= idx.view(1, C), 0.0) * beta         # keep j < i; row i times β_i
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # Tm = (I + L)^-1 diag(β): one triangular solve for Wc = Tm (e^Γ ⊙ K) and U = Tm V together.
    rhs = torch.cat([beta * torch.exp(G) * k, beta * v], dim=-1)
    sol = torch.linalg.solve_triangular(eye + Lm, rhs, upper=False, unitriangular=True)
    Wc, U = sol[..., :dk], sol[..., dk:]
    Qg = q * torch.exp(G)
    Kd = k * torch.exp(G[..., -1:, :] - G)                           # e^{Γ_last-Γ_j} k_j
    decay = torch.exp(G[..., -1, :]).unsqueeze(-1)                   # [B,H,N,dk,1]
    St = q.new_zeros(B, H, dk, dv)
    outs = []
    for n in range(N):  # the only sequential part: T/C steps of small batched matmuls
        Vp = U[:, :, n] - Wc[:, :, n] @ St
        outs.append(Qg[:, :, n] @ St + A[:, :, n] @ Vp)
        St = decay[:, :, n] * St + Kd[:, :, n].transpose(-1, -2) @ Vp
    o = torch.stack(outs, dim=2).reshape(B, H, Tp, dv)
    return o[:, :, :T]


class DepthwiseConv(nn.Module):
    """Causal depthwise short conv, weight [P, 1, W] as in the checkpoint (§3.2 step 2)."""

    def __init__(self, P, W):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(P, 1, W))

    def forward(self, x):  # x [B, T, P] (pre-conv projection) -> silu(conv) [B, T, P], high precision
        T, W = x.shape[1], self.weight.shape[-1]
        y = F.conv1d(hp(x).transpose(1, 2), hp(self.weight), padding=W - 1, groups=x.shape[-1])
        return F.silu(y[..., :T].transpose(1, 2))


class KDAAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        P = H * dk
        self.cfg, self.H, self.dk, self.P = cfg, H, dk, P
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, P, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (DepthwiseConv(P, cfg.conv_kernel) for _ in range(3))
        self.f_a_proj = nn.Linear(D, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, P, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.b_proj = nn.Linear(D, H, bias=False)
        if cfg.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, P, bias=False)
        self.o_norm = RMSNorm(dk, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)

    def _load_from_state_dict(self, sd, prefix, *args, **kw):
        # A_log ships as [1,1,Hk,1] (KL) or padded [>=Hk] (K3): keep the first Hk entries (trap 3)
        key = prefix + "A_log"
        if key in sd and sd[key].numel() != self.H:
            sd[key] = sd[key].reshape(-1)[: self.H]
        super()._load_from_state_dict(sd, prefix, *args, **kw)

    def forward(self, x):
        B, T, _ = x.shape
        H, dk = self.H, self.dk
        qh, kh, vh = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        f = self.f_b_proj(self.f_a_proj(x))
        braw = self.b_proj(x)
        gate = self.g_proj(x) if self.cfg.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        with no_autocast(x):
            q = self.q_conv1d(qh).view(B, T, H, dk)
            k = self.k_conv1d(kh).view(B, T, H, dk)
            v = self.v_conv1d(vh).view(B, T, H, dk)
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5   # L2, eps in root
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            fp = hp(f).view(B, T, H, dk) + hp(self.dt_bias).view(H, dk)
            a = torch.exp(hp(self.A_log)).view(H, 1)
            lb = self.cfg.gate_lower_bound
            if lb is None:
                g = -a * F.softplus(fp, threshold=20.0)               # Kimi-Linear form
            else:
                g = lb * torch.sigmoid(a * fp)                        # K3 lower-bound form
            beta = torch.sigmoid(hp(braw))                            # [B, T, H]
            o = kda_chunked(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                            beta.transpose(1, 2))
            o = o.transpose(1, 2)                                     # [B, T, H, dv]
            y = rms_norm(o, self.o_norm.weight, self.cfg.rms_norm_eps) * torch.sigmoid(hp(gate)).view(B, T, H, dk)
        return self.o_proj(y.reshape(B, T, self.P))


# ------------------------------------------------------------------------------------------------
# MLA (§4), expanded form, NoPE
# ------------------------------------------------------------------------------------------------


class MLAAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, Ha = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.Ha = cfg, Ha
        self.dn, self.dr, self.dv, self.R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qd = Ha * (self.dn + self.dr)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qd, bias=False)
        else:
            self.q_proj = nn.Linear(D, qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.R, Ha * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(Ha * self.dv, D, bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(D, Ha * self.dv, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        Ha, dn, dr, dv, R = self.Ha, self.dn, self.dr, self.dv, self.R
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.cfg.q_lora_rank else self.q_proj(x)
        q = q.view(B, T, Ha, dn + dr)
        kv = self.kv_a_proj_with_mqa(x)
        kvb = self.kv_b_proj(self.kv_a_layernorm(kv[..., :R])).view(B, T, Ha, dn + dv)
        dt = kvb.dtype
        # key_h = [kN_h | kR] with kR shared by all heads and never rotated (NoPE, §4.2/4.3)
        k = torch.cat([kvb[..., :dn], kv[..., R:].to(dt).unsqueeze(2).expand(B, T, Ha, dr)], dim=-1)
        o = F.scaled_dot_product_attention(q.to(dt).transpose(1, 2), k.transpose(1, 2),
                                           kvb[..., dn:].transpose(1, 2), is_causal=True,
                                           scale=(dn + dr) ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, Ha * dv)
        if self.cfg.mla_use_output_gate:  # K3 output gate on the flattened heads (§4.5)
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


# ------------------------------------------------------------------------------------------------
# FFN (§5)
# ------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, D, I, act):
        super().__init__()
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)
        self.act = act

    def forward(self, x):
        a, u = self.gate_proj(x), self.up_proj(x)
        with no_autocast(x):
            h = self.act(a, u)
        return self.down_proj(h)


class Router(nn.Module):
    def __init__(self, E, D):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, D))
        # noaux_tc selection bias: not a gradient parameter; fp32 always (trap 2)
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))


class Experts(nn.Module):
    """All routed experts stacked: w13 [E, 2I, Din] (w1 rows then w3 rows), w2 [E, Din, I].
    The state dict reads/writes them as `{e}.w1.weight`, `{e}.w3.weight`, `{e}.w2.weight`."""

    def __init__(self, E, Din, I):
        super().__init__()
        self.E, self.I = E, I
        self.w13 = nn.Parameter(torch.zeros(E, 2 * I, Din))
        self.w2 = nn.Parameter(torch.zeros(E, Din, I))

    def _save_to_state_dict(self, dest, prefix, keep_vars):
        I = self.I
        for e in range(self.E):
            w13 = self.w13 if keep_vars else self.w13.detach()
            w2 = self.w2 if keep_vars else self.w2.detach()
            dest[prefix + f"{e}.w1.weight"] = w13[e, :I]
            dest[prefix + f"{e}.w3.weight"] = w13[e, I:]
            dest[prefix + f"{e}.w2.weight"] = w2[e]

    def _load_from_state_dict(self, sd, prefix, local_metadata, strict, missing, unexpected, errors):
        names = [prefix + f"{e}.{w}.weight" for e in range(self.E) for w in ("w1", "w3", "w2")]
        absent = [n for n in names if n not in sd]
        if absent:
            missing.extend(absent)
            return
        with torch.no_grad():
            for e in range(self.E):
                self.w13[e, : self.I].copy_(sd[prefix + f"{e}.w1.weight"])
                self.w13[e, self.I:].copy_(sd[prefix + f"{e}.w3.weight"])
                self.w2[e].copy_(sd[prefix + f"{e}.w2.weight"])

    def forward(self, u, dw, act):
        """u [N, Din], dw [N, E] dense combine weights (0 for unselected experts) -> [N, Din].
        Since W2 is linear, Σ_e w_e W2_e h_e = W2cat · (w ⊙ h): two GEMMs over all experts."""
        N, E, I = u.shape[0], self.E, self.I
        h = F.linear(u, self.w13.reshape(E * 2 * I, -1)).view(N, E, 2 * I)
        with no_autocast(u):
            hh = act(h[..., :I], h[..., I:], dw)
        w2 = self.w2.permute(1, 0, 2).reshape(self.w2.shape[1], E * I)
        return F.linear(hh.reshape(N, E * I), w2)


class SparseMoE(nn.Module):
    def __init__(self, cfg, act):
        super().__init__()
        D, E = cfg.hidden_size, int(cfg.num_experts)
        self.cfg, self.act, self.E, self.k = cfg, act, E, cfg.num_experts_per_token
        self.gate = Router(E, D)
        self.latent = cfg.routed_expert_hidden_size is not None
        Din = cfg.routed_expert_hidden_size if self.latent else D
        self.experts = Experts(E, Din, cfg.moe_intermediate_size)
        if cfg.num_shared_experts > 0:
            self.shared_experts = MLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, act)
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(D, Din, bias=False)
            self.routed_expert_up_proj = nn.Linear(Din, D, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Din, cfg.rms_norm_eps)
        self.track_load = False
        self.load = None  # tokens per expert in the last forward (for the bias update)

    def route(self, x):
        """§5.3 in high precision: indices [N, k], combine weights [N, k] (unbiased scores)."""
        cfg = self.cfg
        s = torch.sigmoid(F.linear(hp(x), hp(self.gate.weight)))
        sp = s + self.gate.e_score_correction_bias.to(s.dtype)
        G = cfg.num_expert_group
        if cfg.use_grouped_topk and G > 1 and G > cfg.topk_group:
            N = x.shape[0]
            grp = sp.view(N, G, self.E // G)
            gscore = grp.topk(min(2, self.E // G), dim=-1).values.sum(-1)
            keep = gscore.topk(cfg.topk_group, dim=-1).indices
            gmask = torch.zeros(N, G, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            sp = sp.masked_fill(~gmask.repeat_interleave(self.E // G, dim=1), float("-inf"))
        idx = sp.detach().topk(self.k, dim=-1).indices
        w = s.gather(1, idx)
        if cfg.moe_renormalize and self.k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor

    def forward(self, x):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        with no_autocast(x):
            idx, w = self.route(x)
            dw = torch.zeros(x.shape[0], self.E, dtype=w.dtype, device=x.device).scatter(1, idx, w)
        if self.track_load:
            flat = idx.reshape(-1)  # scatter_add keeps a static shape (torch.compile friendly)
            self.load = torch.zeros(self.E, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        u = self.routed_expert_down_proj(x) if self.latent else x
        y = self.experts(u, dw, self.act)
        if self.latent:
            if self.cfg.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.cfg.num_shared_experts > 0:
            y = y + self.shared_experts(x)                            # reads x at width D (trap 11)
        return y.reshape(*shp[:-1], -1)


# ------------------------------------------------------------------------------------------------
# AttnRes (§6)
# ------------------------------------------------------------------------------------------------


class ResProj(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, D))


def attnres_mix(cands, norm_w, proj_w, eps):
    """§6.2 in high precision.  score_j = (V_j · (n⊙p)) / sqrt(mean V_j² + eps): the normalised copy
    of V is never materialised."""
    if len(cands) == 1:
        return cands[0]
    V = torch.stack([hp(c) for c in cands], 0)                       # [m, ..., D]
    qv = hp(norm_w) * hp(proj_w).reshape(-1)
    score = (V @ qv) * torch.rsqrt(V.pow(2).mean(-1) + eps)          # [m, ...]
    alpha = torch.softmax(score, dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i, act):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.self_attn = KDAAttention(cfg) if cfg.layer_kinds[i] == "kda" else MLAAttention(cfg)
        self.is_moe = cfg.layer_is_moe(i)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(cfg, act)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, act)
        if cfg.attn_res_block_size:
            self.self_attention_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.self_attention_res_proj = ResProj(D)
            self.mlp_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.mlp_res_proj = ResProj(D)

    def ffn(self, x):
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)


class K3Model(nn.Module):
    """`model.*` of §7: embed_tokens, layers, norm (+ AttnRes output pair)."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.cfg = cfg
        act = make_act(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, act) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.output_attn_res_proj = ResProj(D)

    def forward(self, ids, taps=(), all_hidden=False):
        """Returns (final_hidden [B,T,D] after model.norm, {tap: [B,T,D]}, [hidden after each layer]).
        Tap L = the residual / AttnRes block-local P after layer L; tap -1 = embedding output (§8.3)."""
        eps, N = self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        want = set(taps)
        h = self.embed_tokens(ids)
        out_taps, hidden = {}, []
        if -1 in want:
            out_taps[-1] = h
        if N:  # §6.3: mix first, then bank; layer 0 banks the embedding
            P, R = h, []
            for i, layer in enumerate(self.layers):
                x = attnres_mix(R + [P], layer.self_attention_res_norm.weight,
                                layer.self_attention_res_proj.weight, eps)
                if i % N == 0:
                    R.append(P)
                    P = None
                a = layer.self_attn(layer.input_layernorm(x))
                P = hp(a) if P is None else P + a
                x = attnres_mix(R + [P], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
                P = P + layer.ffn(layer.post_attention_layernorm(x))
                if i in want:
                    out_taps[i] = P
                if all_hidden:
                    hidden.append(P)
            final = self.norm(attnres_mix(R + [P], self.output_attn_res_norm.weight,
                                          self.output_attn_res_proj.weight, eps))
        else:  # plain pre-norm (Kimi-Linear)
            h = hp(h)
            for i, layer in enumerate(self.layers):
                h = h + layer.self_attn(layer.input_layernorm(h))
                h = h + layer.ffn(layer.post_attention_layernorm(h))
                if i in want:
                    out_taps[i] = h
                if all_hidden:
                    hidden.append(h)
            final = self.norm(h)
        return final, out_taps, hidden


class K3LM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = K3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if not hasattr(self, "lm_head") else self.lm_head.weight


class K3ForTraining(nn.Module):
    """Root module: `language_model.` prefix for kimi_k3 configs (§7), none for kimi_linear."""

    def __init__(self, root_config: dict):
        super().__init__()
        self.root_config = root_config
        self.cfg = cfg = parse_config(root_config)
        self.prefixed = cfg.weight_prefix == "language_model."
        lm = K3LM(cfg)
        if self.prefixed:
            self.language_model = lm
        else:  # names `model.*`, `lm_head.*` at the top level
            self.model = lm.model
            if hasattr(lm, "lm_head"):
                self.lm_head = lm.lm_head
        self._lm = [lm]  # plain reference, not a second registration

    @property
    def lm(self) -> K3LM:
        return self._lm[0]

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.lm.model.layers if l.is_moe]

    def forward(self, ids, taps=(), logits_index=None, all_hidden=False, return_final=False):
        """ids [B, T] -> logits [B, T, V] (or [B, n, V] at positions logits_index [B, n]), taps dict.
        The lm_head runs only where logits are wanted."""
        final, out_taps, hidden = self.lm.model(ids, taps, all_hidden)
        h = final
        if logits_index is not None:
            h = final.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, final.shape[-1]))
        logits = F.linear(h, self.lm.head_weight())
        res = {"logits": logits, "taps": out_taps}
        if all_hidden:
            res["hidden"] = hidden
        if return_final:
            res["final"] = final
        return res


# ------------------------------------------------------------------------------------------------
# Init, checkpoint I/O
# ------------------------------------------------------------------------------------------------

# Tensors the K3 checkpoint stores in F32 (§3.1, §5.3, trap 4); everything else BF16.
F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def checkpoint_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(F32_SUFFIXES) else torch.bfloat16


@torch.no_grad()
def init_weights(model: K3ForTraining, std: float = 0.02, seed: int = 0):
    """GPT-style init: N(0, std) matrices, residual-output projections scaled by 1/sqrt(2L),
    norms 1, AttnRes projections 0 (uniform mix at start), KDA gates spread over useful decays."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    L = cfg.num_hidden_layers

    def normal_(t, s):
        t.copy_(torch.randn(t.shape, generator=g) * s)

    out_names = ("o_proj", "down_proj", "routed_expert_up_proj")
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            s = std / math.sqrt(2 * L) if name.endswith(out_names) else std
            normal_(mod.weight, s)
        elif isinstance(mod, RMSNorm):
            mod.weight.fill_(1.0)
        elif isinstance(mod, ResProj):
            mod.weight.zero_()
        elif isinstance(mod, Experts):
            normal_(mod.w13, std)
            normal_(mod.w2, std / math.sqrt(2 * L))
        elif isinstance(mod, DepthwiseConv):
            W = mod.weight.shape[-1]
            mod.weight.copy_((torch.rand(mod.weight.shape, generator=g) * 2 - 1) / math.sqrt(W))
        elif isinstance(mod, KDAAttention):
            H, dk = mod.H, mod.dk
            if cfg.gate_lower_bound is not None:
                # g = lb·σ(a(f+dt_bias)) with a = 1: σ(dt_bias) ∈ [0.002, 0.2] -> per-step decay
                # from ~0.99 down to e^{lb·0.2}; f starts small.
                u = 0.002 + torch.rand(H * dk, generator=g) * 0.198
                mod.dt_bias.copy_(torch.log(u / (1 - u)))
                mod.A_log.zero_()
            else:
                dt = torch.exp(math.log(1e-3) + torch.rand(H * dk, generator=g) * (math.log(1e-1) - math.log(1e-3)))
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                mod.A_log.copy_(torch.log(1.0 + 15.0 * torch.rand(H, generator=g)))
        elif isinstance(mod, Router):
            normal_(mod.weight, std)
            mod.e_score_correction_bias.zero_()


def export_tensors(model: nn.Module, dtype_fn=checkpoint_dtype) -> dict:
    """state_dict -> {name: contiguous tensor in checkpoint dtype} (on CPU)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.detach().to("cpu", dtype_fn(k)).contiguous().clone()
    return out


def load_safetensors_dir(folder: str) -> dict:
    from safetensors.torch import load_file
    import glob

    t = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        t.update(load_file(f))
    return t


def load_k3(folder: str, dtype=torch.float32, device="cpu") -> K3ForTraining:
    """A K3 / Kimi-Linear checkpoint folder (config.json + safetensors, sharded or not)."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        root = json.load(f)
    model = K3ForTraining(root)
    sd = load_safetensors_dir(folder)
    want = set(model.state_dict().keys())
    # skip vision_tower / mm_projector and anything outside the text model
    sd = {k: v for k, v in sd.items() if k in want}
    missing, unexpected = model.load_state_dict({k: v.to(torch.float64) for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise KeyError(f"{folder}: missing {missing[:8]} unexpected {unexpected[:8]}")
    return model.to(device=device, dtype=dtype)


def param_count(model: nn.Module, skip_prefixes=()) -> int:
    return sum(v.numel() for k, v in model.state_dict().items() if not k.startswith(skip_prefixes))
