#!/usr/bin/env bash
# Builds the CUDA backend's kernels and their check/bench program (issue 9) into BUILD_DIR:
#   tools/cuda_build.sh [BUILD_DIR]      (default build-cuda; `make cuda` runs it)
#   NVCC_EXTRA="-D..." adds nvcc flags (pack_devbin.sh's timing build)
# nvcc compiles src/kernels/cuda/*.cu for sm_90a (Hopper's own instructions) plus PTX that the
# driver can compile for other parts; gcc compiles the CPU kernels the checks compare against.
# Needs only the CUDA toolkit (nvcc, cuBLAS) and gcc with OpenMP: it runs the same here (no GPU:
# compile and link only) and on the GPU machine (tools/device/cuda_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-cuda}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "cuda_build: nvcc not found (install the CUDA toolkit or set NVCC)" >&2; exit 2; }
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
mkdir -p "$OUT/obj"
CFLAGS="-O2 -std=gnu11 -fopenmp -Wall -Wextra -Wno-unused-parameter -fno-strict-aliasing -Isrc -I$CUDA_HOME/include"
"$NVCC" -O3 -std=c++17 -Isrc -Xcompiler -Wall ${NVCC_EXTRA:-} \
  -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80 \
  -Xptxas -v -c src/kernels/cuda/kernels.cu -o "$OUT/obj/cuda_kernels.o" 2> "$OUT/ptxas.txt" \
  || { cat "$OUT/ptxas.txt" >&2; exit 1; }
objs=("$OUT/obj/cuda_kernels.o")
for f in src/base/base.c src/kernels/cpu/*.c tests/cuda/test_cuda_kernels.c; do
  o="$OUT/obj/$(basename "$f" .c).o"
  gcc $CFLAGS -c "$f" -o "$o"
  objs+=("$o")
done
gcc -fopenmp "${objs[@]}" -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcublas -lcudart -lstdc++ -lm \
  -o "$OUT/test_cuda_kernels"
echo "cuda_build: $OUT/test_cuda_kernels (registers and spills per kernel: $OUT/ptxas.txt)"
