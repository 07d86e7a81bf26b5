#!/usr/bin/env python3
"""Independent float64 reference of the kimi_linear family (Kimi-Linear-48B-A3B, Kimi-K3 text stack).

Written from docs/model.md (section numbers are cited as §n).  Every weight is read from the
checkpoint's safetensors files (BF16 / F16 / F32 / F64, or MXFP4-packed experts) and converted to float64;
every computation below runs in float64 on the CPU.  This file is the numerical truth the C engine's
golden tests compare against; it favours clarity over speed.

Public API
    ref = ReferenceModel.from_dir(path)                 # config.json + *.safetensors
    out = ref.forward(ids)                              # whole sequence at once
          out.logits [T, V], out.hidden[i] [T, D] (residual / AttnRes block-local P after layer i,
          the DSpark tap of §8.3), out.final_hidden [T, D] (after model.norm), out.state
    out = ref.forward(ids2, state=out.state)            # continue: prefill-then-decode
    out = ref.forward_incremental(ids, chunks=[7, 1, 1, 20, ...])   # convenience wrapper

Choices where the sources differ (see docs/model.md §0): unbiased router combine weights (a debug
switch `router_quirk_hf_kl` reproduces Moonshot's HF-KL in-place-bias quirk), 1e-6 for q_a / kv_a norms,
layer-counted AttnRes, softplus(a) = a for a > 20 (fla / HF behaviour).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Optional

import torch

from quant import DEFAULT_EXCLUDE, MARGIN, QMat, dequant_mxfp4, fp8_kv_row, name_excluded, note_margin  # noqa: F401

DT = torch.float64

# --------------------------------------------------------------------------------------------------
# Config (§1, §2)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    model_type: str
    weight_prefix: str  # "" (kimi_linear) or "language_model." (kimi_k3)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    situ_beta: float
    situ_linear_beta: Optional[float]
    # MLA
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: Optional[float]
    use_full_rank_gate: bool
    layer_kinds: list  # "kda" | "mla" per 0-based layer
    # FFN / MoE
    num_experts: Optional[int]
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_renormalize: bool
    routed_scaling_factor: float
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: Optional[int]
    latent_moe_use_norm: bool
    attn_res_block_size: int  # 0 = AttnRes off
    tie_word_embeddings: bool

    def layer_is_moe(self, i: int) -> bool:
        return (self.num_experts is not None and self.num_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)


def _first(d: dict, *keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def parse_config(root: dict) -> Config:
    """config.json -> Config.  K3: the language model lives in text_config and its weights carry the
    `language_model.` prefix (§1, §7).  The two layer lists are 1-based (§1, trap 7)."""
    if isinstance(root.get("text_config"), dict):
        c, prefix = root["text_config"], "language_model."
    else:
        c, prefix = root, ""
    L = int(c["num_hidden_layers"])
    Ha = int(c["num_attention_heads"])
    lac = c.get("linear_attn_config") or {}
    kda_layers = [int(x) - 1 for x in lac.get("kda_layers", [])]
    mla_layers = [int(x) - 1 for x in lac.get("full_attn_layers", [])]
    kinds = []
    for i in range(L):
        if i in kda_layers and i in mla_layers:
            raise ValueError(f"layer {i} (0-based) is listed as both KDA and MLA")
        if i in kda_layers:
            kinds.append("kda")
        elif i in mla_layers:
            kinds.append("mla")
        else:
            raise ValueError(f"layer {i} (0-based; {i + 1} 1-based) is in neither kda_layers nor full_attn_layers")
    act = str(c.get("hidden_act", "silu")).lower()
    if act not in ("silu", "swiglu", "situ"):
        raise ValueError(f"hidden_act {act!r} not supported")
    func = _first(c, "moe_router_activation_func", "scoring_func", default="sigmoid")
    if func != "sigmoid":
        raise ValueError(f"router activation {func!r} not supported (only sigmoid)")
    arbs = c.get("attn_res_block_size")
    tie = c.get("tie_word_embeddings", root.get("tie_word_embeddings", False))
    return Config(
        model_type=str(root.get("model_type", "")),
        weight_prefix=prefix,
        vocab_size=int(c.get("vocab_size", 163840)),
        hidden_size=int(c["hidden_size"]),
        num_hidden_layers=L,
        intermediate_size=int(c["intermediate_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        hidden_act="situ" if act == "situ" else "silu",
        situ_beta=float(_first(c, "activation_situ_beta", default=1.0)),
        situ_linear_beta=(None if c.get("activation_situ_linear_beta") is None
                          else float(c["activation_situ_linear_beta"])),
        num_attention_heads=Ha,
        q_lora_rank=(None if not c.get("q_lora_rank") else int(c["q_lora_rank"])),
        kv_lora_rank=int(c.get("kv_lora_rank") or 0),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim") or 0),
        v_head_dim=int(c.get("v_head_dim") or 0),
        mla_use_output_gate=bool(c.get("mla_use_output_gate", False)),
        kda_num_heads=int(lac.get("num_heads", Ha)),
        kda_head_dim=int(lac.get("head_dim", 0) or 0),
        conv_kernel=int(lac.get("short_conv_kernel_size", 4)),
        gate_lower_bound=(None if lac.get("gate_lower_bound") is None else float(lac["gate_lower_bound"])),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        layer_kinds=kinds,
        num_experts=_first(c, "num_experts", "n_routed_experts", "num_local_experts"),
        num_experts_per_token=int(_first(c, "num_experts_per_token", "num_experts_per_tok", default=1)),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        num_shared_experts=int(_first(c, "num_shared_experts", "n_shared_experts", default=0) or 0),
        first_k_dense_replace=int(c.get("first_k_dense_replace", 1)),
        moe_layer_freq=int(c.get("moe_layer_freq", 1)),
        moe_renormalize=bool(_first(c, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        use_grouped_topk=bool(c.get("use_grouped_topk", True)),
        num_expert_group=int(_first(c, "num_expert_group", "n_group", default=1)),
        topk_group=int(c.get("topk_group", 1) or 1),
        routed_expert_hidden_size=(None if not c.get("routed_expert_hidden_size")
                                   else int(c["routed_expert_hidden_size"])),
        latent_moe_use_norm=bool(c.get("latent_moe_use_norm", False)),
        attn_res_block_size=int(arbs or 0),
        tie_word_embeddings=bool(tie),
    )


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------

class Weights:
    """All tensors of a checkpoint folder (every *.safetensors file), converted to float64 on demand.
    Tracks which names were read so a caller can list unused (= possibly misnamed) tensors."""

    def __init__(self, folder: str, prefix: str):
        from safetensors import safe_open

        self.prefix = prefix
        self.files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self._where = {}
        self._handles = []
        for f in self.files:
            h = safe_open(f, framework="pt")
            self._handles.append(h)
            for k in h.keys():
                if k in self._where:
                    raise ValueError(f"tensor {k} appears in two files")
                self._where[k] = h
        self.used = set()
        self.quantization = None  # None or "ptpc_fp8" (docs/quantization.md §3): see set_quantization
        self.exclude = list(DEFAULT_EXCLUDE)
        self.quantized = []       # full names of the matrices mat() returned as QMat

    def set_quantization(self, quantization: Optional[str], exclude: Optional[list] = None):
        if quantization not in (None, "none", "ptpc_fp8"):
            raise ValueError(f"quantization {quantization!r}: expected none or ptpc_fp8")
        self.quantization = None if quantization in (None, "none") else quantization
        if exclude is not None and self.quantization is None:
            raise ValueError("quantization_exclude needs quantization='ptpc_fp8'")
        self.exclude = list(DEFAULT_EXCLUDE) if exclude is None else [f for f in exclude if f]

    def has(self, name: str) -> bool:
        return (self.prefix + name) in self._where

    def raw(self, name: str) -> torch.Tensor:
        full = self.prefix + name
        if full not in self._where:
            raise KeyError(f"checkpoint has no tensor {full}")
        self.used.add(full)
        return self._where[full].get_tensor(full)

    def __call__(self, name: str) -> torch.Tensor:
        return self.raw(name).to(DT)

    def mat(self, name: str):
        """A matrix the model multiplies by: float64, or a QMat when ptpc_fp8 is on and the full tensor
        name contains no exclusion fragment (only float tensors: packed MXFP4 is never requantized)."""
        t = self.raw(name)
        full = self.prefix + name
        if (self.quantization == "ptpc_fp8" and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and not name_excluded(full, self.exclude)):
            self.quantized.append(full)
            return QMat(full, t.to(DT))
        return t.to(DT)

    def linear(self, name: str):
        """`name`.weight (through mat()), or an MXFP4-packed `name`.weight_packed / weight_scale pair."""
        if self.has(name + ".weight"):
            return self.mat(name + ".weight")
        if self.has(name + ".weight_packed"):
            return dequant_mxfp4(self.raw(name + ".weight_packed"), self.raw(name + ".weight_scale"),
                                 self.prefix + name)
        raise KeyError(f"checkpoint has no tensor {self.prefix}{name}.weight (nor .weight_packed)")

    def unused(self) -> list:
        return sorted(k for k in self._where if k not in self.used
                      and not k.startswith(("vision_tower.", "mm_projector.")))


# --------------------------------------------------------------------------------------------------
# Elementary ops (all float64)
# --------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """§0: w ⊙ x / sqrt(mean(x²) + eps) over the last dim."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """§3.2 step 3: x / sqrt(Σx² + eps), eps inside the root, sum (not mean)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ln(1+eˣ), returning x for x > 20 as fla / HF do (§0)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """W[out, in] · x (§0).  A ptpc_fp8 QMat quantizes this product's own input rows, one scale a
    token (docs/quantization.md §3)."""
    if isinstance(w, QMat):
        return w.matmul(x)
    return x @ w.T


