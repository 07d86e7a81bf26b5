#!/usr/bin/env bash
# On the GPU machine, with .devbin carried: each kernel of an eager batch-1 decode step at the
# shape of Kimi-Linear-48B-A3B (random weights) timed alone by Nsight Compute (no launch gaps:
# what the kernels themselves take), summed per kernel name, with the DRAM bytes they read.
# Needs a machine whose runtime lets ncu read the counters (KINDS.md). Output: $OUT/ncu.txt.
#   KERNELS=regex of kernel names  COUNT=launches profiled (default 1300: two steps)
#   tools/device/ncu48.sh [bench options, e.g. -q ptpc_fp8]    NAME=file stem (default ncu)
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
# prompts of one token, so that every step profiled is a batch-1 step; the weight fills (random
# weights) are left out by name, so COUNT launches are about one step per 650
K=${KERNELS:-gemv|moe_|mla_|kda_|norm|conv|embed|argmax|sigmoid|add_k|mul_k|move_rows|copy|ptpc_act|f8m|fp8_scale|fp8_any}
N=${NAME:-ncu}
timeout 400 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  --kernel-name-base function -k "regex:$K" --launch-count "${COUNT:-1300}" \
  --csv --page raw .devbin/deltaserve bench --model $SHAPE48 --load-format random \
  --device cuda --enforce-eager --prompt-tokens 1 --reps 1 --decode-context 1 --decode-steps 2 \
  --batch-sizes 1 "$@" > "$OUT/$N.csv" 2> "$OUT/$N.err"
echo "ncu rc $?"
python3 - "$OUT/$N.csv" <<'PY' | tee "$OUT/$N.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]; data = rows[hdr + 2:]
ki, ti, bi = h.index("Kernel Name"), h.index("gpu__time_duration.sum"), h.index("dram__bytes_read.sum")
t = collections.defaultdict(float); b = collections.defaultdict(float); n = collections.Counter()
for r in data:
    try:
        t[r[ki]] += float(r[ti].replace(",", "")); b[r[ki]] += float(r[bi].replace(",", "")); n[r[ki]] += 1
    except (ValueError, IndexError):
        pass
tot = sum(t.values())
print(f"{len(data)} kernels, {tot/1e3:.1f} us of kernel time (units as ncu gives: ns, bytes)")
for k in sorted(t, key=t.get, reverse=True)[:30]:
    print(f"{t[k]/1e3:10.1f} us {n[k]:5d} calls {t[k]/n[k]/1e3:8.2f} us/call {b[k]/max(t[k],1):8.1f} GB/s  {k[:90]}")
PY
