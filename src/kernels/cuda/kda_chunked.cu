/* kda_chunked.cu — KDA in chunks (prefill): pass 1 builds each chunk's products, pass 2 scans a
 * sequence's chunks with the state in registers, pass 3 the outputs; the scan and outputs also
 * on TF32 tensor cores. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tf32.cuh"

/* ---- KDA in chunks (prefill) ------------------------------------------------------------------
 * Within a chunk of L <= 64 tokens starting from state S0, with G_t the running sum of the log
 * decays g (per key channel, inclusive of token t; G decreases), the recurrence unrolls to
 *   u_i = beta_i (v_i - S0^T (k_i e^{G_i})) - sum_{j<i} A_ij u_j,
 *         A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}                      (j < i)
 *   o_t = S0^T (q_t e^{G_t}) + sum_{i<=t} P_ti u_i,  P_ti = sum_c q_tc k_ic e^{G_tc - G_ic}
 *   S_L = e^{G_L} S0 + sum_i (k_i e^{G_L - G_i}) u_i^T
 * so with (I + A) the unit lower-triangular matrix, U = Ut - W S0 where Ut = (I + A)^-1 diag(beta)
 * V and W = (I + A)^-1 diag(beta) (K e^G). Every exponent is a difference G_later - G_earlier <= 0,
 * so nothing overflows however strong the decay. Pass 1 (a block per chunk and head, all chunks
 * at once) builds W, Ut, Qp = Q e^G, Kc = K e^{G_L - G}, P and e^{G_L}; pass 2 (a block per head,
 * column group and sequence) walks its sequence's chunks in order: two small products per chunk,
 * the state's 32 columns kept in registers; pass 3 (a block per chunk and head, all at once) the
 * outputs. */
enum { KC = 64 };
/* pass 1's output per (chunk, head): W, Ut, Qp, Kc [KC][KD], P [KC][KC], gL [KD] */
__host__ __device__ constexpr size_t kda_ch_floats(int KD) {
    return (size_t)4 * KC * KD + (size_t)KC * KC + KD;
}

struct kda_chunk {
    int t0, len, seg; /* its tokens [t0, t0 + len) of segment seg */
};

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
    unsigned long long h[6];
    if (cudaMemcpyFromSymbol(h, g_kda_prep_clk, sizeof h) != cudaSuccess) return -1;
    for (int i = 0; i < 6; i++) cycles[i] = (double)h[i];
    static const unsigned long long zero[6] = {0};
    cudaMemcpyToSymbol(g_kda_prep_clk, zero, sizeof zero);
    return 0;
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

/* Pass 1's solve by 16-row blocks on tensor cores (modes 1 and 3): X = (I + A)^-1 R for the
 * 2 KD right-hand sides R = [diag(beta) K e^G | diag(beta) V] (-> W, Ut). The forward
 * substitution walks 64 rows one after another (a chain of 2016 dependent FMAs a column); here
 * each diagonal block's inverse T_b = (I + A_bb)^-1 comes first (64 threads, 16-row chains),
 * then block row b is X_b = T_b (R_b - sum_{c<b} A_bc X_c): two products a row of blocks, as
 * mma over all 2 KD columns. R is made in place over the staged keys (channel-major: a column of
 * X is a row of shared memory, which is also the B operand's layout, so every fragment load
 * falls on 32 banks) and V's columns over the decays, which nothing reads any more; X replaces
 * R block by block. A warp takes 2 KD / 8 / 8 tiles of 8 columns through all four rows of blocks,
 * so past the set-up its lanes exchange only their own columns. Ti: [4][16][TLD] the inverses. */
template <int KD, int PREC>
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
            float *dst = c < KD ? W + c : Ut + c - KD; /* [KC][KD] rows */
            *(float2 *)(dst + (r0 + g) * KD) = make_float2(xb[n][0], xb[n][1]);
            *(float2 *)(dst + (r0 + g + 8) * KD) = make_float2(xb[n][2], xb[n][3]);
        }
        __syncwarp(); /* X_b is whole for the next rows */
    }
}

/* long: one chunk's passes share their tiles in registers and shared memory between barriers;
 * split into functions, each would take a dozen array references. */