# --------------------------------------------------------------------------------------------------
# KDA (§3)
# --------------------------------------------------------------------------------------------------


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log_h: torch.Tensor, lower_bound: Optional[float]):
    """§3.3.  f: [T, Hk, dk] (= W_fb W_fa x), dt_bias: [Hk*dk], A_log_h: [Hk].  Returns log-decay g ≤ 0."""
    Hk, dk = f.shape[-2:]
    fp = f + dt_bias.view(Hk, dk)
    a = torch.exp(A_log_h).view(Hk, 1)
    if lower_bound is None:
        return -a * softplus(fp)                       # Kimi-Linear
    return lower_bound * torch.sigmoid(a * fp)         # K3, g ∈ (lb, 0)


def kda_recurrence(q, k, v, g, beta, S0):
    """Naive recurrence §3.4.  q, k already L2-normed, q already scaled by dk^-1/2.
    q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; S0: [H, dk, dv] (K-first).
    Returns o [T, H, dv] and the final state."""
    S = S0.clone()
    T = q.shape[0]
    o = torch.empty_like(v)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)                         # row c scaled by exp(g[h,c])
        e = v[t] - torch.einsum("hcv,hc->hv", S, k[t])                # v − Sᵀk
        S = S + beta[t].view(-1, 1, 1) * torch.einsum("hc,hv->hcv", k[t], e)
        o[t] = torch.einsum("hcv,hc->hv", S, q[t])                   # read after the write
    return o, S


