/* kda_conv.cu — KDA's inputs: the causal short convolution (+ SiLU) over q, k and v, and the
 * decay gates and beta. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kda.cuh"

/* ---- KDA inputs: short conv, gates, head norms ------------------------------------------------
 */

/* One thread per channel walks the tokens in order with its window of the last W inputs in
 * registers (W <= 8), then writes the new tail. */
__global__ void short_conv_silu_k(float *out, const float *in, int T, int C, const float *w, int W,
                                  float *tail) {
    PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[8]; /* win[j]: input at position t - (W-1) + j */
    for (int j = 0; j < W - 1; j++) win[j] = tail[(size_t)j * C + c];
    const float *wc = w + (size_t)c * W;
    for (int t = 0; t < T; t++) {
        win[W - 1] = in[(size_t)t * C + c];
        float acc = 0.0f;
        for (int j = 0; j < W; j++) acc += wc[j] * win[j];
        out[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
        for (int j = 0; j < W - 1; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < W - 1; j++) tail[(size_t)j * C + c] = win[j];
}

/* Every sequence of a step, and q, k and v together, in one launch: block (channel tile, sequence
 * z, projection j and time chunk) walks its chunk of tokens [seg_off[z], seg_off[z+1]) of
 * projection j (see ds_cu_conv_batch); with rollback rows it also writes the tail after each
 * token. A chunk's window starts from the inputs before it, so long prefills run in parallel over
 * time; chunks are at least W-1 tokens, so only chunk 0 ever reads the old tail, and chunk 0
 * writes the new one after its own reads.
 * WT: the kernel width when known at compile time (0: b.W at run time). With a run-time width the
 * window is indexed at run time and lives in local memory (ptxas: a 32-byte stack frame), and each
 * token's input load waits behind the previous token's store; with WT the window is registers and
 * the inputs of CONV_AHEAD tokens are loaded before any of them is used (the model's default;
 * DS_CUDA_CONV_FIXED=0 gives the run-time form, measured slower at prefill and no faster at
 * decode: bench/RESULTS.md session 10). The same operations in the same order either way. */
enum { CONV_AHEAD = 4 };
template <int WT> __global__ void short_conv_batch_k(ds_cu_conv_batch b, int n_chunks) {
    PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, z = blockIdx.y;
    const int j = blockIdx.z % b.n_proj, ch = blockIdx.z / b.n_proj;
    const int C = b.C, W = WT ? WT : b.W;
    if (c >= C) return;
    const int t0 = b.seg_off[z], t1 = b.seg_off[z + 1];
    const int per = max((t1 - t0 + n_chunks - 1) / n_chunks, W - 1);
    const int a0 = t0 + ch * per, a1 = min(t1, a0 + per);
    if (ch > 0 && a0 >= a1) return;        /* chunk 0 runs even on no tokens: it owns the tail */
    const size_t tn = (size_t)(W - 1) * C; /* one projection's tail */
    float *tail = b.tails[z] + j * tn, *R = b.rows && b.rows[z] ? b.rows[z] + j * tn : NULL;
    const float *in = b.in + (size_t)j * C;
    float *out = b.out + j * b.out_stride;
    constexpr int WM = WT ? WT : 8; /* the window's size as the compiler sees it */
    float win[WM];                  /* win[i]: the input at position t - (W-1) + i */
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        const int p = a0 - (W - 1) + i; /* before the segment: the tail (tail[i] is t0-(W-1)+i) */
        win[i] = p >= t0 ? in[(size_t)p * b.ld_in + c] : tail[(size_t)(p - t0 + W - 1) * C + c];
    }
    float wc[WM];
#pragma unroll
    for (int i = 0; i < WM; i++)
        if (WT || i < W) wc[i] = b.w[((size_t)j * C + c) * W + i];
    constexpr int AHEAD = WT ? CONV_AHEAD : 1;
    for (int ta = a0; ta < a1; ta += AHEAD) {
        float nx[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; u++)
            nx[u] = ta + u < a1 ? in[(size_t)(ta + u) * b.ld_in + c] : 0.0f;
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            const int t = ta + u;
            if (t >= a1) break;
            win[W - 1] = nx[u];
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < WM; i++)
                if (WT || i < W) acc += wc[i] * win[i];
            out[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
#pragma unroll
            for (int i = 0; i < WM - 1; i++)
                if (WT || i < W - 1) win[i] = win[i + 1];
            if (R)
#pragma unroll
                for (int i = 0; i < WM - 1; i++)
                    if (WT || i < W - 1)
                        R[(size_t)(t - t0) * b.rows_stride + (size_t)i * C + c] = win[i];
        }
    }
    if (ch > 0) return;
    float nt[WM]; /* the new tail: the inputs at t1 - (W-1) + i, read before any is written */
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        const int p = t1 - (W - 1) + i;
        nt[i] = p >= t0 ? in[(size_t)p * b.ld_in + c] : tail[(size_t)(p - t0 + W - 1) * C + c];
    }
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        tail[(size_t)i * C + c] = nt[i];
    }
}

