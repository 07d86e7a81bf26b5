/* kda_chunked.cu — KDA in chunks (prefill): pass 1 builds each chunk's products (the chunk
 * algebra is in kda_chunked.cuh), then passes 2 and 3 (kda_chunk_scan.cu) walk each sequence's
 * chunks and make the outputs; the entry point builds the chunk table and its scratch. */
#include "kernels/cuda/kda.cuh"
#include "kernels/cuda/kda_chunked.cuh"
#include "kernels/cuda/tf32.cuh"

/* Built with -DDS_KDA_PREP_CLOCKS (tools/device/pack_devbin.sh's timing build), pass 1 adds up
 * the cycles its blocks spend in each phase (thread 0's clock between barriers) for
 * ds_cu_kda_prep_clocks; otherwise the marks are nothing. */
#ifdef DS_KDA_PREP_CLOCKS
__device__ unsigned long long g_kda_prep_clk[6];
#define KDA_CLK_START() long long clk_last_ = clock64()
#define KDA_CLK_MARK(k)                                                                            \
    do {                                                                                           \
        if (threadIdx.x == 0) {                                                                    \
            const long long t_ = clock64();                                                        \
            atomicAdd(&g_kda_prep_clk[k], (unsigned long long)(t_ - clk_last_));                   \
            clk_last_ = t_;                                                                        \
        }                                                                                          \
    } while (0)
#define KDA_CLK_SYNC_MARK(k)                                                                       \
    do {                                                                                           \
        __syncthreads();                                                                           \
        KDA_CLK_MARK(k);                                                                           \
    } while (0)
#else
#define KDA_CLK_START()
#define KDA_CLK_MARK(k)
#define KDA_CLK_SYNC_MARK(k)
#endif

extern "C" int ds_cu_kda_prep_clocks(double cycles[6]) {
#ifdef DS_KDA_PREP_CLOCKS
    return take_clocks(g_kda_prep_clk, cycles);
#else
    (void)cycles;
    return -1;
#endif
}

/* Pass 1's shared memory: keys, queries and running log2 decays channel-major (a thread's four
 * rows of one channel are one 16-byte load), rows KPS apart; A (beta_i A_ij) later overlays the
 * queries. */
enum { KPS = KC + 4 };
enum { TLD = 20 }; /* a 16-wide row of the solve's block inverses: fragment loads on 32 banks */
template <int KD> constexpr size_t kda_prep_smem() {
    return ((size_t)3 * KD * KPS + KC + 4 * 16 * TLD) * sizeof(float);
}

/* The 4-row tile pair (ti > tj) of the strictly lower part that thread n < 120 of pass 1 takes
 * (a chunk of 64 rows has 16 tiles: 120 pairs below the diagonal, 16 on it) */
static_assert(KC == 64, "pass 1 maps 120 + 16 tiles of a 64-row chunk onto 256 threads");
__device__ __forceinline__ void kda_tile_pair(int n, int &ti, int &tj) {
    ti = 1;
    while (n >= ti) n -= ti, ti++;
    tj = n;
}

/* Pass 1's tensor-core job jj (0 or 1) of warp w: one of the 12 pieces of 16 x 8 below the
 * diagonal blocks (block pair job / 2, column half job % 2), or 12 for none. Warps 0-2 take one,
 * warps 3-7 two (warp 3 has no tile of its own before them, warps 4-7 the shortest). */
__device__ __forceinline__ int kda_prep_job(int warp, int jj) {
    return warp < 3 ? (jj ? 12 : warp) : 3 + 2 * (warp - 3) + jj;
}

/* Pass 1's solve by 16-row blocks on tensor cores (modes 1 and 3, and 2 in TF32 with W handed
 * over in BF16, B16): X = (I + A)^-1 R for the
 * 2 KD right-hand sides R = [diag(beta) K e^G | diag(beta) V] (-> W, Ut). The forward
 * substitution walks 64 rows one after another (a chain of 2016 dependent FMAs a column); here
 * each diagonal block's inverse T_b = (I + A_bb)^-1 comes first (64 threads, 16-row chains),
 * then block row b is X_b = T_b (R_b - sum_{c<b} A_bc X_c): two products a row of blocks, as
 * mma over all 2 KD columns. R is made in place over the staged keys (channel-major: a column of
 * X is a row of shared memory, which is also the B operand's layout, so every fragment load
 * falls on 32 banks) and V's columns over the decays, which nothing reads any more; X replaces
 * R block by block. A warp takes 2 KD / 8 / 8 tiles of 8 columns through all four rows of blocks,
 * so past the set-up its lanes exchange only their own columns. Ti: [4][16][TLD] the inverses. */
