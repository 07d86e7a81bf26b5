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

/* The best of five timed calls of call() (a cublasStatus_t) on stream s after one warm-up, in ms;
 * -1 if a call fails. */
template <typename F> static double best_ms(cudaStream_t s, F call) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best = 1e30f;
    for (int it = 0; it < 6; it++) {
        cudaEventRecord(e0, s);
        const cublasStatus_t st = call();
        cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        if (st != CUBLAS_STATUS_SUCCESS) return -1;
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (it > 0 && ms < best) best = ms;
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return best;
}

static double time_ms(cublasHandle_t h, cudaStream_t s, int m, int n, int k, int batch,
                      cudaDataType ct, void *A, void *B, void *C) {
    const float one = 1.0f, zero = 0.0f;
    return best_ms(s, [&] {
        if (batch == 1)
            return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16BF, k, B,
                                CUDA_R_16BF, k, &zero, C, ct, m, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT);
        return cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A,
                                          CUDA_R_16BF, k, (long long)m * k, B, CUDA_R_16BF, k,
                                          (long long)n * k, &zero, C, ct, m, (long long)m * n,
                                          batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
}

/* E experts' GEMMs C_e [n_e][m] = B_e [n_e][k] A_e [m][k]^T (BF16 in, BF16 out) through pointer
 * arrays: grouped = 1: one cublasGemmGroupedBatchedEx call, a group a distinct n_e (the experts
 * sorted by count); 0: one cublasGemmBatchedEx call with every expert padded to the largest n_e.
 * Returns the best of five timed calls in ms (-1 on an error). */
static double time_experts(cublasHandle_t h, cudaStream_t s, int m, int k, int E, const int *cnt,
                           int grouped) {
    int nmax = 0;
    size_t rows = 0;
    for (int e = 0; e < E; e++) nmax = cnt[e] > nmax ? cnt[e] : nmax, rows += cnt[e];
    const size_t brows = grouped ? rows : (size_t)nmax * E; /* B's and C's rows, all panels */
    void *A, *B, *C, **dp;
    if (cudaMalloc(&A, (size_t)E * m * k * 2) || cudaMalloc(&B, brows * k * 2) ||
        cudaMalloc(&C, brows * m * 2) || cudaMalloc(&dp, (size_t)3 * E * sizeof(void *)))
        return -1;
    fill_k<<<1024, 256>>>((__nv_bfloat16 *)A, (size_t)E * m * k, 1u);
    fill_k<<<1024, 256>>>((__nv_bfloat16 *)B, brows * k, 2u);
    /* experts by count, largest first (an insertion sort: E is small) */
    int *order = (int *)malloc((size_t)E * sizeof(int));
    for (int e = 0; e < E; e++) {
        int i = e;
        while (i > 0 && cnt[order[i - 1]] < cnt[e]) order[i] = order[i - 1], i--;
        order[i] = e;
    }
    void **hp = (void **)malloc((size_t)3 * E * sizeof(void *));
    size_t r = 0;
    for (int i = 0; i < E; i++) {
        const int e = order[i];
        hp[i] = (char *)A + (size_t)e * m * k * 2;
        hp[E + i] = (char *)B + r * k * 2;
        hp[2 * E + i] = (char *)C + r * m * 2;
        r += grouped ? (size_t)cnt[e] : (size_t)nmax;
    }
    cudaMemcpy(dp, hp, (size_t)3 * E * sizeof(void *), cudaMemcpyHostToDevice);
    int ng = 0, *gn = (int *)malloc((size_t)E * 8 * sizeof(int)), *gs = gn + E, *gm = gn + 2 * E,
        *gk = gn + 3 * E;
    /* (gk: K, also A's and B's leading dimension; gm: m, also C's) */
    float *al = (float *)(gn + 4 * E), *be = (float *)(gn + 5 * E);
    cublasOperation_t *ta = (cublasOperation_t *)(gn + 6 * E), *tb = ta + E;
    for (int i = 0; i < E; i++) {
        if (!ng || cnt[order[i]] != gn[ng - 1]) gn[ng] = cnt[order[i]], gs[ng++] = 0;
        gs[ng - 1]++;
    }
    for (int g = 0; g < ng; g++)
        gm[g] = m, gk[g] = k, al[g] = 1.0f, be[g] = 0.0f, ta[g] = CUBLAS_OP_T, tb[g] = CUBLAS_OP_N;
    const float one = 1.0f, zero = 0.0f;
    const double best = best_ms(s, [&] {
        if (grouped)
            return cublasGemmGroupedBatchedEx(h, ta, tb, gm, gn, gk, al, (const void *const *)dp,
                                              CUDA_R_16BF, gk, (const void *const *)(dp + E),
                                              CUDA_R_16BF, gk, be, dp + 2 * E, CUDA_R_16BF, gm, ng,
                                              gs, CUBLAS_COMPUTE_32F);
        return cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, nmax, k, &one,
                                   (const void *const *)dp, CUDA_R_16BF, k,
                                   (const void *const *)(dp + E), CUDA_R_16BF, k, &zero, dp + 2 * E,
                                   CUDA_R_16BF, m, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(dp);
    free(order), free(hp), free(gn);
    return best;
}

/* The 48B shape's routed experts (256 of 2304 x 1024) both ways: even counts (8192 tokens x 8 =
 * 65,536 rows, 256 each) and skewed ones (128 to 510 rows, spread evenly, 81,664 in all). */
static void bench_experts(cublasHandle_t h, cudaStream_t s) {
    enum { E = 256 };
    int even[E], skew[E];
    for (int e = 0; e < E; e++) even[e] = 256, skew[e] = 128 + (e * 97 % E) * 384 / E;
    const struct {
        const char *what;
        int m, k;
    } pass[] = {{"gate/up", 2048, 2304}, {"down", 2304, 1024}};
    for (auto &p : pass)
        for (int sk = 0; sk < 2; sk++) {
            const int *cnt = sk ? skew : even;
            double rows = 0;
            for (int e = 0; e < E; e++) rows += cnt[e];
            const double f = 2.0 * rows * p.m * p.k;
            const double tb = time_experts(h, s, p.m, p.k, E, cnt, 0);
            const double tg = time_experts(h, s, p.m, p.k, E, cnt, 1);
            printf("experts %-7s %s counts: batched (padded) %7.3f ms %5.0f TFLOP/s | grouped "
                   "(exact) %7.3f ms %5.0f TFLOP/s (routed rows' FLOPs)\n",
                   p.what, sk ? "skewed" : "even  ", tb, f / tb / 1e9, tg, f / tg / 1e9);
        }
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
    bench_experts(h, s);
    return 0;
}
