"""Config builders and checkpoint writers for the trainer (layout of models/tiny-k3: kimi_k3 root with
`text_config`, `language_model.` names, BF16 with the F32 tensors of docs/model.md §10 trap 4; the draft as
one k3_dspark model.safetensors)."""
from __future__ import annotations

import glob
import json
import os
import shutil


MAX_FILE_BYTES = 12_000_000      # every written .safetensors stays below this
HEADER_SLACK = 400_000           # room for the JSON header of a shard


def target_config(tok, *, hidden=256, layers=12, intermediate=768, kda_heads=4, kda_head_dim=64,
                  mla_heads=4, q_lora=128, kv_lora=128, nope=32, rope=16, v_head=32, experts=16, topk=2,
                  moe_inter=128, shared=1, latent=128, expert_groups=4, topk_group=2, attn_res_block=4,
                  mla_every=4, max_pos=4096) -> dict:
    """kimi_k3 root config.  Layer pattern as K3: layer 1 dense MLP, KDA : MLA = 3 : 1 (every
    `mla_every`-th layer is MLA, 1-based) and the last layer MLA."""
    mla = [i for i in range(1, layers + 1) if i % mla_every == 0 or i == layers]
    kda = [i for i in range(1, layers + 1) if i not in mla]
    text = {
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": attn_res_block, "first_k_dense_replace": 1, "hidden_act": "situ",
        "hidden_size": hidden, "intermediate_size": intermediate, "kv_lora_rank": kv_lora,
        "latent_moe_use_norm": True,
        "linear_attn_config": {"full_attn_layers": mla, "gate_lower_bound": -5.0, "head_dim": kda_head_dim,
                               "kda_layers": kda, "num_heads": kda_heads, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True},
        "max_position_embeddings": max_pos, "mla_use_nope": True, "mla_use_output_gate": True,
        "model_type": "kimi_linear", "moe_intermediate_size": moe_inter, "moe_layer_freq": 1,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": mla_heads,
        "num_expert_group": expert_groups, "num_experts": experts, "num_experts_per_token": topk,
        "num_hidden_layers": layers, "num_key_value_heads": mla_heads, "num_nextn_predict_layers": 0,
        "num_shared_experts": shared, "q_lora_rank": q_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "rms_norm_eps": 1e-5, "routed_expert_hidden_size": latent, "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False, "topk_group": topk_group, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "use_grouped_topk": True, "v_head_dim": v_head, "vocab_size": tok.vocab_size,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id, "media_placeholder_token_id": tok.media_pad_id, "model_type": "kimi_k3",
        "pad_token_id": tok.pad_id, "text_config": text, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vision_config": {},
    }


def default_taps(L: int, n: int = 4) -> list:
    """n taps spread over the depth, ending at the last layer (its block-local P is the most
    next-token-like stream the target has)."""
    ids = sorted({round(1 + (L - 2) * i / (n - 1)) for i in range(n)})
    return ids


def draft_config(target_root: dict, tok, *, layers=2, heads=4, intermediate=768, q_lora=128, kv_lora=128,
                 nope=32, rope=16, v_head=32, markov_rank=64, taps=None) -> dict:
    tc = target_root.get("text_config", target_root)
    D, L = tc["hidden_size"], tc["num_hidden_layers"]
    taps = taps or default_taps(L)
    return {
        "architectures": ["K3DSparkModel"], "confidence_head_with_markov": True,
        "draft_vocab_size": tok.vocab_size, "enable_confidence_head": True, "hidden_act": "silu",
        "hidden_size": D, "intermediate_size": intermediate, "kv_lora_rank": kv_lora,
        "markov_head_type": "vanilla", "markov_rank": markov_rank, "mask_token_id": tok.mask_id,
        "max_position_embeddings": 1048576, "mla_use_nope": False, "mla_use_output_gate": False,
        "model_type": "k3_dspark", "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": heads, "num_target_layers": len(taps), "q_lora_rank": q_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "rms_norm_eps": 1e-5,
        "rope_parameters": {"beta_fast": 32, "beta_slow": 1, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 32768, "rope_theta": 50000.0, "rope_type": "yarn"},
        "rope_theta": 50000.0, "target_hidden_size": D, "target_layer_ids": list(taps),
        "target_num_hidden_layers": L, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "v_head_dim": v_head, "vocab_size": tok.vocab_size,
    }


def _publish(folder: str, staged: dict, stale_glob: list):
    """Moves staged files (name -> temp path) into folder, index/config last, then removes stale
    weight files that the new set does not contain.  Each os.replace is atomic, so a crash leaves
    either the old or the new file under every name."""
    os.makedirs(folder, exist_ok=True)
    order = sorted(staged, key=lambda n: (n.endswith(".json"), n))
    for name in order:
        os.replace(staged[name], os.path.join(folder, name))
    for pat in stale_glob:
        for f in glob.glob(os.path.join(folder, pat)):
            if os.path.basename(f) not in staged:
                os.remove(f)


def save_model_dir(folder: str, config: dict, tensors: dict, *, shard: bool, extra_files=(),
                   max_file_bytes: int = MAX_FILE_BYTES):
    """config.json + safetensors (sharded as model-0000i-of-0000n + index when `shard`, else one
    model.safetensors), plus extra files copied in.  Other files in the folder (e.g. a draft/ sub
    folder, logs) are left alone."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    stage = os.path.join(folder, f".staging-{os.getpid()}")
    os.makedirs(stage, exist_ok=True)
    staged = {}
    names = sorted(tensors)
    nbytes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    limit = max_file_bytes - HEADER_SLACK
    if shard:
        groups, cur, size = [], [], 0
        for k in names:
            if cur and size + nbytes[k] > limit:
                groups.append(cur)
                cur, size = [], 0
            if nbytes[k] > limit:
                raise ValueError(f"tensor {k} ({nbytes[k]} B) does not fit in one {max_file_bytes} B shard")
            cur.append(k)
            size += nbytes[k]
        groups.append(cur)
        n = len(groups)
        wmap = {}
        for i, grp in enumerate(groups):
            fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file({k: tensors[k] for k in grp}, os.path.join(stage, fn), metadata={"format": "pt"})
            staged[fn] = os.path.join(stage, fn)
            wmap.update({k: fn for k in grp})
        with open(os.path.join(stage, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": wmap}, f, indent=2)
        staged["model.safetensors.index.json"] = os.path.join(stage, "model.safetensors.index.json")
    else:
        save_file(tensors, os.path.join(stage, "model.safetensors"), metadata={"format": "pt"})
        staged["model.safetensors"] = os.path.join(stage, "model.safetensors")
    for name, path in staged.items():
        os.chmod(path, 0o644)  # safetensors writes 0600; the engine may run as another user
        if name.endswith(".safetensors") and os.path.getsize(path) > max_file_bytes:
            raise ValueError(f"{name} is {os.path.getsize(path)} B > {max_file_bytes} B")
    with open(os.path.join(stage, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    staged["config.json"] = os.path.join(stage, "config.json")
    for src in extra_files:
        dst = os.path.join(stage, os.path.basename(src))
        shutil.copyfile(src, dst)
        staged[os.path.basename(src)] = dst
    for path in staged.values():
        os.chmod(path, 0o644)
    _publish(folder, staged, ["model*.safetensors", "model.safetensors.index.json"])
    shutil.rmtree(stage, ignore_errors=True)
    return sum(nbytes.values())