template <int KD, int PREC>
__global__ void __launch_bounds__(256, 2)
    kda_chunk_prep_k(float *out, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, const kda_chunk *chunks, int H) {
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
        for (int t = tid; t < KC; t += 256) bs[t] = t < L ? beta[row0 + (size_t)t * H] : 0.0f;
    }
    __syncthreads();
    KDA_CLK_MARK(0); /* staged */
    if (tid < KD) {  /* running sums down each channel, in log2 units */
        float acc = 0.0f;
        for (int t = 0; t < KC; t++) {
            acc += Gt[tid * KPS + t];
            Gt[tid * KPS + t] = acc * LOG2E;
        }
    }
    __syncthreads();
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
    /* Tensor-core forms: the 16 x 16 blocks (bi > bj) as 12 jobs of 16 x 8 (block, column half),
     * A and P together (they share the keys' operand), shared out by kda_prep_job. Operands are
     * made from shared memory as they are loaded, each exponent through the block's first row. */
    float ma[2][4] = {}; /* a job's A: rows r + g (+8), columns 16 bj + 8 half + 2 l4 (+1) */
    if constexpr (PREC != 0) {
        const int warp = tid >> 5, lane = tid & 31, gq = lane >> 2, l4 = lane & 3;
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            const int job = kda_prep_job(warp, jj);
            if (job >= 12) break; /* (the same for the whole warp) */
            int bi, bj;
            kda_tile_pair(job >> 1, bi, bj);
            const int r = 16 * bi, i0 = r + gq, col = 16 * bj + 8 * (job & 1) + gq;
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
                const float b0 = k0p[col] * exp2f(gr0 - g0[col]),
                            b1 = k1p[col] * exp2f(gr1 - g1[col]);
                mma_tf32x<PREC>(ma[jj], ka, b0, b1);
                mma_tf32x<PREC>(mp, qa, b0, b1);
            }
            /* P's entries now (j < i: the zeroing of the upper part below leaves them) */
            const int cj = 16 * bj + 8 * (job & 1) + 2 * l4;
            *(float2 *)(P + i0 * KC + cj) = i0 < L ? make_float2(mp[0], mp[1]) : make_float2(0, 0);
            *(float2 *)(P + (i0 + 8) * KC + cj) =
                i0 + 8 < L ? make_float2(mp[2], mp[3]) : make_float2(0, 0);
        }
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
                if (j <= i) P[i * KC + j] = i < L ? p[x][y] : 0.0f;
            }
    for (int e = tid; e < KC * KC; e += 256)
        if (e % KC > e / KC) P[e] = 0.0f;
    if (tid < KD) gL[tid] = exp2f(Gt[tid * KPS + L - 1]);
    for (int i = tid; i < KC * KD; i += 256) {
        const int t = i / KD, c = i % KD;
        const float gt = Gt[c * KPS + t], gl = Gt[c * KPS + L - 1];
        Qp[i] = Qt[c * KPS + t] * exp2f(gt); /* zero past L: so is the staged query */
        Kc[i] = Kt[c * KPS + t] * exp2f(gl - gt);
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
    if constexpr (PREC != 0) {
        kda_solve_blocks<KD, PREC>(Kt, Gt, As, bs + KC, bs, x, W, Ut, tid);
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
#pragma unroll
        for (int i = 0; i < KC; i++) dst[i * KD] = x[i];
    }
    KDA_CLK_SYNC_MARK(5); /* the solve */
}

/* State columns and threads per block: a thread's 2 x 4 U entries and 4 x 4 state entries reuse
 * each shared-memory load 8 and 16 times (512 threads halve that: shared memory is what the scan
 * waits on). */
enum { KS_BV = 32, KS_NT = 256 };

/* Pass 2's shared memory: two stages of a chunk's operands (W, Kc, Ut, e^{G_L}), then the state's
 * columns and U. The tensor-core form pads Kc, Ut, the state and U so that its fragment loads
 * (lanes 4 g + l4 reading rows l4 and columns g) fall on 32 different banks. */
template <int KD, bool TC> struct kda_scan_smem {
    static constexpr int WLD = KD + 4;                 /* W: a warp's 8 rows on 8 bank quads */
    static constexpr int KLD = TC ? KD + 8 : KD;       /* Kc */
    static constexpr int ULD = TC ? KS_BV + 8 : KS_BV; /* Ut, the state and U */
    static constexpr int STAGE = KC * WLD + KC * KLD + KC * ULD + KD;
    static constexpr size_t BYTES = ((size_t)2 * STAGE + KD * ULD + KC * ULD) * sizeof(float);
};

