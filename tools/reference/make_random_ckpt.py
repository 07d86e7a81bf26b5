#!/usr/bin/env python3
"""Builds a tiny random checkpoint in the exact published layout of either family, for testing the
reference (and anything else) before `deltaserve init-model` exists.

  tiny-k3     : Kimi-K3 layout: root config model_type "kimi_k3" with the text model in text_config,
                weights prefixed `language_model.`, BF16 matrices, F32 A_log (padded: only the first Hk
                entries live, the rest 0), dt_bias, conv1d, KDA o_norm and router bias; MLA q-LoRA + output
                gate, full-rank KDA output gate, lower-bound forget gate, SiTU, latent MoE with norm,
                group-limited routing, AttnRes.  Written as two shards + model.safetensors.index.json, plus a
                stray vision_tower tensor that the text model must ignore.
  tiny-linear : Kimi-Linear layout: everything at the top level, `model.` names, A_log [1,1,Hk,1],
                low-rank KDA output gate, softplus forget gate, q_proj MLA, SwiGLU, plain MoE, no AttnRes.

usage: make_random_ckpt.py --family k3|linear --out DIR [--seed S] [--mxfp4]
"""
import argparse
import json
import math
import os

import torch
from safetensors.torch import save_file

BF16, F32 = torch.bfloat16, torch.float32


def tiny_k3_text_config():
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 10, "intermediate_size": 96,
        "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "mla_use_output_gate": True, "rope_theta": 10000.0, "rope_scaling": None,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8, 9, 10],
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "use_grouped_topk": True,
        "num_expert_group": 2, "topk_group": 1, "topk_method": "noaux_tc",
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "attn_res_block_size": 3,
        "num_nextn_predict_layers": 0, "model_max_length": 1048576, "max_position_embeddings": 1048576,
        "tie_word_embeddings": False, "bos_token_id": 1020, "eos_token_id": 1021, "pad_token_id": 1023,
    }


def tiny_linear_config():
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 96,
        "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "rope_theta": 10000.0, "rope_scaling": None,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6]},
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0, "model_max_length": 1048576,
        "tie_word_embeddings": False, "bos_token_id": 1020, "eos_token_id": 1021, "pad_token_id": 1023,
    }


class Gen:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g, dtype=torch.float64)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.g, dtype=torch.float64)

    def lin(self, out, inp, gain=1.0, dtype=BF16):
        return (self.randn(out, inp) * gain / math.sqrt(inp)).to(dtype)

    def norm(self, n, dtype=BF16):
        return (1.0 + 0.1 * self.randn(n)).to(dtype)


