"""Batched, differentiable DSpark draft (`k3_dspark`, docs/model.md §8) for training.

Same math as tools/reference/draft.py (checked to 1e-9 in float64 by check_equiv.py).  One forward
runs many blocks at once: for every anchor p (context rows 0..p processed by the target) a block of
K rows [x0 = token at p+1, mask × (K-1)] at positions p+1..p+K.  One attention mask makes block rows
of anchor p see context rows 0..p and the K rows of their own block (non-causal inside, §8.5), so
A anchors per sequence cost one pass.  Parameter names are the checkpoint names of §8.2; the draft
reads the target's lm_head (passed in, never saved) and keeps `embed_tokens` as a frozen copy of the
target's table.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from draft import parse_draft_config, yarn  # noqa: E402  (reference config/YaRN: both read the same)
from k3_torch import RMSNorm, hp, no_autocast  # noqa: E402


def rope(x, cos, sin):
    """Adjacent-lane pairs (x[2i], x[2i+1]) turned by the angle of pair i (§8.6, interleaved)."""
    x = hp(x)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class DraftAttention(nn.Module):
    def __init__(self, dc):
        super().__init__()
        D, Ha = dc.hidden_size, dc.num_attention_heads
        self.dc, self.Ha = dc, Ha
        self.dn, self.dr, self.dv, self.R = dc.qk_nope_head_dim, dc.qk_rope_head_dim, dc.v_head_dim, dc.kv_lora_rank
        qd = Ha * (self.dn + self.dr)
        if dc.q_lora_rank:
            self.q_a_proj = nn.Linear(D, dc.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(dc.q_lora_rank, dc.rms_norm_eps)  # 1e-5 in the draft (§4.5)
            self.q_b_proj = nn.Linear(dc.q_lora_rank, qd, bias=False)
        else:
            self.q_proj = nn.Linear(D, qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, dc.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.R, Ha * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(Ha * self.dv, D, bias=False)

    def latent(self, x, cos, sin):
        """Cache rows [RMSNorm(kv[:R]) | RoPE(kv[R:])] of x [B, n, D] (§8.4)."""
        kv = self.kv_a_proj_with_mqa(x)
        with no_autocast(x):
            return torch.cat([self.kv_a_layernorm(kv[..., : self.R]), rope(kv[..., self.R:], cos, sin)], dim=-1)

    def forward(self, x, cos, sin, ctx_lat, mask, scale):
        """x [B, n, D] normed block input; ctx_lat [B, T, R+dr]; mask [B, 1, n, T+n] (True = attend)."""
        B, n, _ = x.shape
        Ha, dn, dr, dv, R = self.Ha, self.dn, self.dr, self.dv, self.R
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.dc.q_lora_rank else self.q_proj(x)
        q = q.view(B, n, Ha, dn + dr)
        with no_autocast(x):
            qR = rope(q[..., dn:], cos.unsqueeze(2), sin.unsqueeze(2))
        keys = torch.cat([hp(ctx_lat), self.latent(x, cos, sin)], dim=1)            # [B, S, R+dr]
        kvb = self.kv_b_proj(keys[..., :R]).view(B, -1, Ha, dn + dv)
        dt = kvb.dtype
        S = keys.shape[1]
        k = torch.cat([kvb[..., :dn], keys[..., R:].to(dt).unsqueeze(2).expand(B, S, Ha, dr)], dim=-1)
        qq = torch.cat([q[..., :dn].to(dt), qR.to(dt)], dim=-1)
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), k.transpose(1, 2), kvb[..., dn:].transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, n, Ha * dv))


class DraftMLP(nn.Module):
    def __init__(self, D, I):
        super().__init__()
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        a, u = self.gate_proj(x), self.up_proj(x)
        with no_autocast(x):
            h = F.silu(hp(a)) * hp(u)
        return self.down_proj(h)


class DraftLayer(nn.Module):
    def __init__(self, dc):
        super().__init__()
        self.input_layernorm = RMSNorm(dc.hidden_size, dc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dc.hidden_size, dc.rms_norm_eps)
        self.self_attn = DraftAttention(dc)
        self.mlp = DraftMLP(dc.hidden_size, dc.intermediate_size)


class MarkovHead(nn.Module):
    def __init__(self, V, r):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, r)           # weight [V, r]
        self.markov_w2 = nn.Linear(r, V, bias=False)  # weight [V, r]

    def forward(self, prev):
        """Bias row W2 · W1[prev] for previous tokens prev [...] -> [..., V] (§8.7)."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, 1, bias=True)


