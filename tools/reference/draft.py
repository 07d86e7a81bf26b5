#!/usr/bin/env python3
"""Independent float64 reference of the DSpark draft (`k3_dspark`, docs/model.md §8).

Written from docs/model.md §8 (section numbers cited as §n).  The draft borrows the target's
`embed_tokens` and `lm_head` (§8.2), so it is built on top of a loaded `model.ReferenceModel`.  Every
computation runs in float64 on the CPU.  Attention uses the expanded form (§4.3, up-projecting every key)
while the C engine uses the absorbed form over its paged latent cache, so the golden comparison also checks
that the two forms agree.

Public API
    tgt = ReferenceModel.from_dir(target_dir)
    dr  = ReferenceDraft.from_dir(os.path.join(target_dir, "draft"), tgt)
    out = tgt.forward(ids)
    taps = dr.taps_from(out, ids)            # list of [n, D], one per target_layer_ids entry (§8.3)
    ctx  = dr.context(taps)                  # [n, D]                                     (§8.4)
    lat  = dr.context_latents(ctx, pos0=0)   # per draft layer [n, R+dr]: the cache rows  (§8.4)
    res  = dr.propose(lat, anchor, T)        # block pass (§8.5) + Markov walk (§8.7) after context
                                             # rows 0..p (p = len(lat[0]) - 1): res.logits [T, V],
                                             # res.drafts [T], res.bias [T, V] (Markov bias per row)
    y    = yarn(cfg)                          # §8.6: inv_freq [dr/2], lo, hi, softmax scale, cos/sin mscale
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import DT, ReferenceModel, linear, rms_norm, silu  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Config (§8.1)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_factor: float
    rope_original_max_pos: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    target_hidden_size: int
    target_num_hidden_layers: int
    target_layer_ids: list
    mask_token_id: int
    markov_rank: int


def parse_draft_config(c: dict) -> DraftConfig:
    """§8.1.  Rejects what this reference does not implement rather than computing something else."""
    if c.get("kv_lora_rank") is None:
        raise ValueError("draft config has no kv_lora_rank: only MLA DSpark drafts are supported")
    if c.get("mla_use_nope", False):
        raise ValueError("draft config: mla_use_nope must be false (the draft rotates its rope lanes)")
    if c.get("fc_norm", False) or c.get("aux_hidden_stream", "prefix") != "prefix":
        raise ValueError("draft config: fc_norm / aux_hidden_stream 'attn_res' are not implemented")
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rtype = rp.get("rope_type", rp.get("type", "default"))
    theta = float(c.get("rope_theta", rp.get("rope_theta", 10000.0)))
    if rtype not in ("yarn", "default"):
        raise ValueError(f"draft rope_type {rtype!r} not supported")
    yarn_on = rtype == "yarn"
    ids = [int(x) for x in c["target_layer_ids"]]
    if len(ids) != int(c["num_target_layers"]):
        raise ValueError("len(target_layer_ids) != num_target_layers")
    if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
        raise ValueError(f"target_layer_ids {ids} must be strictly ascending, >= -1")
    V = int(c.get("vocab_size", 163840))
    if int(c.get("draft_vocab_size", V)) != V:
        raise ValueError("draft_vocab_size != vocab_size")
    qr = c.get("q_lora_rank")
    return DraftConfig(
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_hidden_layers=int(c["num_hidden_layers"]),
        num_attention_heads=int(c["num_attention_heads"]),
        q_lora_rank=int(qr) if qr else None,
        kv_lora_rank=int(c["kv_lora_rank"]),
        qk_nope_head_dim=int(c["qk_nope_head_dim"]),
        qk_rope_head_dim=int(c["qk_rope_head_dim"]),
        v_head_dim=int(c["v_head_dim"]),
        vocab_size=V,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_factor=float(rp.get("factor", 1.0)) if yarn_on else 1.0,
        rope_original_max_pos=int(rp.get("original_max_position_embeddings",
                                         c.get("max_position_embeddings", 0))) if yarn_on else 0,
        beta_fast=float(rp.get("beta_fast", 32.0)),
        beta_slow=float(rp.get("beta_slow", 1.0)),
        mscale=float(rp.get("mscale", 1.0)),
        mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)),
        target_hidden_size=int(c["target_hidden_size"]),
        target_num_hidden_layers=int(c["target_num_hidden_layers"]),
        target_layer_ids=ids,
        mask_token_id=int(c["mask_token_id"]),
        markov_rank=int(c["markov_rank"]),
    )


# --------------------------------------------------------------------------------------------------
# RoPE / YaRN (§8.6)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Yarn:
    inv_freq: torch.Tensor  # [dr/2] corrected inverse frequencies
    lo: int                 # dims below lo keep the original frequency (extrapolation)
    hi: int                 # dims at or above hi are fully interpolated (divided by the factor)
    softmax_scale: float    # (dn+dr)^-1/2 · yarn_mscale(s, mscale_all_dim)²
    cos_sin_mscale: float   # yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)


def yarn_mscale(s: float, m: float) -> float:
    return 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0


def yarn(cfg: DraftConfig) -> Yarn:
    r, theta, s = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    inv = torch.tensor([theta ** (-2.0 * i / r) for i in range(r // 2)], dtype=DT)
    base_scale = (cfg.qk_nope_head_dim + r) ** -0.5
    if s <= 1.0:  # plain RoPE
        return Yarn(inv, 0, 0, base_scale, 1.0)
    L0 = cfg.rope_original_max_pos

    def dim(n: float) -> float:  # the dimension whose wavelength completes n turns over L0
        return r * math.log(L0 / (2 * math.pi * n)) / (2 * math.log(theta))

    lo = max(math.floor(dim(cfg.beta_fast)), 0)
    hi = min(math.ceil(dim(cfg.beta_slow)), r - 1)
    hi_f = hi + 0.001 if lo == hi else float(hi)
    ramp = torch.clamp((torch.arange(r // 2, dtype=DT) - lo) / (hi_f - lo), 0.0, 1.0)
    inv_c = (inv / s) * ramp + inv * (1.0 - ramp)
    return Yarn(inv_c, lo, hi, base_scale * yarn_mscale(s, cfg.mscale_all_dim) ** 2,
                yarn_mscale(s, cfg.mscale) / yarn_mscale(s, cfg.mscale_all_dim))


def rope(x: torch.Tensor, pos: torch.Tensor, y: Yarn) -> torch.Tensor:
    """Rotates the last dim of x [T, ..., dr] by pos [T]: adjacent lanes (x[2i], x[2i+1]) form pair i
    ("interleaved"/GPT-J pairing, §8.6), turned by angle pos·inv_freq[i]."""
    ang = pos.to(DT).view(-1, 1) * y.inv_freq.view(1, -1)           # [T, dr/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [ang.shape[1]]
    cos = (torch.cos(ang) * y.cos_sin_mscale).view(shape)
    sin = (torch.sin(ang) * y.cos_sin_mscale).view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


# --------------------------------------------------------------------------------------------------
# Weights (§8.2)
# --------------------------------------------------------------------------------------------------


class DraftWeights:
    """Every tensor of the draft folder, a leading `model.` stripped from its name (§8.2)."""

    # Shipped but not used by inference: the frozen embed_tokens copy (the target's is used) and the
    # training-only confidence head.
    IGNORED = ("embed_tokens.weight", "confidence_head.proj.weight", "confidence_head.proj.bias")

    def __init__(self, folder: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self.t, self.used = {}, set()
        for f in files:
            h = safe_open(f, framework="pt")
            for k in h.keys():
                name = k[len("model."):] if k.startswith("model.") else k
                if name in self.t:
                    raise ValueError(f"draft tensor {name} appears twice (with and without 'model.'?)")
                self.t[name] = h.get_tensor(k)

    def __call__(self, name: str, shape: tuple) -> torch.Tensor:
        if name not in self.t:
            raise KeyError(f"draft checkpoint has no tensor {name}")
        t = self.t[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"draft tensor {name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return t.to(DT)

    def unused(self) -> list:
        return sorted(k for k in self.t if k not in self.used and k not in self.IGNORED)


# --------------------------------------------------------------------------------------------------
# The draft
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProposeOutput:
    logits: torch.Tensor  # [T, V] U = lm_head · RMSNorm_final(h)
    bias: torch.Tensor    # [T, V] Markov bias W2 · W1[x_{k-1}] used for row k-1
    drafts: list          # [T] d_1..d_T
    hidden: torch.Tensor  # [T, D] block hidden before final_norm


class DraftLayer:
    def __init__(self, cfg: DraftConfig, w: DraftWeights, i: int):
        D, Ha, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        dn, dr, dv, I = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.intermediate_size
        self.cfg, self.Ha, self.R, self.dn, self.dr, self.dv = cfg, Ha, R, dn, dr, dv
        p = f"layers.{i}."
        a = p + "self_attn."
        self.in_norm = w(p + "input_layernorm.weight", (D,))
        self.post_norm = w(p + "post_attention_layernorm.weight", (D,))
        if cfg.q_lora_rank:
            Rq = cfg.q_lora_rank
            self.Wqa = w(a + "q_a_proj.weight", (Rq, D))
            self.qa_norm = w(a + "q_a_layernorm.weight", (Rq,))
            self.Wqb = w(a + "q_b_proj.weight", (Ha * (dn + dr), Rq))
        else:
            self.Wq = w(a + "q_proj.weight", (Ha * (dn + dr), D))
        self.Wkva = w(a + "kv_a_proj_with_mqa.weight", (R + dr, D))
        self.kva_norm = w(a + "kv_a_layernorm.weight", (R,))
        Wkvb = w(a + "kv_b_proj.weight", (Ha * (dn + dv), R)).view(Ha, dn + dv, R)
        self.WUK, self.WUV = Wkvb[:, :dn], Wkvb[:, dn:]  # [Ha, dn, R], [Ha, dv, R]
        self.Wo = w(a + "o_proj.weight", (D, Ha * dv))
        self.Wg = w(p + "mlp.gate_proj.weight", (I, D))
        self.Wu = w(p + "mlp.up_proj.weight", (I, D))
        self.Wd = w(p + "mlp.down_proj.weight", (D, I))

    def latent(self, x: torch.Tensor, pos: torch.Tensor, y: Yarn) -> torch.Tensor:
        """Latent rows [RMSNorm_{kv_a_layernorm}(kv[0:R]) | RoPE_pos(kv[R:R+dr])] of x [T, D] (§8.4)."""
        kv = linear(x, self.Wkva)
        c = rms_norm(kv[:, : self.R], self.kva_norm, self.cfg.rms_norm_eps)
        return torch.cat([c, rope(kv[:, self.R:], pos, y)], dim=1)

    def attention(self, x: torch.Tensor, pos: torch.Tensor, ctx_lat: torch.Tensor, y: Yarn) -> torch.Tensor:
        """MLA with YaRN RoPE (§8.5), expanded form.  x [T, D] normed block input at positions pos;
        keys = ctx_lat [p+1, R+dr] (context rows 0..p) followed by the block's own rows; no mask."""
        T, Ha, dn, dr, R = x.shape[0], self.Ha, self.dn, self.dr, self.R
        eps = self.cfg.rms_norm_eps
        if self.cfg.q_lora_rank:
            q = linear(rms_norm(linear(x, self.Wqa), self.qa_norm, eps), self.Wqb)
        else:
            q = linear(x, self.Wq)
        q = q.view(T, Ha, dn + dr)
        qN, qR = q[..., :dn], rope(q[..., dn:], pos, y)
        keys = torch.cat([ctx_lat, self.latent(x, pos, y)], dim=0)     # [S, R+dr]
        c, kR = keys[:, :R], keys[:, R:]
        kN = torch.einsum("hdr,sr->hsd", self.WUK, c)                  # [Ha, S, dn]
        vv = torch.einsum("hdr,sr->hsd", self.WUV, c)                  # [Ha, S, dv]
        sc = (torch.einsum("thd,hsd->hts", qN, kN) + torch.einsum("thd,sd->hts", qR, kR)) * y.softmax_scale
        o = torch.einsum("hts,hsd->thd", torch.softmax(sc, dim=-1), vv)  # [T, Ha, dv]
        return linear(o.reshape(T, Ha * self.dv), self.Wo)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return linear(silu(linear(x, self.Wg)) * linear(x, self.Wu), self.Wd)