extern "C" int ds_cu_short_conv_silu_batch(ds_cu *c, const ds_cu_conv_batch *b, ds_err *err) {
    if (b->W < 1 || b->W > 8) return ds_errf(err, "cuda: short conv kernel size %d (1..8)", b->W);
    if (b->n_proj < 1 || b->n_proj > 3)
        return ds_errf(err, "cuda: short conv: %d projections (1..3)", b->n_proj);
    if (b->n_seq <= 0 || b->C <= 0) return DS_OK;
    /* time chunks of ~64 tokens of the longest segment, at most 256 — bounded by T - n_seq + 1,
     * every other segment having a token (an empty one only costs parallelism, never a result:
     * any count of chunks gives the same bits). From T alone a decode step of 256 sequences
     * launched four blocks for every one with work, several times slower a layer (eager
     * profile, "kda conv+l2norm": bench/RESULTS.md session 18). */
    const int longest = DS_MAX(1, b->n_tokens - b->n_seq + 1);
    const int n_chunks = DS_MAX(1, DS_MIN(256, longest / 64));
    launch_k(
        c, c->conv_fixed && b->W == 4 ? short_conv_batch_k<4> : short_conv_batch_k<0>,
        dim3((unsigned)((b->C + 127) / 128), (unsigned)b->n_seq, (unsigned)(b->n_proj * n_chunks)),
        128, 0, *b, n_chunks);
    CU_TRY(cudaGetLastError(), "short conv (batch)");
    return DS_OK;
}

extern "C" int ds_cu_short_conv_silu(ds_cu *c, float *out, const float *in, int T, int C,
                                     const float *w, int W, float *tail, ds_err *err) {
    if (W < 1 || W > 8) return ds_errf(err, "cuda: short conv kernel size %d (1..8)", W);
    if (T <= 0 || C <= 0) return DS_OK;
    launch_k(c, short_conv_silu_k, (C + 127) / 128, 128, 0, out, in, T, C, w, W, tail);
    CU_TRY(cudaGetLastError(), "short conv");
    return DS_OK;
}

/* thread x of the grid takes column hc = x of every row t = blockIdx.y (+ gridDim.y ...): no
 * division an element */
__global__ void kda_gate_k(float *g, const float *f, int T, int H, int dk, const float *A_log,
                           const float *dt_bias, int lower_bound_form, float lb, float *beta,
                           const float *b_in, int ld_b) {
    const int P = H * dk, hc = blockIdx.x * blockDim.x + threadIdx.x, h = hc / dk;
    /* the layer's parameters before the wait for the previous kernel (they are weights) */
    const bool live = hc < P;
    const float a_log = live ? A_log[h] : 0.0f, bias = live ? dt_bias[hc] : 0.0f;
    PDL_ENTRY();
    if (!live) return;
    const float a = expf(a_log);
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        if (beta && hc < H) /* as ds_cu_sigmoid: the same bits */
            beta[(size_t)t * H + hc] = 1.0f / (1.0f + expf(-b_in[(size_t)t * ld_b + hc]));
        const size_t i = (size_t)t * P + hc;
        g[i] = kda_decay(f[i] + bias, a, lower_bound_form, lb);
    }
}

extern "C" void ds_cu_kda_gate(ds_cu *c, float *g, const float *f, int T, int H, int dk,
                               const float *A_log, const float *dt_bias, int lower_bound_form,
                               float lb, float *beta, const float *b_in, int ld_b) {
    const int P = H * dk;
    if (T <= 0 || P <= 0) return;
    launch_k(c, kda_gate_k, dim3((unsigned)((P + 255) / 256), (unsigned)DS_MIN(T, 65535)), 256, 0,
             g, f, T, H, dk, A_log, dt_bias, lower_bound_form, lb, beta, b_in, ld_b);
    note_launch(c);
}

extern "C" void ds_cu_set_conv_fixed(ds_cu *c, int on) {
    c->conv_fixed = on;
}