class DSparkDraft(nn.Module):
    def __init__(self, draft_root: dict):
        super().__init__()
        dc = parse_draft_config(draft_root)
        self.dc, self.root = dc, draft_root
        D, V, r = dc.hidden_size, dc.vocab_size, dc.markov_rank
        self.context_proj = nn.Linear(len(dc.target_layer_ids) * dc.target_hidden_size, D, bias=False)
        self.context_norm = RMSNorm(D, dc.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(dc) for _ in range(dc.num_hidden_layers)])
        self.final_norm = RMSNorm(D, dc.rms_norm_eps)
        self.markov_head = MarkovHead(V, r)
        if draft_root.get("enable_confidence_head", False):
            self.confidence_head = ConfidenceHead(D + r)  # training-only (§8.7)
        self.embed_tokens = nn.Embedding(V, D)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's table
        y = yarn(dc)
        self.register_buffer("inv_freq", y.inv_freq.clone(), persistent=False)
        self.softmax_scale, self.cs_mscale = y.softmax_scale, y.cos_sin_mscale

    def cos_sin(self, pos):
        ang = pos.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq   # float64 angles
        dt = self.context_proj.weight.dtype                                 # fp32 (train) / fp64 (check)
        return (torch.cos(ang) * self.cs_mscale).to(dt), (torch.sin(ang) * self.cs_mscale).to(dt)

    def context(self, taps: list):
        """§8.4: RMSNorm_{context_norm}(W_context · concat(taps)) for taps [B, T, Dt] each."""
        return self.context_norm(self.context_proj(torch.cat([hp(t) for t in taps], dim=-1)))

    def forward(self, ctx, anchor_pos, block_ids):
        """ctx [B, T, D] (context()), anchor_pos [B, A] (p: context rows 0..p are visible),
        block_ids [B, A, K] (normally [x0, mask, ...]) -> normed block hidden [B, A, K, D]."""
        B, T, _ = ctx.shape
        A, K = block_ids.shape[1:]
        n = A * K
        dev = ctx.device
        pos_blk = (anchor_pos.unsqueeze(-1) + 1 + torch.arange(K, device=dev)).reshape(B, n)
        cos_b, sin_b = self.cos_sin(pos_blk)
        cos_c, sin_c = self.cos_sin(torch.arange(T, device=dev))
        p_row = anchor_pos.repeat_interleave(K, dim=1)                              # [B, n]
        see_ctx = torch.arange(T, device=dev).view(1, 1, T) <= p_row.unsqueeze(-1)  # [B, n, T]
        blk = torch.arange(n, device=dev) // K
        see_blk = (blk.view(n, 1) == blk.view(1, n)).expand(B, n, n)                # own block only
        mask = torch.cat([see_ctx, see_blk], dim=-1).unsqueeze(1)
        h = hp(self.embed_tokens(block_ids.reshape(B, n)))
        for layer in self.layers:
            lat = layer.self_attn.latent(ctx, cos_c, sin_c)
            h = h + layer.self_attn(layer.input_layernorm(h), cos_b, sin_b, lat, mask, self.softmax_scale)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.final_norm(h).view(B, A, K, -1)

    def block_logits(self, hidden, lm_head_w, prev):
        """U + Markov bias: hidden [..., D], prev [...] (token before each row) -> [..., V]."""
        return F.linear(hidden, lm_head_w) + self.markov_head(prev)

    @torch.no_grad()
    def walk(self, hidden, lm_head_w, anchor):
        """Greedy Markov walk (§8.7) for one block per sequence: hidden [B, K, D], anchor [B]."""
        U = hp(F.linear(hidden, lm_head_w))
        x = anchor.clamp(0, self.dc.vocab_size - 1)
        out = []
        for k in range(U.shape[1]):
            x = torch.argmax(U[:, k] + hp(self.markov_head(x)), dim=-1)  # first maximum = lowest id
            out.append(x)
        return torch.stack(out, dim=1)