/* Chunk ci's operands (head h, columns [cg, cg + KS_BV)) into stage s of pass 2's shared memory,
 * every thread its share of 16-byte cp.async pieces (one commit group). */
template <int KD, bool TC>
__device__ __forceinline__ void kda_scan_stage(float *ssh, int s, const float *prep, int ci, int H,
                                               int h, int cg) {
    using SM = kda_scan_smem<KD, TC>;
    const float *pr = prep + ((size_t)ci * H + h) * kda_ch_floats(KD);
    float *W = ssh + s * SM::STAGE, *Kc = W + KC * SM::WLD, *Ut = Kc + KC * SM::KLD,
          *gL = Ut + KC * SM::ULD;
    /* W's and Kc's pieces interleaved: copied one matrix after the other (cp_async_rows twice),
     * the TF32 chunked KDA took 1.670 against 1.624 ms at 8192 tokens x 32 heads */
    for (int i = threadIdx.x; i < KC * KD / 4; i += KS_NT) {
        const int r = i / (KD / 4), c = (i % (KD / 4)) * 4;
        cp_async16(W + r * SM::WLD + c, pr + r * KD + c);
        cp_async16(Kc + r * SM::KLD + c, pr + 3 * KC * KD + r * KD + c);
    }
    cp_async_rows<KS_BV, KS_NT>(Ut, SM::ULD, pr + KC * KD + cg, KD, KC);
    for (int i = threadIdx.x; i < KD / 4; i += KS_NT)
        cp_async16(gL + 4 * i, pr + 4 * KC * KD + KC * KC + 4 * i);
    cp_async_commit();
}

/* Pass 2: block (head h, columns [BV cg, +BV), sequence z) walks z's chunks in order, keeping
 * only what is sequential: U = Ut - W S0 and the next state; it leaves each chunk's starting
 * state and U for pass 3. A chunk's W, Kc, Ut columns and e^{G_L} (75 KB, from memory: pass 1's
 * output is far larger than L2) are copied into shared memory with cp.async while the chunk
 * before is computed (two stages): the version that loaded them as it went spent ~12 us a chunk
 * waiting on memory for ~2 us of arithmetic. */