template <int KD, int PREC, bool B16 = false>
__device__ __forceinline__ void kda_solve_blocks(float *Kt, float *Gt, const float *As, float *Ti,
                                                 const float *bs, const float (&x)[KC], float *W,
                                                 float *Ut, int tid) {
    /* R's K columns in place: Kt[c][i] = beta_i k_ic e^{G_ic} (zero past L: beta is) */
    for (int e = tid; e < KD * KC; e += 256) {
        const int c = e / KC, i = e % KC;
        Kt[c * KPS + i] *= bs[i] * exp2f(Gt[c * KPS + i]);
    }
    if (tid < 64) { /* column j of block b's inverse: y_j = 1, y_i = -sum_{j<=k<i} A_ik y_k */
        const int b = tid >> 4, j = tid & 15, r0 = 16 * b;
        float y[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float r = i == j ? 1.0f : 0.0f;
#pragma unroll
            for (int k = 0; k < i; k++) r -= As[(r0 + i) * KPS + r0 + k] * y[k];
            y[i] = i < j ? 0.0f : r;
        }
#pragma unroll
        for (int i = 0; i < 16; i++) Ti[(b * 16 + i) * TLD + j] = y[i];
    }
    __syncthreads();               /* the decays are read for the last time */
    if (tid >= KD && tid < 2 * KD) /* R's V columns: Gt[c][i] = beta_i v_ic */
#pragma unroll
        for (int i = 0; i < KC; i++) Gt[(tid - KD) * KPS + i] = bs[i] * x[i];
    __syncthreads();
    constexpr int NT = 2 * KD / 64; /* 8-column tiles a warp takes (of 2 KD / 8) */
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, l4 = lane & 3;
    /* column c of X (and R): row c of Kt, or row c - KD of Gt */
    auto colp = [&](int c) -> float * { return c < KD ? Kt + c * KPS : Gt + (c - KD) * KPS; };
#pragma unroll 1
    for (int b = 0; b < 4; b++) {
        const int r0 = 16 * b;
        float acc[NT][4];
        /* acc = R_b - sum_{c<b} A_bc X_c (R_b as the accumulator's start; A negated: exact) */
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const float *p0 = colp(8 * (warp * NT + n) + 2 * l4), *p1 = p0 + KPS;
            acc[n][0] = p0[r0 + g], acc[n][1] = p1[r0 + g];
            acc[n][2] = p0[r0 + g + 8], acc[n][3] = p1[r0 + g + 8];
        }
        for (int k0 = 0; k0 < r0; k0 += 8) {
            const float *a = As + (r0 + g) * KPS + k0 + l4;
            const tf32_a<PREC> af(-a[0], -a[8 * KPS], -a[4], -a[8 * KPS + 4]);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const float *bp = colp(8 * (warp * NT + n) + g) + k0 + l4;
                mma_tf32x<PREC>(acc[n], af, bp[0], bp[4]);
            }
        }
        __syncwarp(); /* (a warp's columns are its own: only its lanes exchange them) */
#pragma unroll
        for (int n = 0; n < NT; n++) {
            float *p0 = colp(8 * (warp * NT + n) + 2 * l4), *p1 = p0 + KPS;
            p0[r0 + g] = acc[n][0], p1[r0 + g] = acc[n][1];
            p0[r0 + g + 8] = acc[n][2], p1[r0 + g + 8] = acc[n][3];
        }
        __syncwarp();
        /* X_b = T_b acc (16 x 16 by 16 x 2 KD) */
        float xb[NT][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) {
            const float *a = Ti + (r0 + g) * TLD + k0 + l4;
            const tf32_a<PREC> af(a[0], a[8 * TLD], a[4], a[8 * TLD + 4]);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const float *bp = colp(8 * (warp * NT + n) + g) + r0 + k0 + l4;
                mma_tf32x<PREC>(xb[n], af, bp[0], bp[4]);
            }
        }
        __syncwarp(); /* block b's R is read: X_b takes its place */
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int c = 8 * (warp * NT + n) + 2 * l4;
            float *p0 = colp(c), *p1 = p0 + KPS;
            p0[r0 + g] = xb[n][0], p1[r0 + g] = xb[n][1];
            p0[r0 + g + 8] = xb[n][2], p1[r0 + g + 8] = xb[n][3];
            if (B16 && c < KD) { /* W handed over in BF16 (kda_chunked.cuh) */
                __nv_bfloat16 *w16 = (__nv_bfloat16 *)W;
#pragma unroll
                for (int e = 0; e < 4; e++)
                    w16[(r0 + g + 8 * (e >> 1)) * KD + kda_b16_slot(c + (e & 1))] =
                        __float2bfloat16_rn(xb[n][e]);
                continue;
            }
            float *dst = c < KD ? W + c : Ut + c - KD; /* [KC][KD] rows */
            *(float2 *)(dst + (r0 + g) * KD) = make_float2(xb[n][0], xb[n][1]);
            *(float2 *)(dst + (r0 + g + 8) * KD) = make_float2(xb[n][2], xb[n][3]);
        }
        __syncwarp(); /* X_b is whole for the next rows */
    }
}

/* Pass 1's products between 16-row blocks on tensor cores: the 6 blocks of 16 x 16 below the
 * diagonal blocks as 12 jobs of 16 x 8, A and P together (they share the keys' operand), each
 * exponent through the block's first row r: e^{G_i - G_r} e^{G_r - G_j}, both <= 0. Warp w's
 * jobs jj < 2 of the 12 (kda_prep_job), each a block pair (bi > bj) and a column half: f(jj, r,
 * c8) with r = 16 bi the block's first row and c8 = 16 bj + 8 half its first column. */
template <typename F> __device__ __forceinline__ void kda_prep_jobs(int tid, F &&f) {
#pragma unroll
    for (int jj = 0; jj < 2; jj++) {
        const int job = kda_prep_job(tid >> 5, jj);
        if (job >= 12) break; /* (the same for the whole warp) */
        int bi, bj;
        kda_tile_pair(job >> 1, bi, bj);
        f(jj, 16 * bi, 16 * bj + 8 * (job & 1));
    }
}

/* The TF32, 3xTF32 and 3xBF16 forms (PREC 1, 3, 4) of those jobs on m16n8k8: ma[jj] gets job jj's A
 * (C fragment), P's entries go straight to P (rows past L zero). */
