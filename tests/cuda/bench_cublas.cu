/* bench_cublas — what cuBLAS gives for the engine's GEMM shapes on this GPU (run on the GPU
 * machine; not a test): BF16 inputs with F32 or BF16 outputs, one GEMM or strided-batched over
 * experts. The forward's GEMMs are compared against these rates when choosing a path. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>

/* BF16 values uniform in [-1, 1) from a hash of the index: tensor cores on zeros run cooler
 * (and faster) than on the forward's data. */
__global__ void fill_k(__nv_bfloat16 *d, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 15, x *= 2246822519u, x ^= x >> 13;
        d[i] = __float2bfloat16((float)(x >> 8) / 8388608.0f - 1.0f);
    }
}

static double time_ms(cublasHandle_t h, cudaStream_t s, int m, int n, int k, int batch,
                      cudaDataType ct, void *A, void *B, void *C) {
    const float one = 1.0f, zero = 0.0f;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best = 1e30f;
    for (int it = 0; it < 6; it++) {
        cudaEventRecord(e0, s);
        cublasStatus_t st;
        if (batch == 1)
            st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16BF, k, B,
                              CUDA_R_16BF, k, &zero, C, ct, m, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT);
        else
            st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A,
                                            CUDA_R_16BF, k, (long long)m * k, B, CUDA_R_16BF, k,
                                            (long long)n * k, &zero, C, ct, m, (long long)m * n,
                                            batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        if (st != CUBLAS_STATUS_SUCCESS) return -1;
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (it > 0 && ms < best) best = ms;
    }
    return best;
}

int main(void) {
    cublasHandle_t h;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cublasCreate(&h);
    cublasSetStream(h, s);
    void *ws;
    cudaMalloc(&ws, 32 << 20);
    cublasSetWorkspace(h, ws, 32 << 20);
    struct {
        const char *what;
        int m, n, k, batch;
    } cases[] = {
        {"kda qkv 8192 tokens", 12288, 8192, 2304, 1},
        {"kda o_proj 8192 tokens", 2304, 8192, 4096, 1},
        {"square 8192", 8192, 8192, 8192, 1},
        {"experts gate/up, 256 x 312 rows", 2048, 312, 2304, 256},
        {"experts down, 256 x 312 rows", 2304, 312, 1024, 256},
        {"one expert gate/up, 312 rows", 2048, 312, 2304, 1},
        {"experts gate/up, 256 x 320 rows", 2048, 320, 2304, 256},
        {"experts down, 256 x 320 rows", 2304, 320, 1024, 256},
    };
    for (auto &c : cases) {
        size_t na = (size_t)c.m * c.k * c.batch, nb = (size_t)c.n * c.k * c.batch,
               nc = (size_t)c.m * c.n * c.batch;
        void *A, *B, *C;
        if (cudaMalloc(&A, na * 2) || cudaMalloc(&B, nb * 2) || cudaMalloc(&C, nc * 4)) return 1;
        fill_k<<<1024, 256>>>((__nv_bfloat16 *)A, na, 1u);
        fill_k<<<1024, 256>>>((__nv_bfloat16 *)B, nb, 2u);
        double f = 2.0 * c.m * c.n * (double)c.k * c.batch;
        double t32 = time_ms(h, s, c.m, c.n, c.k, c.batch, CUDA_R_32F, A, B, C);
        double t16 = time_ms(h, s, c.m, c.n, c.k, c.batch, CUDA_R_16BF, A, B, C);
        printf("%-34s f32 out %8.3f ms %6.0f TFLOP/s | bf16 out %8.3f ms %6.0f TFLOP/s\n", c.what,
               t32, f / t32 / 1e9, t16, f / t16 / 1e9);
        cudaFree(A), cudaFree(B), cudaFree(C);
    }
    return 0;
}
