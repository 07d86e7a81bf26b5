#!/usr/bin/env bash
# On the GPU machine: the bundled model's teacher-forced logits on the GPU, once per setting given
# (each a space-separated list of VAR=VALUE, e.g. "DS_CUDA_EXPERT_BF16_OUT=0"; "" the defaults),
# against the CPU's over the same N random ids (default 600: enough rows a routed expert for the
# prompt's cuBLAS GEMM path), with relative error and argmax agreement — how session 44 judged
# the accuracy of a GPU default on the trained model (a random tiny model amplifies BF16
# activations far more). The bundled model must travel: pack with DS_DEVBIN_MINI=1 and take the
# goldens out of the call's tree (`tools/device/light_tree.sh slim`; `back` after the call).
#   tools/device/logits_env.sh "" "DS_CUDA_EXPERT_BF16_OUT=0" ...
. "$(dirname "$0")/env.sh"
M=${MODEL:-models/gsm-k3}
N=${N:-600}
IDS=$(python3 -c "import random; r=random.Random(5); print(','.join(str(r.randrange(2000)) for _ in range($N)))")
.devbin/deltaserve logits --model "$M" --token-ids "$IDS" --out "$OUT/lg_cpu.npy" --device cpu ||
  exit 1
i=0
for setting in "$@"; do
  env $setting .devbin/deltaserve logits --model "$M" --token-ids "$IDS" --out "$OUT/lg_$i.npy" \
    --device cuda || exit 1
  python3 - "$OUT" "$i" "$setting" <<'PY'
import sys, numpy as np
out, i, setting = sys.argv[1], sys.argv[2], sys.argv[3]
c = np.load(f"{out}/lg_cpu.npy").astype(np.float64); g = np.load(f"{out}/lg_{i}.npy").astype(np.float64)
rows = np.linalg.norm(g - c, axis=1) / np.linalg.norm(c, axis=1)
print(f"[{setting or 'defaults'}] GPU vs CPU rel err {np.linalg.norm(g - c) / np.linalg.norm(c):.3e}, "
      f"worst row {rows.max():.1e}, argmax agreement {(g.argmax(1) == c.argmax(1)).mean():.4f}")
PY
  i=$((i + 1))
done