template <int KD, int PREC>
__device__ __forceinline__ void kda_prep_blocks_tf32(float (&ma)[2][4], const float *Kt,
                                                     const float *Gt, const float *Qt, float *P,
                                                     int L, int tid) {
    const int lane = tid & 31, gq = lane >> 2, l4 = lane & 3;
    kda_prep_jobs(tid, [&](int jj, int r, int c8) {
        const int i0 = r + gq, col = c8 + gq;
        float mp[4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < KD; k0 += 8) {
            const int cA = k0 + l4, cB = cA + 4;
            const float *g0 = Gt + cA * KPS, *g1 = Gt + cB * KPS;
            const float *k0p = Kt + cA * KPS, *k1p = Kt + cB * KPS;
            const float *q0p = Qt + cA * KPS, *q1p = Qt + cB * KPS;
            const float gr0 = g0[r], gr1 = g1[r];
            const float e00 = exp2f(g0[i0] - gr0), e10 = exp2f(g0[i0 + 8] - gr0),
                        e01 = exp2f(g1[i0] - gr1), e11 = exp2f(g1[i0 + 8] - gr1);
            const tf32_a<PREC> ka(k0p[i0] * e00, k0p[i0 + 8] * e10, k1p[i0] * e01,
                                  k1p[i0 + 8] * e11);
            const tf32_a<PREC> qa(q0p[i0] * e00, q0p[i0 + 8] * e10, q1p[i0] * e01,
                                  q1p[i0 + 8] * e11);
            const float b0 = k0p[col] * exp2f(gr0 - g0[col]), b1 = k1p[col] * exp2f(gr1 - g1[col]);
            mma_tf32x<PREC>(ma[jj], ka, b0, b1);
            mma_tf32x<PREC>(mp, qa, b0, b1);
        }
        /* P's entries now (j < i: the zeroing of the upper part leaves them) */
        const int cj = c8 + 2 * l4;
        *(float2 *)(P + i0 * KC + cj) = i0 < L ? make_float2(mp[0], mp[1]) : make_float2(0, 0);
        *(float2 *)(P + (i0 + 8) * KC + cj) =
            i0 + 8 < L ? make_float2(mp[2], mp[3]) : make_float2(0, 0);
    });
}

/* The BF16 form (PREC 2) on m16n8k16: operands from the same channel-major staging, lane (g, l4)
 * reading rows g, g + 8 of channels 2 l4 (+1, +8, +9) — words 68 c + row, on 32 different banks
 * — each product with its exponential rounded to BF16 once; P's entries to P16
 * (kda_chunked.cuh's order). */
template <int KD>
__device__ __forceinline__ void kda_prep_blocks_b16(float (&ma)[2][4], const float *Kt,
                                                    const float *Gt, const float *Qt,
                                                    __nv_bfloat16 *P16, int L, int tid) {
    const int lane = tid & 31, gq = lane >> 2, l4 = lane & 3;
    kda_prep_jobs(tid, [&](int jj, int r, int c8) {
        const int i0 = r + gq, col = c8 + gq;
        float mp[4] = {};
#pragma unroll 2
        for (int k0 = 0; k0 < KD; k0 += 16) {
            uint32_t ka[4], qa[4], kb[2];
#pragma unroll
            for (int hk = 0; hk < 2; hk++) { /* channels 2 l4 (+1) of k0 + 8 hk */
                const int c = k0 + 8 * hk + 2 * l4;
                const float *g0 = Gt + c * KPS, *g1 = g0 + KPS;
                const float *k0p = Kt + c * KPS, *k1p = k0p + KPS;
                const float *q0p = Qt + c * KPS, *q1p = q0p + KPS;
                const float gr0 = g0[r], gr1 = g1[r];
#pragma unroll
                for (int hr = 0; hr < 2; hr++) { /* rows i0, i0 + 8 */
                    const int i = i0 + 8 * hr;
                    const float e0 = exp2f(g0[i] - gr0), e1 = exp2f(g1[i] - gr1);
                    ka[2 * hk + hr] = pack_bf16x2(k0p[i] * e0, k1p[i] * e1);
                    qa[2 * hk + hr] = pack_bf16x2(q0p[i] * e0, q1p[i] * e1);
                }
                kb[hk] =
                    pack_bf16x2(k0p[col] * exp2f(gr0 - g0[col]), k1p[col] * exp2f(gr1 - g1[col]));
            }
            mma_16816(ma[jj], ka, kb[0], kb[1]);
            mma_16816(mp, qa, kb[0], kb[1]);
        }
        const int cj = c8 + 2 * l4;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int i = i0 + 8 * hr;
            P16[i * KC + kda_b16_slot(cj)] = __float2bfloat16_rn(i < L ? mp[2 * hr] : 0.0f);
            P16[i * KC + kda_b16_slot(cj + 1)] = __float2bfloat16_rn(i < L ? mp[2 * hr + 1] : 0.0f);
        }
    });
}

/* RAW pass 1's head norms: thread n < 2 KC takes row n % KC of the staged keys (n < KC) or
 * queries, channel-major rows KPS apart, and returns its factor (l2norm_heads_k's, the same bits:
 * that kernel's lane l sums channels l, l + 32, .. in order, then the lanes add by an xor
 * butterfly, whose every addition pairs the same two values on all lanes; here one thread makes
 * the 32 lanes' sums and the same tree). */