def kda_chunked(q, k, v, g, beta, S0, C: int = 64):
    """Chunked form §3.6 (same result as kda_recurrence).  Shapes as kda_recurrence.  The tail chunk is
    processed with its real length (no padding needed)."""
    T, H, dk = q.shape
    S = S0.clone()
    o = torch.empty_like(v)
    for s0 in range(0, T, C):
        s1 = min(T, s0 + C)
        n = s1 - s0
        for h in range(H):
            Q, K, V, G, B = q[s0:s1, h], k[s0:s1, h], v[s0:s1, h], g[s0:s1, h], beta[s0:s1, h]
            Gam = torch.cumsum(G, dim=0)                                          # [n, dk]
            # D[i, j, c] = Γ_i[c] − Γ_j[c]; only j ≤ i used (non-positive there)
            D = Gam.unsqueeze(1) - Gam.unsqueeze(0)
            tril_strict = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
            tril = torch.tril(torch.ones(n, n, dtype=torch.bool), 0)
            Dm = torch.where(tril.unsqueeze(-1), D, torch.zeros_like(D))
            E = torch.exp(Dm)
            Lm = B.view(n, 1) * torch.einsum("ic,jc,ijc->ij", K, K, E)
            Lm = torch.where(tril_strict, Lm, torch.zeros_like(Lm))
            Tm = torch.linalg.solve_triangular(torch.eye(n, dtype=DT) + Lm, torch.diag(B), upper=False)
            Wc = Tm @ (torch.exp(Gam) * K)
            U = Tm @ V
            Vp = U - Wc @ S[h]
            A = torch.einsum("ic,jc,ijc->ij", Q, K, E)
            A = torch.where(tril, A, torch.zeros_like(A))
            o[s0:s1, h] = (Q * torch.exp(Gam)) @ S[h] + A @ Vp
            last = Gam[-1]
            S[h] = torch.exp(last).view(dk, 1) * S[h] + (torch.exp(last.view(1, dk) - Gam) * K).T @ Vp
    return o, S


