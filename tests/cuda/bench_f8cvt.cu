/* bench_f8cvt — can a GPU turn FP8 (E4M3) codes into F16 as fast as it reads them? (run on the
 * GPU machine; not a test). The FP8 weight-streaming kernels (src/kernels/cuda/fp8_stream.cuh)
 * reach well under half of BF16's bytes per second at decode (bench/RESULTS.md, session 28), in
 * two layouts that share little but the conversion of every code; this times that step alone.
 * Each kernel streams the same 1 GiB of codes once, 16 bytes a thread a load with 4 loads in
 * flight, and folds what it makes into one word a thread (so nothing is optimized away):
 *   read   the codes' words XORed (the rate of reading alone)
 *   cvt    every pair converted by the conversion unit (cvt.rn.f16x2.e4m3x2), the halves summed
 *   bits   every pair converted by bit operations and one multiply (f8x2_f16_bits, the
 *          -DDS_CUDA_F8_BITS form: the same F16 values), the halves summed
 *   cvt32  cvt, then each half to f32 (what a CUDA-core FP8 kernel would do), summed in f32
 * and checks that cvt and bits give the same F16 values for every code but the two NaNs. */
#include "kernels/cuda/fp8_stream.cuh" /* the two forms: f8x2_f16_cvt, f8x2_f16_bits */

#include <stdint.h>
#include <stdio.h>

template <int MODE>
__global__ void __launch_bounds__(256) stream_k(const uint4 *codes, size_t n, uint32_t *out) {
    uint32_t x = 0;
    __half2 acc = __float2half2_rn(0.0f);
    float accf = 0.0f;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
        uint4 u[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            u[k] = i + k * stride < n ? __ldcs(codes + i + k * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const uint32_t w[4] = {u[k].x, u[k].y, u[k].z, u[k].w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                if (MODE == 0) {
                    x ^= w[q];
                } else if (MODE == 3) {
                    const uint32_t a = f8x2_f16_cvt(w[q] & 0xffffu), b = f8x2_f16_cvt(w[q] >> 16);
                    const float2 fa = __half22float2(*(const __half2 *)&a),
                                 fb = __half22float2(*(const __half2 *)&b);
                    accf += fa.x + fa.y + fb.x + fb.y;
                } else {
                    const uint32_t a =
                        MODE == 1 ? f8x2_f16_cvt(w[q] & 0xffffu) : f8x2_f16_bits(w[q] & 0xffffu);
                    const uint32_t b =
                        MODE == 1 ? f8x2_f16_cvt(w[q] >> 16) : f8x2_f16_bits(w[q] >> 16);
                    acc = __hadd2(acc, __hadd2(*(const __half2 *)&a, *(const __half2 *)&b));
                }
            }
        }
    }
    out[blockIdx.x * (size_t)blockDim.x + threadIdx.x] =
        x ^ *(const uint32_t *)&acc ^ __float_as_uint(accf);
}

/* every code pair (a, b) through both forms: the pairs whose F16 bits differ (NaN codes aside) */
__global__ void agree_k(unsigned *bad) {
    const uint32_t a = blockIdx.x, b = threadIdx.x;
    if ((a & 0x7f) == 0x7f || (b & 0x7f) == 0x7f) return;
    const uint32_t w = a | b << 8;
    if (f8x2_f16_cvt(w) != f8x2_f16_bits(w)) atomicAdd(bad, 1u);
}

static const char *const NAMES[4] = {"read", "cvt", "bits", "cvt32"};

int main(void) {
    const size_t bytes = (size_t)1 << 30, n = bytes / 16;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const unsigned grid = 8u * (unsigned)sms;
    uint4 *codes;
    uint32_t *out;
    unsigned *bad;
    if (cudaMalloc(&codes, bytes) != cudaSuccess ||
        cudaMalloc(&out, (size_t)grid * 256 * 4) != cudaSuccess ||
        cudaMalloc(&bad, 4) != cudaSuccess) {
        fprintf(stderr, "bench_f8cvt: no memory on the GPU\n");
        return 1;
    }
    cudaMemset(codes, 0x3b, bytes); /* a normal code (0x3b = 0.859375) in every byte */
    cudaMemset(bad, 0, 4);
    agree_k<<<256, 256>>>(bad);
    unsigned h_bad = 0;
    cudaMemcpy(&h_bad, bad, 4, cudaMemcpyDeviceToHost);
    printf("bench_f8cvt on %s (%d SMs): cvt and bits agree on every code pair: %s (%u differ)\n",
           prop.name, sms, h_bad ? "NO" : "yes", h_bad);
    void (*const kernels[4])(const uint4 *, size_t, uint32_t *) = {stream_k<0>, stream_k<1>,
                                                                   stream_k<2>, stream_k<3>};
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double read_gbs = 0;
    for (int m = 0; m < 4; m++) {
        float best = 1e30f;
        for (int it = 0; it < 8; it++) {
            cudaEventRecord(e0);
            kernels[m]<<<grid, 256>>>(codes, n, out);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (it && ms < best) best = ms; /* the first is a warm-up */
        }
        const double gbs = (double)bytes / (best * 1e-3) / 1e9;
        if (m == 0) read_gbs = gbs;
        printf("bench_f8cvt %-6s %8.3f ms  %7.0f GB/s of codes  %5.1f%% of reading alone\n",
               NAMES[m], best, gbs, 100.0 * gbs / read_gbs);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        fprintf(stderr, "bench_f8cvt: %s\n", cudaGetErrorString(err));
        return 1;
    }
    return h_bad ? 1 : 0;
}