template <int KD>
__global__ void __launch_bounds__(KS_NT)
    kda_chunk_scan_k(float *states, float *ug, const float *prep, const kda_chunk *chunks,
                     const int *seg_chunk0, float *const *S, int H) {
    PDL_ENTRY();
    using SM = kda_scan_smem<KD, false>;
    /* U rows and state channels per thread (8 threads across the 32 columns) */
    constexpr int WLD = SM::WLD, RP = KC * 8 / KS_NT, NCH = KD * 8 / KS_NT;
    extern __shared__ float ssh[];
    float *Ss = ssh + 2 * SM::STAGE; /* [KD][KS_BV] the state's columns, as of this chunk */
    float *Us = Ss + KD * KS_BV;     /* [KC][KS_BV] this chunk's U */
    const int h = blockIdx.x, cg = blockIdx.y * KS_BV, z = blockIdx.z, tid = threadIdx.x;
    float *Sh = S[z] + (size_t)h * KD * KD;     /* [dk][dv] */
    const int q = tid / 8, col = (tid % 8) * 4; /* U: rows RP q..; state: channels NCH q.. */
    float st[NCH][4];                           /* state entries (channel NCH q + x, col + y) */
#pragma unroll
    for (int x = 0; x < NCH; x++) {
        const float4 s4 = *(const float4 *)(Sh + (size_t)(NCH * q + x) * KD + cg + col);
        st[x][0] = s4.x, st[x][1] = s4.y, st[x][2] = s4.z, st[x][3] = s4.w;
        *(float4 *)(Ss + (NCH * q + x) * KS_BV + col) = s4;
    }
    const int c0 = seg_chunk0[z], c1 = seg_chunk0[z + 1];
    if (c0 < c1) kda_scan_stage<KD, false>(ssh, 0, prep, c0, H, h, cg);
    for (int ci = c0; ci < c1; ci++) {
        const int s = (ci - c0) & 1;
        const float *W = ssh + s * SM::STAGE, *Kc = W + KC * WLD, *Ut = Kc + KC * KD;
        const float *gL = Ut + KC * KS_BV;
        cp_async_wait_all();
        __syncthreads(); /* stage s has landed for all; everyone is done with the last chunk */
        if (ci + 1 < c1) kda_scan_stage<KD, false>(ssh, s ^ 1, prep, ci + 1, H, h, cg);
        float *sg = states + ((size_t)ci * H + h) * KD * KD; /* the state this chunk starts from */
#pragma unroll
        for (int x = 0; x < NCH; x++)
            *(float4 *)(sg + (size_t)(NCH * q + x) * KD + cg + col) =
                make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
        { /* U = Ut - W S0: rows RP q .., columns col .. col+3 */
            float u[RP][4] = {};
#pragma unroll 4
            for (int c = 0; c < KD; c += 4) {
                float wa[RP][4];
#pragma unroll
                for (int r = 0; r < RP; r++) {
                    const float4 w4 = *(const float4 *)(W + (RP * q + r) * WLD + c);
                    wa[r][0] = w4.x, wa[r][1] = w4.y, wa[r][2] = w4.z, wa[r][3] = w4.w;
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float4 s4 = *(const float4 *)(Ss + (c + e) * KS_BV + col);
#pragma unroll
                    for (int r = 0; r < RP; r++) {
                        u[r][0] += wa[r][e] * s4.x, u[r][1] += wa[r][e] * s4.y;
                        u[r][2] += wa[r][e] * s4.z, u[r][3] += wa[r][e] * s4.w;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RP; r++) {
                const int row = RP * q + r;
                const float4 t4 = *(const float4 *)(Ut + row * KS_BV + col);
                const float4 uv =
                    make_float4(t4.x - u[r][0], t4.y - u[r][1], t4.z - u[r][2], t4.w - u[r][3]);
                *(float4 *)(Us + row * KS_BV + col) = uv;
                *(float4 *)(ug + ((size_t)ci * H + h) * KC * KD + (size_t)row * KD + cg + col) = uv;
            }
        }
        __syncthreads(); /* U is whole; every read of Ss is done */
        { /* S0 <- e^{G_L} S0 + Kc^T U (rows past the chunk's length are zeros in Kc and U) */
#pragma unroll
            for (int x = 0; x < NCH; x++) {
                const float gl = gL[NCH * q + x];
#pragma unroll
                for (int y = 0; y < 4; y++) st[x][y] *= gl;
            }
#pragma unroll 8
            for (int i = 0; i < KC; i++) {
                const float4 u4 = *(const float4 *)(Us + i * KS_BV + col);
#pragma unroll
                for (int x = 0; x < NCH; x++) {
                    const float kv = Kc[i * KD + NCH * q + x];
                    st[x][0] += kv * u4.x, st[x][1] += kv * u4.y;
                    st[x][2] += kv * u4.z, st[x][3] += kv * u4.w;
                }
            }
#pragma unroll
            for (int x = 0; x < NCH; x++)
                *(float4 *)(Ss + (NCH * q + x) * KS_BV + col) =
                    make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
        }
    }
#pragma unroll
    for (int x = 0; x < NCH; x++)
        *(float4 *)(Sh + (size_t)(NCH * q + x) * KD + cg + col) =
            make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
}

/* Pass 3: block (chunk, head) computes O = Qp S0 + P U for its tokens, every chunk at once: a
 * thread takes ROWS rows and 4 columns; S0 and U rows are read by every warp (L1 serves them),
 * Qp and P rows are the same across a warp's lanes (broadcast). */
template <int KD>
__global__ void __launch_bounds__(256)
    kda_chunk_out_k(float *o, const float *states, const float *ug, const float *prep,
                    const kda_chunk *chunks, int H) {
    PDL_ENTRY();
    constexpr int LANES = KD / 4;          /* threads across the columns */
    constexpr int ROWS = KC * LANES / 256; /* rows per thread: 8 (KD 128) or 4 (KD 64) */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, tid = threadIdx.x;
    const int r0 = (tid / LANES) * ROWS, col = (tid % LANES) * 4;
    const size_t at = (size_t)blockIdx.x * H + h;
    const float *pr = prep + at * kda_ch_floats(KD);
    const float *Qp = pr + 2 * KC * KD, *P = pr + 4 * KC * KD;
    const float *S0 = states + at * KD * KD, *U = ug + at * KC * KD;
    if (r0 >= ch.len) return;
    float acc[ROWS][4];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int y = 0; y < 4; y++) acc[r][y] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < KD; c++) {
        const float4 sv = __ldg((const float4 *)(S0 + (size_t)c * KD + col));
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float qv = __ldg(Qp + (r0 + r) * KD + c);
            acc[r][0] += qv * sv.x, acc[r][1] += qv * sv.y;
            acc[r][2] += qv * sv.z, acc[r][3] += qv * sv.w;
        }
    }
    const int i_end = min(ch.len, r0 + ROWS); /* P is lower triangular: i <= t */
    for (int i = 0; i < i_end; i++) {
        const float4 uv = __ldg((const float4 *)(U + (size_t)i * KD + col));
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float pv = __ldg(P + (r0 + r) * KC + i); /* zero where i > t */
            acc[r][0] += pv * uv.x, acc[r][1] += pv * uv.y;
            acc[r][2] += pv * uv.z, acc[r][3] += pv * uv.w;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int t = r0 + r;
        if (t >= ch.len) break;
        *(float4 *)(o + ((size_t)(ch.t0 + t) * H + h) * KD + col) =
            make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
}

