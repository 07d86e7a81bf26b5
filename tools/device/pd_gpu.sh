#!/usr/bin/env bash
# On the GPU machine, with .devbin carried (tools/device/pack_devbin.sh packs ucx_perftest and UCX's
# CMA module with it) and the bundled model in the tree (no wheels: the tree travels within 64 MiB):
# issue 36's figures with both servers' pools on the GPU, in one call (~4 min).
#   1. a 32K-token prompt's state pulled from a producer to a consumer (bench/pd_xfer_bench.py):
#      GPU pools -> the producer's host buffer -> the wire -> the consumer's RAM tier -> its GPU
#      pools, the pull's rate against ucx_perftest's on the same machine;
#   2. the time to first token through the pair against one server (bench/pd_bench.py, TTFT part;
#      prompts of 500 and 2000 tokens: gsm-k3 serves 2048).
# Both servers share the one GPU (each its own --kv-cache-memory).
. "$(dirname "$0")/env.sh"
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MODEL=${MODEL:-models/gsm-k3}
[ -f "$MODEL/config.json" ] || { echo "no $MODEL in the tree (light_tree.sh back before the call)"; exit 1; }
command -v ucx_perftest >/dev/null || echo "no ucx_perftest: pack_devbin.sh packs it where ucx-utils is installed"
el "1. 32K-token transfer, both servers on the GPU"
timeout 300 python3 bench/pd_xfer_bench.py --bin .devbin/deltaserve --model "$MODEL" \
  --tokens ${TOKENS:-32768} --reps ${REPS:-2} \
  --extra "--device cuda --kv-cache-memory 4G --kv-offload-ram 2G" > "$OUT/pd_xfer_gpu.txt" 2>&1
echo "rc $?"; grep -E "^pull|^ucx_perftest|^\|" "$OUT/pd_xfer_gpu.txt" | tail -10
el "2. TTFT through the pair against one server, on the GPU"
timeout 240 python3 bench/pd_bench.py --bin .devbin/deltaserve --model "$MODEL" --skip mixed \
  --lengths ${LENGTHS:-500,2000} --reps 2 --extra "--device cuda --kv-cache-memory 2G" \
  > "$OUT/pd_ttft_gpu.txt" 2>&1
echo "rc $?"; tail -12 "$OUT/pd_ttft_gpu.txt"
el end
