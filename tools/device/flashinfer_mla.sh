#!/usr/bin/env bash
# On the GPU machine, with .devbin and .whl-fi carried: issue 33's peer for decode's absorbed MLA —
# FlashInfer's MLA decode (tools/device/flashinfer_mla_bench.py) and ours (`test_cuda_kernels
# --bench-only mla`, BF16 rows) on one query token over 32K, 128K and 1M context rows, in one call.
# The wheels are fetched here first (the GPU machine has no network), ~22 MB:
#   tools/device/fetch_flashinfer.sh
# FlashInfer compiles its kernels with the machine's nvcc at their first use (a minute or more).
. "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-fi .whl-fi/*.whl || exit 1
PYTHONPATH=/tmp/site-fi timeout 400 python3 tools/device/flashinfer_mla_bench.py "$@" 2>&1 |
  grep -v Warning | tail -12
for n in 32768 131072 1048576; do
  DS_BENCH_MLA_LONG="bf16 $n" timeout 120 .devbin/test_cuda_kernels --bench-only mla 2>&1 |
    grep -E "copy d2d|absorbed decode 1 x $n rows, Ha=32, bf16 rows \(tensor cores, warp-specialized(, graph of [0-9]+)?\)"
done