/* Pass 3 on TF32 tensor cores (ds_cu_set_kda_tc: 1, or 3 with the operands split, the model's
 * default): the same two products, O = Qp S0 + P U, as mma.sync m16n8k8 with f32 accumulation, the
 * operands rounded to TF32 (10-bit mantissa: ~1e-3 relative error instead of f32's 1e-7). Block
 * (chunk, head), 8 warps: rows 16 (w mod 4) + [0, 16), half the columns each. S0 and U (the B
 * operands, read by every warp) are copied into shared memory once with cp.async, padded so that a
 * fragment's loads fall on 32 banks; Qp and P rows (A, one warp's own) come straight from memory.
 * Rows past the chunk's length are zeros in Qp, P and U (passes 1 and 2 write them so), so no
 * operand needs a mask; only the stores do. */
/* One k-step of 8 for a warp's 16 rows and NT 8-column tiles: acc += A B with A row-major in
 * global memory (a: this lane's A(g, l4), rows lda apart) and B row-major in shared memory (b:
 * this lane's B(l4, g), rows ldb apart, tiles 8 columns apart). */
template <int NT, int PREC>
__device__ __forceinline__ void tf32_kstep(float (&acc)[NT][4], const float *a, int lda,
                                           const float *b, int ldb) {
    const tf32_a<PREC> af(__ldg(a), __ldg(a + 8 * lda), __ldg(a + 4), __ldg(a + 8 * lda + 4));
#pragma unroll
    for (int n = 0; n < NT; n++) mma_tf32x<PREC>(acc[n], af, b[n * 8], b[4 * ldb + n * 8]);
}

/* pass 3's shared memory on tensor cores: S0 [KD][KD + 8] and U [KC][KD + 8] */
template <int KD> constexpr size_t kda_out_tc_smem() {
    return (size_t)(KD + KC) * (KD + 8) * sizeof(float);
}

template <int KD, int PREC>
__global__ void __launch_bounds__(256)
    kda_chunk_out_tc_k(float *o, const float *states, const float *ug, const float *prep,
                       const kda_chunk *chunks, int H) {
    PDL_ENTRY();
    constexpr int BLD = KD + 8; /* S0 and U rows in shared memory */
    constexpr int NT = KD / 16; /* 8-column tiles a warp holds (half the columns) */
    extern __shared__ float osh[];
    float *S0s = osh;           /* [KD][BLD] */
    float *Us = S0s + KD * BLD; /* [KC][BLD] */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, l4 = lane & 3, r0 = 16 * (warp & 3), c0 = (KD / 2) * (warp >> 2);
    const size_t at = (size_t)blockIdx.x * H + h;
    const float *pr = prep + at * kda_ch_floats(KD);
    const float *Qp = pr + 2 * KC * KD, *P = pr + 4 * KC * KD;
    const float *S0 = states + at * KD * KD, *U = ug + at * KC * KD;
    cp_async_rows<KD, 256>(S0s, BLD, S0, KD, KD);
    cp_async_rows<KD, 256>(Us, BLD, U, KD, KC);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    if (r0 >= ch.len) return; /* (no block barrier follows) */
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        /* Qp S0: k over the KD key channels */
#pragma unroll 4
    for (int k0 = 0; k0 < KD; k0 += 8)
        tf32_kstep<NT, PREC>(acc, Qp + (size_t)(r0 + g) * KD + k0 + l4, KD,
                             S0s + (k0 + l4) * BLD + c0 + g, BLD);
    /* P U: k over the chunk's tokens, up to this warp's last row (P is lower triangular) */
    for (int k0 = 0; k0 < r0 + 16; k0 += 8)
        tf32_kstep<NT, PREC>(acc, P + (size_t)(r0 + g) * KC + k0 + l4, KC,
                             Us + (k0 + l4) * BLD + c0 + g, BLD);
    const int t0 = r0 + g, t1 = t0 + 8;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int col = c0 + n * 8 + 2 * l4;
        if (t0 < ch.len)
            *(float2 *)(o + ((size_t)(ch.t0 + t0) * H + h) * KD + col) =
                make_float2(acc[n][0], acc[n][1]);
        if (t1 < ch.len)
            *(float2 *)(o + ((size_t)(ch.t0 + t1) * H + h) * KD + col) =
                make_float2(acc[n][2], acc[n][3]);
    }
}