template <int KD>
__device__ __forceinline__ float kda_raw_norm(const float *Kt, const float *Qt,
                                              const ds_cu_kda_raw &raw, int n) {
    const float *X = (n < KC ? Kt : Qt) + n % KC;
    float ss[32];
#pragma unroll
    for (int l = 0; l < 32; l++) {
        ss[l] = 0.0f;
#pragma unroll
        for (int c = l; c < KD; c += 32) ss[l] += X[c * KPS] * X[c * KPS];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int l = 0; l < o; l++) ss[l] += ss[l + o];
    return (n < KC ? 1.0f : raw.q_scale) / sqrtf(ss[0] + raw.eps);
}

/* long: one chunk's passes share their tiles in registers and shared memory between barriers;
 * split into functions, each would take a dozen array references. B16 (with PREC 0, for the BF16
 * mode): W, Qp, Kc and P handed over as BF16 (kda_chunked.cuh). RAW: g is f_b's output before the
 * gate, beta is unused, q and k are not normalized yet (ds_cu_kda_raw): beta is made as it is
 * staged, the gate and the head norms right after. */
template <int KD, int PREC, bool B16 = false, bool RAW = false>
__global__ void __launch_bounds__(256, 2)
    kda_chunk_prep_k(float *out, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, const kda_chunk *chunks, int H, ds_cu_kda_raw raw) {
    PDL_ENTRY();
    KDA_CLK_START();
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ float ksh[];
    float *Kt = ksh;           /* [KD][KPS] keys, channel-major */
    float *Gt = Kt + KD * KPS; /* [KD][KPS] running sums of the log decays, times log2(e) */
    float *Qt = Gt + KD * KPS; /* [KD][KPS] queries; then [KC][KPS] A (beta_i A_ij, j < i) */
    float *bs = Qt + KD * KPS; /* [KC] beta; then [4][16][TLD] the solve's block inverses */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, L = ch.len, tid = threadIdx.x;
    const size_t row0 = (size_t)ch.t0 * H + h; /* token t of the chunk, head h: (row0 + t H) KD */
    float *o = out + ((size_t)blockIdx.x * H + h) * kda_ch_floats(KD);
    float *W = o, *Ut = W + KC * KD, *Qp = Ut + KC * KD, *Kc = Qp + KC * KD;
    float *P = Kc + KC * KD, *gL = P + KC * KC;
    static_assert(B16 == (PREC == 2) || (B16 && PREC == 0), "BF16's pass 1 hands over in BF16");
    /* RAW: e^A_log of the head, as kda_gate_k makes it */
    const float ga = RAW ? expf(raw.A_log[h]) : 0.0f;
    /* the BF16 hand-over's rows, in the first half of each region (kda_chunked.cuh) */
    __nv_bfloat16 *W16 = (__nv_bfloat16 *)W, *Qp16 = (__nv_bfloat16 *)Qp;
    __nv_bfloat16 *Kc16 = (__nv_bfloat16 *)Kc, *P16 = (__nv_bfloat16 *)P;
    /* 1. keys, queries and decays into shared memory, transposed (rows past L: zeros): 16-byte
     *    loads, eight in flight a thread; a warp takes 8 rows x 4 pieces of 4 channels (64
     *    contiguous bytes a row from memory, at most two lanes to a bank in shared memory) */
    {
        constexpr int V4 = KD / 4, GROUPS = (KC / 8) * (V4 / 4), N4 = 3 * GROUPS * 32, B = 8;
        for (int base = tid; base < N4; base += 256 * B) {
            float4 r[B];
#pragma unroll
            for (int u = 0; u < B; u++) {
                const int i = base + u * 256, arr = i / (GROUPS * 32), gi = (i / 32) % GROUPS;
                const int lane = i % 32, t = (gi % (KC / 8)) * 8 + lane % 8;
                const int c4 = (gi / (KC / 8)) * 4 + lane / 8;
                const float *src = arr == 0 ? k : arr == 1 ? q : g;
                r[u] = i < N4 && t < L
                           ? __ldg((const float4 *)(src + (row0 + (size_t)t * H) * KD) + c4)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < B; u++) {
                const int i = base + u * 256, arr = i / (GROUPS * 32), gi = (i / 32) % GROUPS;
                const int lane = i % 32, t = (gi % (KC / 8)) * 8 + lane % 8;
                const int c4 = (gi / (KC / 8)) * 4 + lane / 8;
                if (i >= N4) break;
                float *dst = (arr == 0 ? Kt : arr == 1 ? Qt : Gt) + 4 * c4 * KPS + t;
                dst[0] = r[u].x, dst[KPS] = r[u].y, dst[2 * KPS] = r[u].z, dst[3 * KPS] = r[u].w;
            }
        }
        for (int t = tid; t < KC; t += 256)
            bs[t] = t >= L ? 0.0f
                    : RAW  ? 1.0f / (1.0f + expf(-raw.b_in[(size_t)(ch.t0 + t) * raw.ld_b + h]))
                           : beta[row0 + (size_t)t * H];
    }
    __syncthreads();
    /* RAW: the decay gate over the staged f_b outputs (kda_gate_k's expression), a loop rather
     * than in the staging's unrolled stores: the kernel is long straight-line code, and copies
     * of the gate there made every phase slower, not only the staging (likely instruction fetch:
     * bench/RESULTS.md session 44) */
    if constexpr (RAW) {
        const float *bias = raw.dt_bias + (size_t)h * KD;
#pragma unroll 2
        for (int e = tid; e < KD * KC; e += 256) {
            const int c = e / KC, t = e % KC; /* a warp: 32 rows of a channel, 32 banks */
            if (t < L)
                Gt[c * KPS + t] =
                    kda_decay(Gt[c * KPS + t] + __ldg(bias + c), ga, raw.lower_bound_form, raw.lb);
        }
        __syncthreads();
    }
    KDA_CLK_MARK(0);      /* staged */
    float *nsc = bs + KC; /* RAW: [2][KC] the keys' and queries' norm factors (the solve's later) */
    if (tid < KD) {       /* running sums down each channel, in log2 units */
        float acc = 0.0f;
        for (int t = 0; t < KC; t++) {
            acc += Gt[tid * KPS + t];
            Gt[tid * KPS + t] = acc * LOG2E;
        }
    } else if (RAW && tid >= 256 - 2 * KC) { /* (KD <= 128: beside the sums) */
        nsc[tid - (256 - 2 * KC)] = kda_raw_norm<KD>(Kt, Qt, raw, tid - (256 - 2 * KC));
    }
    __syncthreads();
    if constexpr (RAW) { /* the rows times their factors, as l2norm_heads_k's x *= s */
        for (int e = tid; e < 2 * KD * (KC / 4); e += 256) {
            const int arr = e / (KD * (KC / 4)), c = e / (KC / 4) % KD, t4 = 4 * (e % (KC / 4));
            float4 *x4 = (float4 *)((arr ? Qt : Kt) + c * KPS + t4);
            const float4 s4 = *(const float4 *)(nsc + arr * KC + t4);
            float4 x = *x4;
            x.x *= s4.x, x.y *= s4.y, x.z *= s4.z, x.w *= s4.w;
            *x4 = x;
        }
        __syncthreads();
    }
    KDA_CLK_MARK(1); /* running sums */
    /* 2. A_ij = sum_c k_ic k_jc e^{G_ic - G_jc} (j < i) and P_ij = sum_c q_ic k_jc e^{..} (j <= i)
     *    in 4 x 4 tiles. Tiles below the diagonal (ti > tj) factor the exponent through r = 4 ti,
     *    the tile's first row: e^{G_i - G_r} e^{G_r - G_j}, both <= 0 since j < r <= i (decays
     *    only shrink), so nothing overflows and the inner loop is 32 FMAs on 8 exponentials. The
     *    16 tiles on the diagonal (threads 128..255: a tile and a 1/8 of the channels each, summed
     *    by shuffles) take the exponent element by element. f32 form (PREC 0): every tile below the
     *    diagonal on its own thread (0..119). Tensor-core forms: only the 24 within a 16-row block
     *    on CUDA cores (threads 0..95: a tile and a quarter of the channels each); the 6 blocks of
     *    16 x 16 below the diagonal blocks as mma (below), factored the same way through the
     *    block's first row. */
    float a[4][4] = {}, p[4][4] = {};
    int ti = 0, tj = 0;
    if (PREC == 0 ? tid < 120 : tid < 96) {
        int c0 = 0, c1 = KD;
        if constexpr (PREC == 0) {
            kda_tile_pair(tid, ti, tj);
        } else { /* tile pair tid / 4 (6 a block), channels of quarter tid % 4 */
            const int blk = (tid >> 2) / 6;
            kda_tile_pair((tid >> 2) % 6, ti, tj);
            ti += 4 * blk, tj += 4 * blk;
            c0 = (tid & 3) * (KD / 4), c1 = c0 + KD / 4;
        }
        const int r = 4 * ti;
#pragma unroll 2
        for (int c = c0; c < c1; c++) {
            const float4 gi = *(const float4 *)(Gt + c * KPS + r),
                         ki = *(const float4 *)(Kt + c * KPS + r),
                         qi = *(const float4 *)(Qt + c * KPS + r),
                         gj = *(const float4 *)(Gt + c * KPS + 4 * tj),
                         kj = *(const float4 *)(Kt + c * KPS + 4 * tj);
            const float gr = gi.x; /* row r's own: e^{G_r - G_r} = 1 */
            const float ei[4] = {1.0f, exp2f(gi.y - gr), exp2f(gi.z - gr), exp2f(gi.w - gr)};
            const float kr[4] = {ki.x * ei[0], ki.y * ei[1], ki.z * ei[2], ki.w * ei[3]};
            const float qr[4] = {qi.x * ei[0], qi.y * ei[1], qi.z * ei[2], qi.w * ei[3]};
            const float kl[4] = {kj.x * exp2f(gr - gj.x), kj.y * exp2f(gr - gj.y),
                                 kj.z * exp2f(gr - gj.z), kj.w * exp2f(gr - gj.w)};
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) a[x][y] += kr[x] * kl[y], p[x][y] += qr[x] * kl[y];
        }
        if constexpr (PREC != 0)
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++)
#pragma unroll
                    for (int m = 1; m < 4; m <<= 1) {
                        a[x][y] += __shfl_xor_sync(0xffffffffu, a[x][y], m);
                        p[x][y] += __shfl_xor_sync(0xffffffffu, p[x][y], m);
                    }
    } else if (tid >= 128) {
        constexpr int CPS = KD / 8; /* channels per slice */
        const int d = (tid - 128) >> 3, s = tid & 7, r = 4 * d;
        ti = tj = d;
#pragma unroll 2
        for (int c = s * CPS; c < (s + 1) * CPS; c++) {
            const float4 g4 = *(const float4 *)(Gt + c * KPS + r),
                         k4 = *(const float4 *)(Kt + c * KPS + r),
                         q4 = *(const float4 *)(Qt + c * KPS + r);
            const float gv[4] = {g4.x, g4.y, g4.z, g4.w}, kv[4] = {k4.x, k4.y, k4.z, k4.w},
                        qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y <= x; y++) {
                    const float e = kv[y] * exp2f(gv[x] - gv[y]);
                    if (y < x) a[x][y] += kv[x] * e;
                    p[x][y] += qv[x] * e;
                }
        }
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y <= x; y++)
#pragma unroll
                for (int m = 1; m < 8; m <<= 1) {
                    a[x][y] += __shfl_xor_sync(0xffffffffu, a[x][y], m);
                    p[x][y] += __shfl_xor_sync(0xffffffffu, p[x][y], m);
                }
    }
    /* a tile's owner stores it (the lanes that summed a tile's slices hold the same sums: the
     * first) */
    const bool owner = PREC == 0 ? tid < 120 || (tid >= 128 && (tid & 7) == 0)
                                 : (tid < 96 && (tid & 3) == 0) || (tid >= 128 && (tid & 7) == 0);
    /* Tensor-core forms: the 16 x 16 blocks below the diagonal blocks (kda_prep_blocks_*) */
    float ma[2][4] = {}; /* a job's A: rows r + g (+8), columns 16 bj + 8 half + 2 l4 (+1) */
    if constexpr (PREC == 2) {
        kda_prep_blocks_b16<KD>(ma, Kt, Gt, Qt, P16, L, tid);
    } else if constexpr (PREC != 0) {
        kda_prep_blocks_tf32<KD, PREC>(ma, Kt, Gt, Qt, P, L, tid);
    }
    KDA_CLK_SYNC_MARK(2); /* A and P (a barrier of its own only when timed) */
    /* V's rows for the second half of the solve, requested now: on their way while P, Qp and Kc
     * are written (V is read nowhere else, so they come from memory) */
    float x[KC];
    if (tid >= KD && tid < 2 * KD)
