#!/usr/bin/env python3
"""Writes the DSpark draft golden (format: tools/reference/README.md) from the float64 references of the
target (model.py) and the draft (draft.py).

usage: write_draft_golden.py --model DIR --out FILE [--num-tokens 40 --seed 3 --blocks 4,7]

DIR is the target checkpoint; its draft is DIR/draft (or --draft).  The prompt (--num-tokens ids drawn
uniformly from [0, vocab_size) with numpy.random.default_rng(seed).integers) runs through the target; its
taps give the draft context rows 0..n-1; the anchor is the argmax of the target's last logits, placed at
position n (p = n-1), and a block of each width in --blocks is proposed.

Entries
  meta.checkpoint_fnv1a64  u64 [1]     FNV-1a 64 over the bytes of DIR/*.safetensors (sorted names) followed
                                       by DRAFT/*.safetensors (sorted), hashed as ONE stream (target first)
  input_ids                i32 [n]
  anchor                   i32 [1]     argmax of the target's logits at position n-1
  tap_layers               i32 [n_taps] target_layer_ids
  taps                     f32 [n_taps][n][D]  target stream after each tap layer (-1: embedding)
  ctx                      f32 [n][D]  RMSNorm_{context_norm}(W_context · concat(taps))
  latent.{l}               f32 [n][R+dr]  draft layer l's context cache rows [c | RoPE(kR)]
  yarn.inv_freq            f64 [dr/2]  corrected inverse frequencies (§8.6)
  yarn.lo_hi               i32 [2]
  yarn.softmax_scale       f64 [1]
  block_logits.T{T}        f32 [T][V]  U of the block pass
  drafts.T{T}              i32 [T]     d_1..d_T of the Markov walk
  alt.anchor               i32 [1]     --alt-anchor, proposed with T = 7 after the same context:
  alt.block_logits.T7, alt.drafts.T7   (the main anchor's mask rows mostly agree with the Markov bias's
                                       choice; this walk changes at every step, see the printed check)
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def fnv1a64_folders(folders) -> int:
    """FNV-1a 64 over every *.safetensors file of each folder (folders in the given order, files in
    sorted name order inside each), one stream."""
    h, prime, mask = 0xCBF29CE484222325, 0x100000001B3, 0xFFFFFFFFFFFFFFFF
    for folder in folders:
        for f in sorted(os.listdir(folder)):
            if not f.endswith(".safetensors"):
                continue
            with open(os.path.join(folder, f), "rb") as fh:
                for b in fh.read():
                    h = ((h ^ b) * prime) & mask
    return h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target checkpoint folder")
    ap.add_argument("--draft", default=None, help="draft folder (default MODEL/draft)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--blocks", default="4,7", help="block widths T to propose")
    ap.add_argument("--alt-anchor", type=int, default=100,
                    help="a second anchor (T = 7) whose walk differs from the no-bias and anchor-only-bias "
                         "walks, so that a broken Markov chain fails the test; -1: none")
    a = ap.parse_args()

    import torch
    from draft import ReferenceDraft
    from model import ReferenceModel
    from write_golden import write_golden

    draft_dir = a.draft or os.path.join(a.model, "draft")
    tgt = ReferenceModel.from_dir(a.model)
    dr = ReferenceDraft.from_dir(draft_dir, tgt)
    if dr.w.unused():
        sys.exit(f"draft has tensors the reference does not use (misnamed?): {dr.w.unused()[:10]}")
    cfg = dr.cfg
    V = cfg.vocab_size
    ids = np.random.default_rng(a.seed).integers(0, V, size=a.num_tokens)
    with torch.no_grad():
        out = tgt.forward(ids)
        anchor = int(torch.argmax(out.logits[-1]).item())
        taps = dr.taps_from(out, ids)
        ctx = dr.context(taps)
        lat = dr.context_latents(ctx, 0)
        # The context written in two chunks (as prefill + verify would) gives the same rows.
        cut = a.num_tokens // 3
        lat2 = [torch.cat(x, 0) for x in zip(dr.context_latents(ctx[:cut], 0),
                                              dr.context_latents(ctx[cut:], cut))]
        # (equal up to float64 rounding: BLAS blocks a 40-row product differently from a 13-row one)
        assert all(torch.allclose(x, y, rtol=1e-12, atol=1e-12) for x, y in zip(lat, lat2))
        entries = [("meta.checkpoint_fnv1a64", np.array([fnv1a64_folders([a.model, draft_dir])], dtype=np.uint64)),
                   ("input_ids", ids.astype(np.int32)),
                   ("anchor", np.array([anchor], dtype=np.int32)),
                   ("tap_layers", np.array(cfg.target_layer_ids, dtype=np.int32)),
                   ("taps", torch.stack(taps).numpy().astype(np.float32)),
                   ("ctx", ctx.numpy().astype(np.float32))]
        for i, x in enumerate(lat):
            entries.append((f"latent.{i}", x.numpy().astype(np.float32)))
        y = dr.yarn
        entries += [("yarn.inv_freq", y.inv_freq.numpy().astype(np.float64)),
                    ("yarn.lo_hi", np.array([y.lo, y.hi], dtype=np.int32)),
                    ("yarn.softmax_scale", np.array([y.softmax_scale], dtype=np.float64))]
        cases = [("", anchor, T) for T in [int(t) for t in a.blocks.split(",")]]
        if a.alt_anchor >= 0:
            entries.append(("alt.anchor", np.array([a.alt_anchor], dtype=np.int32)))
            cases.append(("alt.", a.alt_anchor, 7))
        for prefix, x0, T in cases:
            res = dr.propose(lat, x0, T)
            # How close the walk came to a tie: the C engine (fp32) must pick the same ids, so a
            # golden whose margin is near fp32 rounding would be fragile.
            score = res.logits + res.bias
            top2 = torch.topk(score, 2, dim=-1).values
            margin = ((top2[:, 0] - top2[:, 1]) / score.abs().max()).min().item()
            # Walks a broken chain would give: no Markov bias, or the anchor's bias on every row.
            no_bias = res.logits.argmax(-1).tolist()
            b0 = dr.W2 @ dr.W1[x0]
            anchor_only = [int((res.logits[k] + b0).argmax()) for k in range(T)]
            print(f"{prefix}T={T} anchor {x0}: drafts {res.drafts} (no bias {no_bias}, anchor-only bias "
                  f"{anchor_only}), smallest relative top-2 margin {margin:.2e}")
            if margin < 1e-4:
                sys.exit("a Markov step is too close to a tie for an exact fp32 comparison; "
                         "pick another --seed")
            if prefix and (res.drafts == no_bias or res.drafts == anchor_only):
                sys.exit("the alternative anchor's walk does not tell a broken Markov chain apart; "
                         "pick another --alt-anchor")
            entries.append((f"{prefix}block_logits.T{T}", res.logits.numpy().astype(np.float32)))
            entries.append((f"{prefix}drafts.T{T}", np.array(res.drafts, dtype=np.int32)))
    write_golden(a.out, entries)
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes): n={len(ids)} anchor={anchor} V={V} "
          f"lo/hi={y.lo}/{y.hi} scale={y.softmax_scale:.6f} fnv1a64={entries[0][1][0]:#018x}")


if __name__ == "__main__":
    main()