/* Pass 2 on TF32 tensor cores (with ds_cu_set_kda_tc): the same walk and staging, both products
 * as mma.sync m16n8k8 with f32 accumulation (the operands rounded to TF32). The state stays in
 * the accumulators of the second product: warp w holds channels 16 (w mod M2) + [0, 16) of
 * N2 8-column tiles, M2 = KD / 16 tiles of channels. */
template <int KD, int PREC>
__global__ void __launch_bounds__(KS_NT)
    kda_chunk_scan_tc_k(float *states, float *ug, const float *prep, const kda_chunk *chunks,
                        const int *seg_chunk0, float *const *S, int H) {
    PDL_ENTRY();
    using SM = kda_scan_smem<KD, true>;
    constexpr int WLD = SM::WLD, KLD = SM::KLD, ULD = SM::ULD;
    constexpr int M2 = KD / 16, N2 = 4 * M2 / 8; /* channel tiles; column tiles a warp holds */
    extern __shared__ float ssh[];
    float *Ss = ssh + 2 * SM::STAGE; /* [KD][ULD] the state's columns, as of this chunk */
    float *Us = Ss + KD * ULD;       /* [KC][ULD] this chunk's U */
    const int h = blockIdx.x, cg = blockIdx.y * KS_BV, z = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    float *Sh = S[z] + (size_t)h * KD * KD; /* [dk][dv] */
    /* second product's tile: channels m2 + g (+ 8), columns n2 + 8 n + 2 l4 (+ 1) */
    const int m2 = 16 * (warp % M2), n2 = 8 * N2 * (warp / M2);
    /* first product's tile: U rows m1 + g (+ 8), columns n1 + 8 n + 2 l4 (+ 1), n < 2 */
    const int m1 = 16 * (warp & 3), n1 = 16 * (warp >> 2);
    float st[N2][4];
#pragma unroll
    for (int n = 0; n < N2; n++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int ch = m2 + g + 8 * hh, cl = n2 + 8 * n + 2 * l4;
            const float2 v2 = *(const float2 *)(Sh + (size_t)ch * KD + cg + cl);
            st[n][2 * hh] = v2.x, st[n][2 * hh + 1] = v2.y;
            *(float2 *)(Ss + ch * ULD + cl) = v2;
        }
    const int c0 = seg_chunk0[z], c1 = seg_chunk0[z + 1];
    if (c0 < c1) kda_scan_stage<KD, true>(ssh, 0, prep, c0, H, h, cg);
    for (int ci = c0; ci < c1; ci++) {
        const int s = (ci - c0) & 1;
        const float *W = ssh + s * SM::STAGE, *Kc = W + KC * WLD, *Ut = Kc + KC * KLD;
        const float *gL = Ut + KC * ULD;
        cp_async_wait_all();
        __syncthreads(); /* stage s has landed for all; everyone is done with the last chunk */
        if (ci + 1 < c1) kda_scan_stage<KD, true>(ssh, s ^ 1, prep, ci + 1, H, h, cg);
        float *sg = states + ((size_t)ci * H + h) * KD * KD; /* the state this chunk starts from */
#pragma unroll
        for (int n = 0; n < N2; n++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                *(float2 *)(sg + (size_t)(m2 + g + 8 * hh) * KD + cg + n2 + 8 * n + 2 * l4) =
                    make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
        { /* U = Ut - W S0 */
            float acc[2][4] = {};
#pragma unroll 4
            for (int k0 = 0; k0 < KD; k0 += 8) {
                const float *wa = W + (m1 + g) * WLD + k0 + l4;
                const tf32_a<PREC> af(wa[0], wa[8 * WLD], wa[4], wa[8 * WLD + 4]);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    const float *sb = Ss + (k0 + l4) * ULD + n1 + 8 * n + g;
                    mma_tf32x<PREC>(acc[n], af, sb[0], sb[4 * ULD]);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = m1 + g + 8 * hh, cl = n1 + 8 * n + 2 * l4;
                    const float2 t2 = *(const float2 *)(Ut + row * ULD + cl);
                    const float2 u2 = make_float2(t2.x - acc[n][2 * hh], t2.y - acc[n][2 * hh + 1]);
                    *(float2 *)(Us + row * ULD + cl) = u2;
                    *(float2 *)(ug + ((size_t)ci * H + h) * KC * KD + (size_t)row * KD + cg + cl) =
                        u2;
                }
        }
        __syncthreads(); /* U is whole; every read of Ss is done */
        { /* S0 <- e^{G_L} S0 + Kc^T U (rows past the chunk's length are zeros in Kc and U) */
            const float gl0 = gL[m2 + g], gl1 = gL[m2 + g + 8];
#pragma unroll
            for (int n = 0; n < N2; n++)
                st[n][0] *= gl0, st[n][1] *= gl0, st[n][2] *= gl1, st[n][3] *= gl1;
#pragma unroll 2
            for (int k0 = 0; k0 < KC; k0 += 8) {
                const float *ka = Kc + (k0 + l4) * KLD + m2 + g; /* A = Kc^T: A(m, k) = Kc(k, m) */
                const tf32_a<PREC> af(ka[0], ka[8], ka[4 * KLD], ka[4 * KLD + 8]);
#pragma unroll
                for (int n = 0; n < N2; n++) {
                    const float *ub = Us + (k0 + l4) * ULD + n2 + 8 * n + g;
                    mma_tf32x<PREC>(st[n], af, ub[0], ub[4 * ULD]);
                }
            }
#pragma unroll
            for (int n = 0; n < N2; n++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
                    *(float2 *)(Ss + (m2 + g + 8 * hh) * ULD + n2 + 8 * n + 2 * l4) =
                        make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
        }
    }
#pragma unroll
    for (int n = 0; n < N2; n++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            *(float2 *)(Sh + (size_t)(m2 + g + 8 * hh) * KD + cg + n2 + 8 * n + 2 * l4) =
                make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
}

extern "C" void ds_cu_set_kda_tc(ds_cu *c, int mode) {
    c->kda_tc = mode == 3 || mode == 2 ? mode : mode > 0 ? 1 : 0;
}

extern "C" void ds_cu_set_kda_prep_tc(ds_cu *c, int on) {
    c->kda_prep_f32 = !on;
}

extern "C" int ds_cu_kda_chunked_supports(int dk, int dv) {
    return dk == dv && (dk == 64 || dk == 128);
}

/* the tensor-core passes' shared memory above the default 48 KB (pass 1's too: its forms) */
/* (PREC 2, BF16, has pass 1 in f32: its solve keeps f32's operands) */
template <int KD, int PREC> static cudaError_t kda_tc_attrs() {
    cudaError_t e = cudaSuccess;
    if constexpr (PREC != 2)
        e = cudaFuncSetAttribute(kda_chunk_prep_k<KD, PREC>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kda_prep_smem<KD>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_out_tc_k<KD, PREC>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kda_out_tc_smem<KD>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_scan_tc_k<KD, PREC>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kda_scan_smem<KD, true>::BYTES);
    return e;
}

template <int KD>
static int kda_chunked_run(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                           const float *g, const float *beta, const kda_chunk *tab,
                           const int *first, float *prep, float *states, float *ug, int n_ch,
                           float *const *S, int n_seq, int H, ds_err *err) {
    const size_t smem1 = kda_prep_smem<KD>();
    int *smem_set = &c->kda_chunk_smem[KD == 128]; /* once per head size; never captured */
    if (!*smem_set) {
        CU_TRY(cudaFuncSetAttribute(kda_chunk_prep_k<KD, 0>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1),
               "chunked kda: shared memory");
        CU_TRY(cudaFuncSetAttribute(kda_chunk_scan_k<KD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)kda_scan_smem<KD, false>::BYTES),
               "chunked kda: shared memory");
        CU_TRY((kda_tc_attrs<KD, 1>()), "chunked kda: shared memory");
        CU_TRY((kda_tc_attrs<KD, 3>()), "chunked kda: shared memory");
        CU_TRY((kda_tc_attrs<KD, 2>()), "chunked kda: shared memory");
        *smem_set = 1;
    }
    ds_cu_prof_mark(c, "kda chunks: prepare");
    const dim3 pgrid((unsigned)n_ch, (unsigned)H);
    if (c->kda_tc == 3 && !c->kda_prep_f32)
        launch_k(c, kda_chunk_prep_k<KD, 3>, pgrid, 256, smem1, prep, q, k, v, g, beta, tab, H);
    else if (c->kda_tc == 1 && !c->kda_prep_f32)
        launch_k(c, kda_chunk_prep_k<KD, 1>, pgrid, 256, smem1, prep, q, k, v, g, beta, tab, H);
    else
        launch_k(c, kda_chunk_prep_k<KD, 0>, pgrid, 256, smem1, prep, q, k, v, g, beta, tab, H);
    CU_TRY(cudaGetLastError(), "chunked kda (prepare)");
    ds_cu_prof_mark(c, "kda chunks: scan");
    const dim3 sgrid((unsigned)H, KD / KS_BV, (unsigned)n_seq), ogrid((unsigned)n_ch, (unsigned)H);
    if (c->kda_tc == 3)
        launch_k(c, kda_chunk_scan_tc_k<KD, 3>, sgrid, KS_NT, kda_scan_smem<KD, true>::BYTES,
                 states, ug, prep, tab, first, S, H);
    else if (c->kda_tc == 2)
        launch_k(c, kda_chunk_scan_tc_k<KD, 2>, sgrid, KS_NT, kda_scan_smem<KD, true>::BYTES,
                 states, ug, prep, tab, first, S, H);
    else if (c->kda_tc)
        launch_k(c, kda_chunk_scan_tc_k<KD, 1>, sgrid, KS_NT, kda_scan_smem<KD, true>::BYTES,
                 states, ug, prep, tab, first, S, H);
    else
        launch_k(c, kda_chunk_scan_k<KD>, dim3((unsigned)H, KD / KS_BV, (unsigned)n_seq), KS_NT,
                 kda_scan_smem<KD, false>::BYTES, states, ug, prep, tab, first, S, H);
    CU_TRY(cudaGetLastError(), "chunked kda (scan)");
    ds_cu_prof_mark(c, "kda chunks: outputs");
    if (c->kda_tc == 3)
        launch_k(c, kda_chunk_out_tc_k<KD, 3>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
                 prep, tab, H);
    else if (c->kda_tc == 2)
        launch_k(c, kda_chunk_out_tc_k<KD, 2>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
                 prep, tab, H);
    else if (c->kda_tc)
        launch_k(c, kda_chunk_out_tc_k<KD, 1>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
                 prep, tab, H);
    else
        launch_k(c, kda_chunk_out_k<KD>, dim3((unsigned)n_ch, (unsigned)H), 256, 0, o, states, ug,
                 prep, tab, H);
    CU_TRY(cudaGetLastError(), "chunked kda (outputs)");
    return DS_OK;
}

extern "C" int ds_cu_kda_chunked(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                                 const float *g, const float *beta, const int *seg_start,
                                 const int *seg_len, float *const *S, int n_seq, int H, int dk,
                                 int dv, ds_err *err) {
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
     * starts [n_ch][H][dk][dv] | U [n_ch][H][KC][dv] */
    const size_t sz[4] = {(size_t)n_ch * H * kda_ch_floats(dk) * sizeof(float),
                          tab_bytes + c0_bytes, (size_t)n_ch * H * dk * dv * sizeof(float),
                          (size_t)n_ch * H * KC * dv * sizeof(float)};
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
        return kda_chunked_run<64>(c, o, q, k, v, g, beta, dtab, dfirst, prep, states, ug, n_ch, S,
                                   n_seq, H, err);
    return kda_chunked_run<128>(c, o, q, k, v, g, beta, dtab, dfirst, prep, states, ug, n_ch, S,
                                n_seq, H, err);
}