#pragma unroll
        for (int i = 0; i < KC; i++)
            x[i] = i < L ? __ldg(v + (row0 + (size_t)i * H) * KD + tid - KD) : 0.0f;
    /* 3. P (zeros above the diagonal and past L), e^{G_L}, Qp = Q e^G and Kc = K e^{G_L - G} */
    if (owner)
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int i = 4 * ti + x, j = 4 * tj + y;
                if (j > i) continue;
                const float pv = i < L ? p[x][y] : 0.0f;
                if constexpr (B16)
                    P16[i * KC + kda_b16_slot(j)] = __float2bfloat16_rn(pv);
                else
                    P[i * KC + j] = pv;
            }
    for (int e = tid; e < KC * KC; e += 256)
        if (e % KC > e / KC) {
            if constexpr (B16)
                P16[(e & -KC) + kda_b16_slot(e % KC)] = __float2bfloat16_rn(0.0f);
            else
                P[e] = 0.0f;
        }
    if (tid < KD) gL[tid] = exp2f(Gt[tid * KPS + L - 1]);
    if constexpr (B16) {
        for (int i = tid; i < KC * KD; i += 256) { /* Qp by rows, Kc by columns (transposed) */
            const int t = i / KD, c = i % KD;
            Qp16[t * KD + kda_b16_slot(c)] =
                __float2bfloat16_rn(Qt[c * KPS + t] * exp2f(Gt[c * KPS + t]));
            const int c2 = i / KC, t2 = i % KC;
            const float gt = Gt[c2 * KPS + t2], gl = Gt[c2 * KPS + L - 1];
            Kc16[c2 * KC + kda_b16_slot(t2)] =
                __float2bfloat16_rn(Kt[c2 * KPS + t2] * exp2f(gl - gt));
        }
    } else {
        for (int i = tid; i < KC * KD; i += 256) {
            const int t = i / KD, c = i % KD;
            const float gt = Gt[c * KPS + t], gl = Gt[c * KPS + L - 1];
            Qp[i] = Qt[c * KPS + t] * exp2f(gt); /* zero past L: so is the staged query */
            Kc[i] = Kt[c * KPS + t] * exp2f(gl - gt);
        }
    }
    __syncthreads(); /* the queries are read: A takes their place */
    KDA_CLK_MARK(3); /* P, Qp, Kc written */
    float *As = Qt;  /* [KC][KPS] */
    if (owner)
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int i = 4 * ti + x, j = 4 * tj + y;
                if (j < i) As[i * KPS + j] = bs[i] * a[x][y];
            }
    if constexpr (PREC != 0) {
        const int warp = tid >> 5, lane = tid & 31, gq = lane >> 2, l4 = lane & 3;
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const int job = kda_prep_job(warp, jj);
            if (job >= 12) break;
            int bi, bj;
            kda_tile_pair(job >> 1, bi, bj);
            const int i0 = 16 * bi + gq, cj = 16 * bj + 8 * (job & 1) + 2 * l4;
            As[i0 * KPS + cj] = bs[i0] * ma[jj][0], As[i0 * KPS + cj + 1] = bs[i0] * ma[jj][1];
            As[(i0 + 8) * KPS + cj] = bs[i0 + 8] * ma[jj][2];
            As[(i0 + 8) * KPS + cj + 1] = bs[i0 + 8] * ma[jj][3];
        }
    }
    __syncthreads();
    KDA_CLK_MARK(4); /* A stored */
    /* 4. the solve: thread col < KD takes column col of diag(beta) K e^G (-> W), the others column
     *    col - KD of diag(beta) V (-> Ut); forward substitution down the 64 rows in registers.
     *    Tensor-core forms: by 16-row blocks instead (kda_solve_blocks). */
    if constexpr (PREC != 0) { /* (the BF16 form solves in TF32: more bits than its A has) */
        kda_solve_blocks<KD, PREC == 2 ? 1 : PREC, B16>(Kt, Gt, As, bs + KC, bs, x, W, Ut, tid);
    } else if (tid < 2 * KD) {
        const int col = tid;
#pragma unroll
        for (int i = 0; i < KC; i++)
            x[i] = col < KD ? (i < L ? bs[i] * Kt[col * KPS + i] * exp2f(Gt[col * KPS + i]) : 0.0f)
                            : bs[i] * x[i]; /* (beta is 0 past L) */
#pragma unroll
        for (int i = 1; i < KC; i++) {
            float r = x[i];
#pragma unroll
            for (int j = 0; j < i; j++) r -= As[i * KPS + j] * x[j];
            x[i] = r;
        }
        float *dst = col < KD ? W + col : Ut + col - KD;
        if (B16 && col < KD)
#pragma unroll
            for (int i = 0; i < KC; i++)
                W16[i * KD + kda_b16_slot(col)] = __float2bfloat16_rn(x[i]);
        else
#pragma unroll
            for (int i = 0; i < KC; i++) dst[i * KD] = x[i];
    }
    KDA_CLK_SYNC_MARK(5); /* the solve */
}