@dataclasses.dataclass
class KDAState:
    conv: torch.Tensor  # [W-1, 3P]: last W-1 pre-conv projected rows, q | k | v   (§3.7a)
    S: torch.Tensor     # [Hk, dk, dv] float64, K-first                        (§3.7b)


class KDALayer:
    def __init__(self, cfg: Config, w: Weights, i: int, kda_mode: str = "naive"):
        p = f"model.layers.{i}.self_attn."
        self.cfg, self.kda_mode = cfg, kda_mode
        self.H, self.dk = cfg.kda_num_heads, cfg.kda_head_dim
        self.P = self.H * self.dk
        self.Wq, self.Wk, self.Wv = w.mat(p + "q_proj.weight"), w.mat(p + "k_proj.weight"), w.mat(p + "v_proj.weight")
        # depthwise conv weights [P, 1, W] -> [P, W]
        self.cq = w(p + "q_conv1d.weight").reshape(self.P, -1)
        self.ck = w(p + "k_conv1d.weight").reshape(self.P, -1)
        self.cv = w(p + "v_conv1d.weight").reshape(self.P, -1)
        self.Wfa, self.Wfb = w.mat(p + "f_a_proj.weight"), w.mat(p + "f_b_proj.weight")
        self.dt_bias = w(p + "dt_bias").reshape(-1)
        # A_log: [1,1,Hk,1] (KL) or [128] with only the first Hk live (K3): flatten, take [0, Hk) (trap 3)
        A = w(p + "A_log").reshape(-1)
        if A.numel() < self.H:
            raise ValueError(f"{p}A_log has {A.numel()} elements < Hk={self.H}")
        self.A_log = A[: self.H]
        self.Wb = w.mat(p + "b_proj.weight")
        if cfg.use_full_rank_gate:
            self.Wg = w.mat(p + "g_proj.weight")
        else:
            self.Wga, self.Wgb = w.mat(p + "g_a_proj.weight"), w.mat(p + "g_b_proj.weight")
        self.o_norm = w(p + "o_norm.weight")
        self.Wo = w.mat(p + "o_proj.weight")
        for name, t in (("q_proj", self.Wq), ("f_b_proj", self.Wfb), ("o_proj", self.Wo)):
            assert t.shape[0 if name != "o_proj" else 1] == self.P, f"{p}{name} shape {tuple(t.shape)}"

    def new_state(self) -> KDAState:
        W = self.cq.shape[1]
        return KDAState(conv=torch.zeros(W - 1, 3 * self.P, dtype=DT), S=torch.zeros(self.H, self.dk, self.dk,
                                                                                          dtype=DT))

    @staticmethod
    def _conv(xh: torch.Tensor, tail: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
        """§3.2 step 2: u_t[c] = Σ_j w[c,j] · x_{t-W+1+j}[c]; rows before the chunk come from `tail`."""
        W = wc.shape[1]
        X = torch.cat([tail, xh], dim=0)  # [W-1+T, P]
        T = xh.shape[0]
        u = torch.zeros_like(xh)
        for j in range(W):
            u = u + X[j: j + T] * wc[:, j]
        return silu(u)

    def __call__(self, x: torch.Tensor, st: KDAState):
        T, H, dk, P = x.shape[0], self.H, self.dk, self.P
        qh, kh, vh = linear(x, self.Wq), linear(x, self.Wk), linear(x, self.Wv)
        q = self._conv(qh, st.conv[:, :P], self.cq)
        k = self._conv(kh, st.conv[:, P: 2 * P], self.ck)
        v = self._conv(vh, st.conv[:, 2 * P:], self.cv)
        Wm1 = st.conv.shape[0]
        new_conv = torch.cat([st.conv, torch.cat([qh, kh, vh], dim=1)], dim=0)[-Wm1:] if Wm1 else st.conv
        q = l2_norm(q.view(T, H, dk)) * dk ** -0.5
        k = l2_norm(k.view(T, H, dk))
        v = v.view(T, H, dk)
        g = kda_gate(linear(linear(x, self.Wfa), self.Wfb).view(T, H, dk), self.dt_bias, self.A_log,
                     self.cfg.gate_lower_bound)
        beta = torch.sigmoid(linear(x, self.Wb))  # [T, H]
        if self.kda_mode == "chunk":
            o, S = kda_chunked(q, k, v, g, beta, st.S)
        else:
            o, S = kda_recurrence(q, k, v, g, beta, st.S)
        gate = linear(x, self.Wg) if self.cfg.use_full_rank_gate else linear(linear(x, self.Wga), self.Wgb)
        y = rms_norm(o, self.o_norm, self.cfg.rms_norm_eps) * torch.sigmoid(gate.view(T, H, dk))  # norm, then gate
        return linear(y.reshape(T, P), self.Wo), KDAState(conv=new_conv, S=S)


# --------------------------------------------------------------------------------------------------
# MLA (§4), NoPE
# --------------------------------------------------------------------------------------------------

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm of the target (§4.5, trap 1)


@dataclasses.dataclass
class MLACache:
    c: torch.Tensor   # [t, R_kv]  normed latent rows
    kR: torch.Tensor  # [t, dr]    un-normed, un-rotated rope lanes


class MLALayer:
    def __init__(self, cfg: Config, w: Weights, i: int, kv_cache_dtype: Optional[str] = None):
        p = f"model.layers.{i}.self_attn."
        self.cfg, self.kv_fp8 = cfg, kv_cache_dtype == "fp8"
        self.Ha, self.dn, self.dr, self.dv, self.R = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                      cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            self.Wqa, self.qa_norm, self.Wqb = (w.mat(p + "q_a_proj.weight"), w(p + "q_a_layernorm.weight"),
                                                w.mat(p + "q_b_proj.weight"))
        else:
            self.Wq = w.mat(p + "q_proj.weight")
        self.Wkva = w.mat(p + "kv_a_proj_with_mqa.weight")
        self.kva_norm = w(p + "kv_a_layernorm.weight")
        Wkvb = w(p + "kv_b_proj.weight").view(self.Ha, self.dn + self.dv, self.R)  # never ptpc (quant.NEVER)
        self.WUK, self.WUV = Wkvb[:, : self.dn], Wkvb[:, self.dn:]  # [Ha, dn, R], [Ha, dv, R]
        self.Wo = w.mat(p + "o_proj.weight")
        self.Wg = w.mat(p + "g_proj.weight") if cfg.mla_use_output_gate else None
        self.scale = (self.dn + self.dr) ** -0.5

    def new_state(self) -> MLACache:
        return MLACache(c=torch.zeros(0, self.R, dtype=DT), kR=torch.zeros(0, self.dr, dtype=DT))

    def __call__(self, x: torch.Tensor, cache: MLACache, form: str = "expanded"):
        T = x.shape[0]
        if self.cfg.q_lora_rank:
            q = linear(rms_norm(linear(x, self.Wqa), self.qa_norm, MLA_NORM_EPS), self.Wqb)
        else:
            q = linear(x, self.Wq)
        q = q.view(T, self.Ha, self.dn + self.dr)
        qN, qR = q[..., : self.dn], q[..., self.dn:]
        kv = linear(x, self.Wkva)
        c_new = rms_norm(kv[:, : self.R], self.kva_norm, MLA_NORM_EPS)
        kR_new = kv[:, self.R:]  # NoPE: never rotated
        if self.kv_fp8:  # docs/quantization.md §4: every attention reads the stored row, its own included
            c_new, kR_new = fp8_kv_row(c_new, kR_new)
        c = torch.cat([cache.c, c_new], 0)
        kR = torch.cat([cache.kR, kR_new], 0)
        n_past, n_all = cache.c.shape[0], c.shape[0]
        # causal: query at absolute position n_past+t sees keys 0..n_past+t
        allowed = torch.arange(n_all).view(1, -1) <= (n_past + torch.arange(T)).view(-1, 1)  # [T, n_all]
        if form == "expanded":  # §4.3
            kN = torch.einsum("hdr,sr->hsd", self.WUK, c)      # [Ha, n_all, dn]
            vv = torch.einsum("hdr,sr->hsd", self.WUV, c)      # [Ha, n_all, dv]
            # key_h,t' = [kN_h,t' | kR_t'] (kR shared by all heads, MQA-style)
            sc = (torch.einsum("thd,hsd->hts", qN, kN) + torch.einsum("thd,sd->hts", qR, kR)) * self.scale
            sc = sc.masked_fill(~allowed.unsqueeze(0), float("-inf"))
            a = torch.softmax(sc, dim=-1)
            o = torch.einsum("hts,hsd->thd", a, vv)              # [T, Ha, dv]
        elif form == "absorbed":  # §4.4
            qbar = torch.einsum("hdr,thd->thr", self.WUK, qN)   # [T, Ha, R]
            sc = (torch.einsum("thr,sr->hts", qbar, c) + torch.einsum("thd,sd->hts", qR, kR)) * self.scale
            sc = sc.masked_fill(~allowed.unsqueeze(0), float("-inf"))
            a = torch.softmax(sc, dim=-1)
            obar = torch.einsum("hts,sr->thr", a, c)
            o = torch.einsum("hdr,thr->thd", self.WUV, obar)
        else:
            raise ValueError(form)
        o = o.reshape(T, self.Ha * self.dv)
        if self.Wg is not None:  # K3 output gate (§4.5) on the flattened heads
            o = o * torch.sigmoid(linear(x, self.Wg))
        return linear(o, self.Wo), MLACache(c=c, kR=kR)


# --------------------------------------------------------------------------------------------------
# FFN (§5)
# --------------------------------------------------------------------------------------------------


def make_act(cfg: Config):
    if cfg.hidden_act == "situ":  # §5.1 / trap 12 (HF-K3 semantics)
        b, bl = cfg.situ_beta, cfg.situ_linear_beta

        def act(a, u):
            phi = u if bl is None else bl * torch.tanh(u / bl)
            return b * torch.tanh(a / b) * torch.sigmoid(a) * phi
        return act
    return lambda a, u: silu(a) * u  # SwiGLU


class MLP:
    """Dense MLP and shared expert (§5.2): y = W_down · act(W_gate x, W_up x)."""

    def __init__(self, w: Weights, prefix: str, act):
        self.Wg, self.Wu, self.Wd = (w.linear(prefix + "gate_proj"), w.linear(prefix + "up_proj"),
                                     w.linear(prefix + "down_proj"))
        self.act = act

    def __call__(self, x):
        return linear(self.act(linear(x, self.Wg), linear(x, self.Wu)), self.Wd)


class MoE:
    def __init__(self, cfg: Config, w: Weights, i: int, act, router_quirk_hf_kl: bool = False):
        p = f"model.layers.{i}.block_sparse_moe."
        self.cfg, self.act, self.quirk = cfg, act, router_quirk_hf_kl
        self.E, self.k = int(cfg.num_experts), cfg.num_experts_per_token
        self.Wr = w.mat(p + "gate.weight")
        self.bias = w(p + "gate.e_score_correction_bias") if w.has(p + "gate.e_score_correction_bias") \
            else torch.zeros(self.E, dtype=DT)
        self.experts = [(w.linear(p + f"experts.{e}.w1"), w.linear(p + f"experts.{e}.w3"),
                         w.linear(p + f"experts.{e}.w2")) for e in range(self.E)]
        self.shared = MLP(w, p + "shared_experts.", act) if cfg.num_shared_experts > 0 else None
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            self.Wdown = w.mat(p + "routed_expert_down_proj.weight")
            self.Wup = w.mat(p + "routed_expert_up_proj.weight")
            self.lnorm = w(p + "routed_expert_norm.weight") if cfg.latent_moe_use_norm else None

    def route(self, x: torch.Tensor):
        """§5.3.  Returns (indices [T, k], weights [T, k])."""
        cfg = self.cfg
        s = torch.sigmoid(linear(x, self.Wr))          # [T, E]
        sp = s + self.bias                              # selection scores only
        G = cfg.num_expert_group
        if cfg.use_grouped_topk and G > 1 and G > cfg.topk_group:
            T = x.shape[0]
            grp = sp.view(T, G, self.E // G)
            gscore = grp.topk(min(2, self.E // G), dim=-1).values.sum(-1)       # [T, G]
            if MARGIN["on"]:  # a near tie between the last kept and the first dropped group
                gs = gscore.sort(dim=-1, descending=True).values
                note_margin((gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]).min().item(), "router groups")
            keep = gscore.topk(cfg.topk_group, dim=-1).indices
            gmask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, keep, True)
            emask = gmask.unsqueeze(-1).expand(T, G, self.E // G).reshape(T, self.E)
            sp = sp.masked_fill(~emask, 0.0 if self.quirk else float("-inf"))
        if MARGIN["on"] and self.k < self.E:  # a near tie between the k-th and the (k+1)-th expert
            ss = sp.sort(dim=-1, descending=True).values
            if torch.isfinite(ss[:, self.k]).all():
                note_margin((ss[:, self.k - 1] - ss[:, self.k]).min().item(), "router experts")
        idx = sp.topk(self.k, dim=-1).indices
        wts = (sp if self.quirk else s).gather(1, idx)  # combine with UNBIASED scores (trap 2)
        if cfg.moe_renormalize and self.k > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return idx, wts * cfg.routed_scaling_factor

    def __call__(self, x: torch.Tensor):
        idx, wts = self.route(x)
        u = linear(x, self.Wdown) if self.latent else x          # latent MoE: experts run at D_lat (§5.4)
        y = torch.zeros(x.shape[0], u.shape[1], dtype=DT)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            W1, W3, W2 = self.experts[e]
            ue = u[rows]
            y[rows] += wts[rows, slot].unsqueeze(-1) * linear(self.act(linear(ue, W1), linear(ue, W3)), W2)
        if self.latent:
            if self.lnorm is not None:
                y = rms_norm(y, self.lnorm, self.cfg.rms_norm_eps)
            y = linear(y, self.Wup)
        if self.shared is not None:
            y = y + self.shared(x)                                # shared expert reads x at width D
        return y


# --------------------------------------------------------------------------------------------------
# AttnRes (§6)
# --------------------------------------------------------------------------------------------------


def attnres_mix(cands: list, qvec: torch.Tensor, eps: float) -> torch.Tensor:
    """§6.2: score_j = Σ_d (V_j / sqrt(mean V_j² + eps)) ⊙ n ⊙ p;  α = softmax_j;  Σ α_j V_j.
    `qvec` = n ⊙ p (the pre-folded vector).  cands: list of [T, D]."""
    if len(cands) == 1:
        return cands[0]
    V = torch.stack(cands, 0)                                               # [m, T, D]
    score = (V / torch.sqrt((V * V).mean(-1, keepdim=True) + eps) * qvec).sum(-1)   # [m, T]
    alpha = torch.softmax(score, dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0)


# --------------------------------------------------------------------------------------------------
# Whole model
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ForwardOutput:
    logits: torch.Tensor        # [T, V]
    hidden: list                # L × [T, D]: residual stream (AttnRes: block-local P) after layer i
    final_hidden: torch.Tensor  # [T, D] after model.norm (the lm_head input)
    state: list                 # per layer KDAState / MLACache, plus n_tokens in .n_tokens
    n_tokens: int = 0


class ReferenceModel:
    def __init__(self, cfg: Config, w: Weights, kda_mode: str = "naive", mla_form: Optional[str] = None,
                 router_quirk_hf_kl: bool = False, quantization: Optional[str] = None,
                 quantization_exclude: Optional[list] = None, kv_cache_dtype: Optional[str] = None):
        """quantization="ptpc_fp8" quantizes every matrix in scope at load (docs/quantization.md §3;
        quantization_exclude: name fragments, None = quant.DEFAULT_EXCLUDE); kv_cache_dtype="fp8" stores
        the MLA latent rows as §4 says."""
        self.cfg, self.w = cfg, w
        if kv_cache_dtype not in (None, "auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected auto or fp8")
        self.kv_cache_dtype = "fp8" if kv_cache_dtype == "fp8" else None
        w.set_quantization(quantization, quantization_exclude)
        self.quantization, self.quantization_exclude = w.quantization, list(w.exclude)
        self.mla_form = mla_form  # None: "expanded" for a fresh sequence, "absorbed" when continuing
        D = cfg.hidden_size
        act = make_act(cfg)
        self.embed = w("model.embed_tokens.weight")
        assert self.embed.shape == (cfg.vocab_size, D), f"embed_tokens shape {tuple(self.embed.shape)}"
        self.mixers, self.ffns, self.in_norm, self.post_norm, self.res = [], [], [], [], []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.in_norm.append(w(p + "input_layernorm.weight"))
            self.post_norm.append(w(p + "post_attention_layernorm.weight"))
            self.mixers.append(KDALayer(cfg, w, i, kda_mode) if cfg.layer_kinds[i] == "kda" else MLALayer(cfg, w, i, self.kv_cache_dtype))
            self.ffns.append(MoE(cfg, w, i, act, router_quirk_hf_kl) if cfg.layer_is_moe(i)
                             else MLP(w, p + "mlp.", act))
            if cfg.attn_res_block_size:
                # §6.1: two different (norm, proj) pairs per layer; pre-fold n ⊙ p (§6.2)
                self.res.append((w(p + "self_attention_res_norm.weight") * w(p + "self_attention_res_proj.weight").reshape(-1),
                                 w(p + "mlp_res_norm.weight") * w(p + "mlp_res_proj.weight").reshape(-1)))
        self.norm = w("model.norm.weight")
        if cfg.attn_res_block_size:
            self.out_res = w("model.output_attn_res_norm.weight") * w("model.output_attn_res_proj.weight").reshape(-1)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")

    @classmethod
    def from_dir(cls, folder: str, **kw) -> "ReferenceModel":
        with open(os.path.join(folder, "config.json")) as f:
            root = json.load(f)
        cfg = parse_config(root)
        w = Weights(folder, cfg.weight_prefix)
        if not w.has("model.embed_tokens.weight") and cfg.weight_prefix:
            raise KeyError(f"{folder}: text_config present but no {cfg.weight_prefix}model.embed_tokens.weight")
        return cls(cfg, w, **kw)

    def new_state(self) -> list:
        return [m.new_state() for m in self.mixers]

    def _mixer(self, i, x, st, fresh):
        m = self.mixers[i]
        if isinstance(m, MLALayer):
            form = self.mla_form or ("expanded" if fresh else "absorbed")
            return m(x, st, form)
        return m(x, st)

    def forward(self, ids, state: Optional[list] = None, n_past: int = 0) -> ForwardOutput:
        cfg = self.cfg
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError("token id out of range")
        fresh = state is None
        state = self.new_state() if fresh else state
        new_state, hidden = [], []
        eps, N = cfg.rms_norm_eps, cfg.attn_res_block_size
        h = self.embed[ids]                                  # plain lookup, no scaling (§7)
        if N:  # §6.3, layer-counted blocks, mix first, then bank
            P, R = h, []
            for i in range(cfg.num_hidden_layers):
                x = attnres_mix(R + [P], self.res[i][0], eps)
                if i % N == 0:
                    R.append(P)
                    P = None
                a, s = self._mixer(i, rms_norm(x, self.in_norm[i], eps), state[i], fresh)
                new_state.append(s)
                P = a if P is None else P + a
                x = attnres_mix(R + [P], self.res[i][1], eps)
                P = P + self.ffns[i](rms_norm(x, self.post_norm[i], eps))
                hidden.append(P)
            final = rms_norm(attnres_mix(R + [P], self.out_res, eps), self.norm, eps)
        else:  # plain pre-norm
            for i in range(cfg.num_hidden_layers):
                a, s = self._mixer(i, rms_norm(h, self.in_norm[i], eps), state[i], fresh)
                new_state.append(s)
                h = h + a
                h = h + self.ffns[i](rms_norm(h, self.post_norm[i], eps))
                hidden.append(h)
            final = rms_norm(h, self.norm, eps)
        logits = linear(final, self.lm_head)
        return ForwardOutput(logits=logits, hidden=hidden, final_hidden=final, state=new_state,
                             n_tokens=n_past + ids.numel())

    def forward_incremental(self, ids, chunks) -> ForwardOutput:
        """Prefill-then-decode: runs `ids` in pieces of the given lengths (the last piece repeats until
        the sequence is used up), carrying KDA conv/recurrent state and the MLA latent cache."""
        ids = list(torch.as_tensor(ids).reshape(-1).tolist())
        outs, state, pos, ci = [], None, 0, 0
        while pos < len(ids):
            n = chunks[min(ci, len(chunks) - 1)]
            ci += 1
            o = self.forward(ids[pos: pos + n], state=state, n_past=pos)
            state, pos = o.state, pos + n
            outs.append(o)
        cat = lambda xs: torch.cat(xs, 0)
        return ForwardOutput(logits=cat([o.logits for o in outs]),
                             hidden=[cat([o.hidden[i] for o in outs]) for i in range(self.cfg.num_hidden_layers)],
                             final_hidden=cat([o.final_hidden for o in outs]), state=state, n_tokens=pos)


def checkpoint_fnv1a64(folder: str) -> int:
    """FNV-1a 64 over the bytes of all *.safetensors files in sorted filename order (one stream)."""
    h = 0xCBF29CE484222325
    prime, mask = 0x100000001B3, 0xFFFFFFFFFFFFFFFF
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, f), "rb") as fh:
            while True:
                buf = fh.read(1 << 20)
                if not buf:
                    break
                for b in buf:
                    h = ((h ^ b) * prime) & mask
    return h


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="run the float64 reference on a checkpoint")
    ap.add_argument("--model", required=True)
    ap.add_argument("--token-ids", default="1,2,3,4")
    a = ap.parse_args()
    ref = ReferenceModel.from_dir(a.model)
    out = ref.forward([int(t) for t in a.token_ids.split(",")])
    print("logits", tuple(out.logits.shape), "argmax", out.logits.argmax(-1).tolist())
    if ref.w.unused():
        print("UNUSED tensors:", ref.w.unused())
