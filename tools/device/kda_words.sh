#!/usr/bin/env bash
# On the GPU machine, with .devbin carried and a baseline's test_cuda_kernels beside the new one
# (DS_DEVBIN_BASE_TESTS=path pack_devbin.sh -> .devbin/test_cuda_kernels_base): the chunked KDA
# of both binaries on one set of random inputs (T tokens x H heads of D, numpy; default the
# issue's 8192 x 32 x 128), every mode's outputs and final states compared word for word
# (`--kda-io` writes them: modes 0 1 3 2 1p 3p 2p; the base's
# binary may lack some), then both binaries' KDA timings. For a change
# that must not move a bit (session 39: the BF16 mode's operands handed over in BF16).
. "$(dirname "$0")/env.sh"
T=${T:-8192} H=${H:-32} D=${D:-128}
base=/tmp/kda_words/base new=/tmp/kda_words/new
mkdir -p "$base" "$new"
# FLA's inputs and their float64 reference where torch imports (fla_kda_bench.py gen: its shape,
# 8192 x 32 x 128; each mode's error is then printed), else numpy's
ref=0
[ "$T.$H.$D" = 8192.32.128 ] && python3 tools/device/fla_kda_bench.py gen "$base" >/dev/null 2>&1 && ref=1
[ $ref = 1 ] || python3 - "$base" "$T" "$H" "$D" <<'PY'
import sys, numpy as np
d, T, H, D = sys.argv[1], *map(int, sys.argv[2:])
r = np.random.default_rng(39)
def unit(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
q = unit(r.standard_normal((T, H, D))) / np.sqrt(D)
k = unit(r.standard_normal((T, H, D)))
v = r.uniform(-1, 1, (T, H, D))
g = r.uniform(-0.7, 0, (T, H, D))
beta = r.uniform(0, 1, (T, H))
s0 = r.uniform(-0.5, 0.5, (H, D, D))
for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0).items():
    x.astype(np.float32).tofile(f"{d}/{n}.f32")
PY
cp "$base"/* "$new"/
.devbin/test_cuda_kernels_base --kda-io "$base" "$T" "$H" "$D" | tail -1
.devbin/test_cuda_kernels --kda-io "$new" "$T" "$H" "$D" | tail -1
for f in "$new"/out_*.f32 "$new"/state_*.f32; do
  n=$(basename "$f")
  if [ ! -f "$base/$n" ]; then echo "words: $n (not in the base)"
  elif cmp -s "$f" "$base/$n"; then echo "words: $n same"; else echo "words: $n DIFFER"; fi
done | tee "$OUT/kda_words.log"
# each mode's error against the float64 reference (FLA's own lines fail without its wheels)
[ $ref = 1 ] && python3 tools/device/fla_kda_bench.py score "$new" 2>/dev/null |
  grep deltaserve | tee -a "$OUT/kda_words.log"
for b in test_cuda_kernels_base test_cuda_kernels; do
  .devbin/$b --bench-only kda 2>&1 | grep -E "bench kda chunked (prefill|varlen)" | sed "s/^/[$b] /"
done | tee -a "$OUT/kda_words.log"