def quant_mxfp4(w: torch.Tensor):
    """Round a float matrix [out, in] (in % 32 == 0) to MXFP4; returns (packed U8, scale U8)."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    out, inp = w.shape
    w = w.to(torch.float64).view(out, inp // 32, 32)
    amax = w.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = w / torch.pow(2.0, e)
    idx = (x.abs().unsqueeze(-1) - table).abs().argmin(-1)
    codes = (idx | torch.where(x < 0, 8, 0)).view(out, inp).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = (e.view(out, inp // 32) + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def build(family: str, seed: int, mxfp4: bool = False):
    k3 = family == "k3"
    tc = tiny_k3_text_config() if k3 else tiny_linear_config()
    g = Gen(seed)
    D, V, L, I = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"], tc["intermediate_size"]
    lac = tc["linear_attn_config"]
    Hk, dk, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = Hk * dk
    Ha, R, dn, dr, dv = (tc["num_attention_heads"], tc["kv_lora_rank"], tc["qk_nope_head_dim"],
                         tc["qk_rope_head_dim"], tc["v_head_dim"])
    E, Ie, ns = tc["num_experts"], tc["moe_intermediate_size"], tc["num_shared_experts"]
    Dlat = tc.get("routed_expert_hidden_size") or D
    mla = {x - 1 for x in lac["full_attn_layers"]}
    t = {}
    t["model.embed_tokens.weight"] = g.randn(V, D).to(BF16)
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = g.norm(D)
        t[p + "post_attention_layernorm.weight"] = g.norm(D)
        if tc.get("attn_res_block_size"):
            t[p + "self_attention_res_norm.weight"] = g.norm(D)
            t[p + "self_attention_res_proj.weight"] = (g.randn(1, D) * 2.0 / math.sqrt(D)).to(BF16)
            t[p + "mlp_res_norm.weight"] = g.norm(D)
            t[p + "mlp_res_proj.weight"] = (g.randn(1, D) * 2.0 / math.sqrt(D)).to(BF16)
        a = p + "self_attn."
        if i in mla:
            if tc.get("q_lora_rank"):
                Rq = tc["q_lora_rank"]
                t[a + "q_a_proj.weight"] = g.lin(Rq, D)
                t[a + "q_a_layernorm.weight"] = g.norm(Rq)
                t[a + "q_b_proj.weight"] = g.lin(Ha * (dn + dr), Rq, 2.0)
            else:
                t[a + "q_proj.weight"] = g.lin(Ha * (dn + dr), D, 2.0)
            t[a + "kv_a_proj_with_mqa.weight"] = g.lin(R + dr, D)
            t[a + "kv_a_layernorm.weight"] = g.norm(R)
            t[a + "kv_b_proj.weight"] = g.lin(Ha * (dn + dv), R)
            t[a + "o_proj.weight"] = g.lin(D, Ha * dv, 0.7)
            if tc.get("mla_use_output_gate"):
                t[a + "g_proj.weight"] = g.lin(Ha * dv, D)
        else:
            t[a + "q_proj.weight"] = g.lin(P, D)
            t[a + "k_proj.weight"] = g.lin(P, D)
            t[a + "v_proj.weight"] = g.lin(P, D)
            cdt = F32 if k3 else BF16
            for c in ("q", "k", "v"):
                t[a + f"{c}_conv1d.weight"] = (0.5 * g.randn(P, 1, W)).to(cdt)
            t[a + "f_a_proj.weight"] = g.lin(dk, D)
            t[a + "f_b_proj.weight"] = g.lin(P, dk)
            if lac.get("gate_lower_bound") is not None:
                # lower-bound form lb·σ(a·(f+dt_bias)): centre the argument near 0 so decays span (e^lb, 1)
                t[a + "dt_bias"] = (0.5 * g.randn(P)).to(F32)
                A = torch.log(0.5 + 1.5 * g.rand(Hk))
            else:  # fla's init: dt ~ logU(1e-3, 1e-1), dt_bias = softplus⁻¹(dt), A ~ U(1, 16)
                dt = torch.exp(math.log(1e-3) + g.rand(P) * (math.log(1e-1) - math.log(1e-3)))
                t[a + "dt_bias"] = (dt + torch.log(-torch.expm1(-dt))).to(F32)
                A = torch.log(1.0 + 15.0 * g.rand(Hk))
            if k3:  # [Hk rounded up to a multiple of 8] with the tail zero, like K3's [128] for 96 heads
                pad = torch.zeros(((Hk + 7) // 8) * 8 + 4, dtype=torch.float64)
                pad[:Hk] = A
                t[a + "A_log"] = pad.to(F32)
            else:
                t[a + "A_log"] = A.view(1, 1, Hk, 1).to(F32)
            t[a + "b_proj.weight"] = g.lin(Hk, D)
            if lac.get("use_full_rank_gate"):
                t[a + "g_proj.weight"] = g.lin(P, D)
            else:
                t[a + "g_a_proj.weight"] = g.lin(dk, D)
                t[a + "g_b_proj.weight"] = g.lin(P, dk)
            t[a + "o_norm.weight"] = g.norm(dk, F32 if k3 else BF16)
            t[a + "o_proj.weight"] = g.lin(D, P, 0.7)
        if i < tc["first_k_dense_replace"]:
            m = p + "mlp."
            t[m + "gate_proj.weight"] = g.lin(I, D)
            t[m + "up_proj.weight"] = g.lin(I, D)
            t[m + "down_proj.weight"] = g.lin(D, I, 0.7)
        else:
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = g.lin(E, D, 2.0)
            t[m + "gate.e_score_correction_bias"] = (0.1 * g.randn(E)).to(F32)
            for e in range(E):
                for nm, (o, ii) in (("w1", (Ie, Dlat)), ("w3", (Ie, Dlat)), ("w2", (Dlat, Ie))):
                    wt = g.lin(o, ii, 0.7 if nm == "w2" else 1.0)
                    if mxfp4:
                        pk, sc = quant_mxfp4(wt)
                        t[m + f"experts.{e}.{nm}.weight_packed"] = pk
                        t[m + f"experts.{e}.{nm}.weight_scale"] = sc
                    else:
                        t[m + f"experts.{e}.{nm}.weight"] = wt
            if ns:
                t[m + "shared_experts.gate_proj.weight"] = g.lin(Ie * ns, D)
                t[m + "shared_experts.up_proj.weight"] = g.lin(Ie * ns, D)
                t[m + "shared_experts.down_proj.weight"] = g.lin(D, Ie * ns, 0.7)
            if tc.get("routed_expert_hidden_size"):
                t[m + "routed_expert_down_proj.weight"] = g.lin(Dlat, D)
                t[m + "routed_expert_up_proj.weight"] = g.lin(D, Dlat, 0.7)
                if tc.get("latent_moe_use_norm"):
                    t[m + "routed_expert_norm.weight"] = g.norm(Dlat)
    t["model.norm.weight"] = g.norm(D)
    if tc.get("attn_res_block_size"):
        t["model.output_attn_res_norm.weight"] = g.norm(D)
        t["model.output_attn_res_proj.weight"] = (g.randn(1, D) * 2.0 / math.sqrt(D)).to(BF16)
    t["lm_head.weight"] = g.lin(V, D)
    if k3:
        t = {"language_model." + k: v for k, v in t.items()}
        t["vision_tower.patch_embed.proj.weight"] = g.randn(8, 3, 2, 2).to(BF16)  # must be ignored
        root = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                "bos_token_id": 1020, "eos_token_id": 1021, "pad_token_id": 1023,
                "media_placeholder_token_id": 1022, "tie_word_embeddings": False,
                "text_config": tc, "vision_config": {"model_type": "moonvit", "hidden_size": 8}}
        if mxfp4:
            root["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                           "group_size": 32}
    else:
        root = tc
    return root, {k: v.contiguous() for k, v in t.items()}


def write(folder: str, root: dict, tensors: dict, shards: int):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(root, f, indent=2)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    per = (len(names) + shards - 1) // shards
    wmap = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(folder, fn), metadata={"format": "pt"})
        wmap.update({k: fn for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["k3", "linear"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mxfp4", action="store_true", help="K3: store routed experts as MXFP4 (needs in % 32 == 0)")
    ap.add_argument("--shards", type=int, default=None)
    a = ap.parse_args()
    root, tensors = build(a.family, a.seed, a.mxfp4)
    write(a.out, root, tensors, a.shards or (2 if a.family == "k3" else 1))
    print(f"wrote {a.out}: {len(tensors)} tensors")
