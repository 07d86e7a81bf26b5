#!/usr/bin/env bash
# Here, before a device call: builds build-cuda (the whole engine with the CUDA backend) and packs
# what the GPU machine runs into .devbin/bin.tar.xz (carry it: `carry [".devbin"]`; the device
# scripts unpack it through tools/device/env.sh): the binaries, and the
# shared libraries its image lacks (libmicrohttpd, libhiredis, libcmocka, and UCX's for the P/D
# transfer, docs/pd.md; it has the rest, and a newer glibc than Debian 12's, so binaries built here
# run there).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
# DS_DEVBIN_BUILD: pack another CUDA build folder (e.g. a baseline commit's), as it is
BC=${DS_DEVBIN_BUILD:-build-cuda}
if [ -z "${DS_DEVBIN_BUILD:-}" ]; then
  cmake -S . -B build-cuda -DDS_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
  cmake --build build-cuda -j "$(nproc)"
fi
rm -rf .devbin && mkdir -p .devbin/lib
cp "$BC/deltaserve" "$BC/test_cuda_kernels" "$BC/bench_cublas" "$BC/bench_f8cvt" .devbin/
# DS_DEVBIN_BASE: a baseline's deltaserve (e.g. a worktree's build of an earlier commit), carried
# as deltaserve_base, so that one call times both on the same machine
[ -n "${DS_DEVBIN_BASE:-}" ] && cp "$DS_DEVBIN_BASE" .devbin/deltaserve_base
# DS_DEVBIN_BASE_TESTS: a baseline's test_cuda_kernels, carried as test_cuda_kernels_base
# (tools/device/kda_words.sh compares the two word for word)
[ -n "${DS_DEVBIN_BASE_TESTS:-}" ] && cp "$DS_DEVBIN_BASE_TESTS" .devbin/test_cuda_kernels_base
# DS_DEVBIN_MID_TESTS: a second baseline's test_cuda_kernels (e.g. an intermediate commit's), carried
# as test_cuda_kernels_mid (pending_checks.sh step 24 times it beside the others)
[ -n "${DS_DEVBIN_MID_TESTS:-}" ] && cp "$DS_DEVBIN_MID_TESTS" .devbin/test_cuda_kernels_mid
# DS_DEVBIN_TESTS: the engine's test binaries to carry (set but empty: none, for a call whose tree
# must leave room for other things, e.g. the FLA wheels of kda_vs_fla.sh)
for t in ${DS_DEVBIN_TESTS-test_model_forward test_model_pipeline test_model_draft test_model_quant test_engine_prefix test_engine_engine test_engine_regress}; do
  cp "$BC/$t" .devbin/
done
# DS_DEVBIN_CLOCKS=1: also test_cuda_kernels_clk, whose chunked KDA first pass counts the cycles
# of each phase (`--bench-only kda` prints the shares), and so does the warp-specialized MLA
# decode kernel (`--bench-only mla` with DS_BENCH_MLA_LONG)
if [ "${DS_DEVBIN_CLOCKS:-0}" = 1 ]; then
  NVCC_EXTRA="-DDS_KDA_PREP_CLOCKS -DDS_MLA_TCW_CLOCKS" tools/cuda_build.sh build-cuda-clk >/dev/null
  cp build-cuda-clk/test_cuda_kernels .devbin/test_cuda_kernels_clk
fi
# DS_DEVBIN_F8BITS=1: also test_cuda_kernels_f8bits and deltaserve_f8bits, built with
# -DDS_CUDA_F8_BITS (FP8 codes to F16 by bits instead of the conversion unit: fp8_stream.cuh)
if [ "${DS_DEVBIN_F8BITS:-0}" = 1 ]; then
  TARGETS="test_cuda_kernels deltaserve" NVCC_EXTRA=-DDS_CUDA_F8_BITS \
    tools/cuda_build.sh build-cuda-f8bits >/dev/null
  cp build-cuda-f8bits/test_cuda_kernels .devbin/test_cuda_kernels_f8bits
  cp build-cuda-f8bits/deltaserve .devbin/deltaserve_f8bits
fi
# DS_DEVBIN_F8MMA=1: also test_cuda_kernels_f8mma and deltaserve_f8mma, built with
# -DDS_CUDA_F8_MMA (the FP8 weight streams on E4M3 tensor cores, no conversion: fp8_stream.cuh)
if [ "${DS_DEVBIN_F8MMA:-0}" = 1 ]; then
  TARGETS="test_cuda_kernels deltaserve" NVCC_EXTRA=-DDS_CUDA_F8_MMA \
    tools/cuda_build.sh build-cuda-f8mma >/dev/null
  cp build-cuda-f8mma/test_cuda_kernels .devbin/test_cuda_kernels_f8mma
  cp build-cuda-f8mma/deltaserve .devbin/deltaserve_f8mma
fi
# DS_DEVBIN_MINI=1: deltaserve, test_cuda_kernels and the libraries they need alone (~8.4 MB), for
# a call that carries the bundled model (tools/device/logits_env.sh, light_tree.sh slim)
if [ "${DS_DEVBIN_MINI:-0}" = 1 ]; then
  rm -f .devbin/bench_cublas .devbin/bench_f8cvt .devbin/test_model_* .devbin/test_engine_*
fi
for l in libmicrohttpd.so.12 libhiredis.so.0.14 libcmocka.so.0 libucp.so.0 libuct.so.0 libucs.so.0 \
         libucm.so.0 libnuma.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" .devbin/lib/
done
# UCX's CMA module (shared-memory transfers between two processes; loaded from UCX_MODULE_DIR, which
# env.sh points here) and ucx_perftest, for the P/D transfer's figures (tools/device/pd_gpu.sh)
if [ "${DS_DEVBIN_MINI:-0}" != 1 ] && [ -f /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 ]; then
  mkdir -p .devbin/lib/ucx
  cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 .devbin/lib/ucx/libuct_cma.so
fi
[ "${DS_DEVBIN_MINI:-0}" != 1 ] && [ -x /usr/bin/ucx_perftest ] && cp /usr/bin/ucx_perftest .devbin/
# CUPTI, for DS_CUDA_TIMELINE (tools/device/timeline48.sh: the machines have no Nsight Systems)
CUPTI=$(ls "$(dirname "$NVCC")"/../lib*/libcupti.so.* /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.* \
  2>/dev/null | head -1 || true)
[ "${DS_DEVBIN_MINI:-0}" != 1 ] && [ -n "$CUPTI" ] && cp -L "$CUPTI" .devbin/lib/
strip .devbin/* 2>/dev/null || true
# the commit the binaries are built from, for tools/bench_latest.py's stamps ("+" when the tree
# had uncommitted changes)
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests CMakeLists.txt || echo +)" \
  > .devbin/COMMIT
# packed (the working tree and what is carried travel within 64 MiB): the device scripts unpack it
(cd .devbin && tar cJf bin.tar.xz --remove-files -- *[!z])
du -sh .devbin