class ReferenceDraft:
    def __init__(self, cfg: DraftConfig, w: DraftWeights, target: ReferenceModel):
        tc = target.cfg
        if cfg.target_hidden_size != tc.hidden_size or cfg.hidden_size != tc.hidden_size:
            raise ValueError(f"draft hidden {cfg.hidden_size} / target_hidden_size {cfg.target_hidden_size} "
                             f"vs target hidden {tc.hidden_size}: the draft reads the target's embedding")
        if cfg.vocab_size != tc.vocab_size:
            raise ValueError(f"draft vocab {cfg.vocab_size} != target vocab {tc.vocab_size}")
        if cfg.target_layer_ids[-1] >= tc.num_hidden_layers:
            raise ValueError(f"tap {cfg.target_layer_ids[-1]} >= target layers {tc.num_hidden_layers}")
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError("mask_token_id outside the vocabulary")
        D, V, nt, r = cfg.hidden_size, cfg.vocab_size, len(cfg.target_layer_ids), cfg.markov_rank
        self.cfg, self.w, self.target = cfg, w, target
        self.embed, self.lm_head = target.embed, target.lm_head  # §8.2: the target's, not the copy
        self.Wctx = w("context_proj.weight", (D, nt * tc.hidden_size))
        self.ctx_norm = w("context_norm.weight", (D,))
        self.final_norm = w("final_norm.weight", (D,))
        self.layers = [DraftLayer(cfg, w, i) for i in range(cfg.num_hidden_layers)]
        self.W1 = w("markov_head.markov_w1.weight", (V, r))
        self.W2 = w("markov_head.markov_w2.weight", (V, r))
        self.yarn = yarn(cfg)

    @classmethod
    def from_dir(cls, folder: str, target: ReferenceModel) -> "ReferenceDraft":
        with open(os.path.join(folder, "config.json")) as f:
            cfg = parse_draft_config(json.load(f))
        return cls(cfg, DraftWeights(folder), target)

    def taps_from(self, out, ids) -> list:
        """§8.3: tap L = hidden[L] (the stream after 0-based layer L; AttnRes: block-local P);
        tap -1 = the embedding output."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return [self.embed[ids] if L == -1 else out.hidden[L] for L in self.cfg.target_layer_ids]

    def context(self, taps: list) -> torch.Tensor:
        """§8.4: ctx_j = RMSNorm_{context_norm}(W_context · concat(taps in ascending id order))."""
        return rms_norm(linear(torch.cat(taps, dim=1), self.Wctx), self.ctx_norm, self.cfg.rms_norm_eps)

    def context_latents(self, ctx: torch.Tensor, pos0: int = 0) -> list:
        """Per draft layer the latent rows of ctx at positions pos0.. (ctx does not pass through
        input_layernorm, §8.4)."""
        pos = torch.arange(pos0, pos0 + ctx.shape[0])
        return [layer.latent(ctx, pos, self.yarn) for layer in self.layers]

    def propose(self, ctx_lat: list, anchor: int, T: int) -> ProposeOutput:
        """§8.5 block pass for anchor x0 at position p+1 (p+1 = rows in ctx_lat), then §8.7 walk."""
        cfg = self.cfg
        p1 = ctx_lat[0].shape[0]
        ids = torch.tensor([anchor] + [cfg.mask_token_id] * (T - 1), dtype=torch.long)
        pos = torch.arange(p1, p1 + T)
        h = self.embed[ids]
        eps = cfg.rms_norm_eps
        for layer, lat in zip(self.layers, ctx_lat):
            h = h + layer.attention(rms_norm(h, layer.in_norm, eps), pos, lat, self.yarn)
            h = h + layer.mlp(rms_norm(h, layer.post_norm, eps))
        U = linear(rms_norm(h, self.final_norm, eps), self.lm_head)       # [T, V]
        drafts, biases = [], []
        x = min(max(int(anchor), 0), cfg.vocab_size - 1)                  # §8.7: clamp before the gather
        for k in range(T):
            b = self.W2 @ self.W1[x]                                      # [V]
            biases.append(b)
            x = int(torch.argmax(U[k] + b).item())                        # first maximum = lowest id
            drafts.append(x)
        return ProposeOutput(logits=U, bias=torch.stack(biases), drafts=drafts, hidden=h)