extern "C" void ds_cu_set_kda_tc(ds_cu *c, int mode) {
    c->kda_tc = mode >= 2 && mode <= 4 ? mode : mode > 0 ? 1 : 0;
}

extern "C" void ds_cu_set_kda_prep_tc(ds_cu *c, int on) {
    c->kda_prep_f32 = !on;
}

extern "C" void ds_cu_set_kda_out_fused(ds_cu *c, int on) {
    c->kda_out_sep = !on;
}

extern "C" int ds_cu_kda_chunked_supports(int dk, int dv) {
    return dk == dv && (dk == 64 || dk == 128);
}

/* pass 1's kernel for the context's mode (RAW: the gate, beta and norms inside it) */
using kda_prep_fn = void (*)(float *, const float *, const float *, const float *, const float *,
                             const float *, const kda_chunk *, int, ds_cu_kda_raw);
template <int KD, bool RAW> static kda_prep_fn kda_prep_kernel(const ds_cu *c) {
    /* (3xBF16, mode 4: its products between 16-row blocks and its solve in 3xBF16 where
     * kda_prep_f32 is off — the f32 operands handed over as in mode 3) */
    if (c->kda_tc == 4 && !c->kda_prep_f32) return kda_chunk_prep_k<KD, 4, false, RAW>;
    if (c->kda_tc == 3 && !c->kda_prep_f32) return kda_chunk_prep_k<KD, 3, false, RAW>;
    if (c->kda_tc == 1 && !c->kda_prep_f32) return kda_chunk_prep_k<KD, 1, false, RAW>;
    if (c->kda_tc == 2 && !c->kda_prep_f32) /* BF16 tensor cores, handed over in BF16 */
        return kda_chunk_prep_k<KD, 2, true, RAW>;
    if (c->kda_tc == 2) /* f32 arithmetic, the scan's operands handed over in BF16 */
        return kda_chunk_prep_k<KD, 0, true, RAW>;
    return kda_chunk_prep_k<KD, 0, false, RAW>;
}

