#!/usr/bin/env bash
# Here, before a call of tools/device/flashinfer_mla.sh: FlashInfer's wheel (0.5.3: its later
# wheels carry prebuilt kernels past the 64 MiB a call may carry) and the needs its import has that
# the GPU machine's image lacks, into .whl-fi (ignored; carry it). The image has torch, numpy,
# ninja, requests, tqdm, packaging and click.
set -euo pipefail
cd "$(dirname "$0")/../.."
P=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_28_x86_64)
mkdir -p .whl-fi
for pk in flashinfer-python==0.5.3 "apache-tvm-ffi>=0.1,<0.2" "nvidia-cudnn-frontend>=1.13.0" \
          nvidia-ml-py tabulate einops; do
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version 3.12 "${P[@]}" -d .whl-fi "$pk"
done
du -sh .whl-fi