template <int KD>
static int kda_chunked_run(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                           const float *g, const float *beta, const ds_cu_kda_raw *raw,
                           const kda_chunk *tab, const int *first, float *prep, float *states,
                           float *ug, int n_ch, float *const *S, int n_seq, int H, ds_err *err) {
    const size_t smem1 = kda_prep_smem<KD>();
    int *smem_set = &c->kda_chunk_smem[KD == 128]; /* once per head size; never captured */
    if (!*smem_set) {
        /* (the BF16 mode, 2, keeps pass 1 in f32: its solve keeps f32's operands) */
        for (auto kern :
             {kda_chunk_prep_k<KD, 0>, kda_chunk_prep_k<KD, 1>, kda_chunk_prep_k<KD, 3>,
              kda_chunk_prep_k<KD, 0, true>, kda_chunk_prep_k<KD, 2, true>,
              kda_chunk_prep_k<KD, 0, false, true>, kda_chunk_prep_k<KD, 1, false, true>,
              kda_chunk_prep_k<KD, 3, false, true>, kda_chunk_prep_k<KD, 0, true, true>,
              kda_chunk_prep_k<KD, 2, true, true>, kda_chunk_prep_k<KD, 4>,
              kda_chunk_prep_k<KD, 4, false, true>})
            CU_TRY(
                cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1),
                "chunked kda: shared memory");
        CU_TRY(kda_scan_attrs<KD>(), "chunked kda: shared memory");
        *smem_set = 1;
    }
    ds_cu_prof_mark(c, "kda chunks: prepare");
    const dim3 pgrid((unsigned)n_ch, (unsigned)H);
    const ds_cu_kda_raw none = {};
    launch_k(c, raw ? kda_prep_kernel<KD, true>(c) : kda_prep_kernel<KD, false>(c), pgrid, 256,
             smem1, prep, q, k, v, g, beta, tab, H, raw ? *raw : none);
    CU_TRY(cudaGetLastError(), "chunked kda (prepare)");
    ds_cu_prof_mark(c, "kda chunks: scan");
    kda_scan_launch<KD>(c, o, states, ug, prep, tab, first, S, n_ch, n_seq, H);
    CU_TRY(cudaGetLastError(), "chunked kda (scan, outputs)");
    return DS_OK;
}

static int kda_chunked(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, const ds_cu_kda_raw *raw,
                       const int *seg_start, const int *seg_len, float *const *S, int n_seq, int H,
                       int dk, int dv, ds_err *err) {
    if (!ds_cu_kda_chunked_supports(dk, dv))
        return ds_errf(err, "cuda: chunked kda: head dims %d x %d (64 or 128, square)", dk, dv);
    if (n_seq <= 0 || H <= 0) return DS_OK;
    if (capturing(c)) return ds_errf(err, "cuda: chunked kda cannot run inside a graph capture");
    int n_ch = 0;
    for (int z = 0; z < n_seq; z++) n_ch += (seg_len[z] + KC - 1) / KC;
    if (!n_ch) return DS_OK;
    /* the chunk table and each sequence's first chunk (a sequence with no tokens has none):
     * built here, uploaded with the step */
    const size_t tab_bytes = (size_t)n_ch * sizeof(kda_chunk), c0_bytes = (n_seq + 1) * sizeof(int);
    /* prep [n_ch][H][kda_ch_floats] | table [n_ch] then first [n_seq + 1] | states at the chunks'
     * starts [n_ch][H][dk][dv] | U [n_ch][H][KC][dv]; the last two only where the outputs take a
     * pass of their own (f32 mode, or ds_cu_set_kda_out_fused off): made beside the walk, the
     * outputs keep both on chip (kda_chunk_scan.cu) */
    const int apart = !c->kda_tc || c->kda_out_sep;
    const size_t sz[4] = {(size_t)n_ch * H * kda_ch_floats(dk) * sizeof(float),
                          tab_bytes + c0_bytes,
                          apart ? (size_t)n_ch * H * dk * dv * sizeof(float) : 0,
                          apart ? (size_t)n_ch * H * KC * dv * sizeof(float) : 0};
    void *b[4];
    const void *was = c->kdac;
    const size_t was_bytes = c->kdac_bytes;
    if (carve_scratch(c, &c->kdac, &c->kdac_bytes, sz, b, 4, "chunked kda scratch", err))
        return DS_ERR;
    if (c->kdac != was || c->kdac_bytes != was_bytes) c->kda_tab_dev = NULL; /* moved: stale */
    /* host: [0, nb) the table last uploaded, [nb, 2 nb) this call's */
    const size_t nb = tab_bytes + c0_bytes;
    if (c->h_kda_bytes < 2 * nb) {
        void *p = realloc(c->h_kda, 2 * nb);
        if (!p) return ds_errf(err, "cuda: out of host memory");
        c->h_kda = p;
        c->h_kda_bytes = 2 * nb;
    }
    kda_chunk *tab = (kda_chunk *)((char *)c->h_kda + nb);
    int *first = (int *)((char *)c->h_kda + nb + tab_bytes);
    int at = 0;
    for (int z = 0; z < n_seq; z++) {
        first[z] = at;
        for (int t = 0; t < seg_len[z]; t += KC)
            tab[at++] = kda_chunk{seg_start[z] + t, DS_MIN(KC, seg_len[z] - t), z};
    }
    first[n_seq] = at;
    /* A step's KDA layers share one table: uploaded (and waited for, since the host copy is
     * rewritten by the next call) only when it differs from the one on the device — once per
     * step instead of once per layer. */
    if (c->kda_tab_dev != b[1] || c->kda_tab_bytes != nb || memcmp(c->h_kda, tab, nb)) {
        memcpy(c->h_kda, tab, nb);
        c->kda_tab_dev = NULL; /* until the copy below has landed */
        CU_TRY(cudaMemcpyAsync(b[1], c->h_kda, nb, cudaMemcpyHostToDevice, c->stream),
               "kda chunk table");
        CU_TRY(cudaStreamSynchronize(c->stream), "kda chunk table");
        c->kda_tab_dev = b[1], c->kda_tab_bytes = nb;
    }
    const kda_chunk *dtab = (const kda_chunk *)b[1];
    const int *dfirst = (const int *)((const char *)b[1] + tab_bytes);
    float *prep = (float *)b[0], *states = (float *)b[2], *ug = (float *)b[3];
    if (dk == 64)
        return kda_chunked_run<64>(c, o, q, k, v, g, beta, raw, dtab, dfirst, prep, states, ug,
                                   n_ch, S, n_seq, H, err);
    return kda_chunked_run<128>(c, o, q, k, v, g, beta, raw, dtab, dfirst, prep, states, ug, n_ch,
                                S, n_seq, H, err);
}

extern "C" int ds_cu_kda_chunked(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                                 const float *g, const float *beta, const int *seg_start,
                                 const int *seg_len, float *const *S, int n_seq, int H, int dk,
                                 int dv, ds_err *err) {
    return kda_chunked(c, o, q, k, v, g, beta, NULL, seg_start, seg_len, S, n_seq, H, dk, dv, err);
}

extern "C" int ds_cu_kda_chunked_raw(ds_cu *c, float *o, const float *q, const float *k,
                                     const float *v, const float *f, const ds_cu_kda_raw *raw,
                                     const int *seg_start, const int *seg_len, float *const *S,
                                     int n_seq, int H, int dk, int dv, ds_err *err) {
    if (!raw || !raw->A_log || !raw->dt_bias || !raw->b_in)
        return ds_errf(err, "cuda: chunked kda: raw inputs without their gate's parameters");
    return kda_chunked(c, o, q, k, v, f, NULL, raw, seg_start, seg_len, S, n_seq, H, dk, dv, err);
}
