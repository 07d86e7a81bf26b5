/* mla_expanded.cu — MLA attention in the expanded form (prefill): split and merged, through
 * cuBLAS, or one fused flash-attention kernel on tensor cores. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mla.cuh"

/* Expanded MLA (prefill), the same split-and-merge: block (q = t*Ha + h, split s) scores its rows
 * j as q_N . kN[j][h] + q_R . kR[j], then sums p_j v[j][h]; mla_merge_k merges the splits. */
__global__ void mla_exp_split_k(float *part_o, float *part_ml, const float *q, const float *kN,
                                const float *kR, const float *v, int Ha, int dn, int dr, int dvh,
                                int pos0, int n_ctx, int causal, float scale, int n_split) {
    PDL_ENTRY();
    __shared__ float sc[MLA_CHUNK];
    const int qi = blockIdx.x, t = qi / Ha, h = qi % Ha, s = blockIdx.y;
    const int n = causal ? min(pos0 + t + 1, n_ctx) : n_ctx;
    const int j0 = s * MLA_CHUNK, j1 = min(n, j0 + MLA_CHUNK);
    float *po = part_o + ((size_t)qi * n_split + s) * dvh;
    float *pml = part_ml + ((size_t)qi * n_split + s) * 2;
    if (j0 >= j1) {
        for (int i = threadIdx.x; i < dvh; i += blockDim.x) po[i] = 0.0f;
        if (threadIdx.x == 0) pml[0] = -INFINITY, pml[1] = 0.0f;
        return;
    }
    const float *qn = q + (size_t)qi * (dn + dr), *qp = qn + dn;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = j0 + wid; j < j1; j += nw) {
        const float *kn = kN + ((size_t)j * Ha + h) * dn, *kr = kR + (size_t)j * dr;
        float d = 0.0f;
        for (int i = lane; i < dn; i += 32) d += qn[i] * kn[i];
        for (int i = lane; i < dr; i += 32) d += qp[i] * kr[i];
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0) sc[j - j0] = d * scale;
    }
    __syncthreads();
    float sum;
    const float mx = exp_shifted(sc, j1 - j0, &sum);
    for (int i = threadIdx.x; i < dvh; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = j0; j < j1; j++) acc += sc[j - j0] * v[((size_t)j * Ha + h) * dvh + i];
        po[i] = acc;
    }
    if (threadIdx.x == 0) pml[0] = mx, pml[1] = sum;
}

/* ---- expanded MLA through tensor cores (long prefill segments) -----------------------------
 * Per chunk of query rows, per head (one strided-batched cuBLAS call for all heads): scores
 * S_h = Q_h K_h^T with K_h = [kN_h | kR], a row softmax (causal, scaled) into BF16 P, then
 * O_h = P_h V_h. Operands in BF16 with F32 accumulation; the context a chunk can see bounds both
 * GEMMs, so the causal half is never computed. */
extern "C" void ds_cu_set_mla_gemm(ds_cu *c, int on) {
    c->mla_gemm = on;
}

enum { MLA_GEMM_MIN_ROWS = 128 };

/* Kb[j][h][:] = bf16([kN[j][h][0..dn) | kR[j][0..dr)]): a block a key row j (grid-stride) */
__global__ void mla_kcat_k(__nv_bfloat16 *Kb, const float *kN, const float *kR, int C, int Ha,
                           int dn, int dr) {
    PDL_ENTRY();
    const int dq = dn + dr;
    for (int j = blockIdx.x; j < C; j += gridDim.x) {
        __nv_bfloat16 *kb = Kb + (size_t)j * Ha * dq;
        const float *kn = kN + (size_t)j * Ha * dn, *kr = kR + (size_t)j * dr;
        for (int e = threadIdx.x; e < Ha * dq; e += blockDim.x) {
            const int h = e / dq, c = e - h * dq;
            kb[e] = __float2bfloat16_rn(c < dn ? kn[h * dn + c] : kr[c - dn]);
        }
    }
}

/* P[h][t][j] = softmax_j(scale S[h][t][j]) over the j < n(t) a query may see, zero after: block
 * (t, h) of a chunk whose first query sits at position p0. */
__global__ void mla_softmax_k(__nv_bfloat16 *P, const float *S, int Tq, int Ce, int p0, int n_ctx,
                              int causal, float scale) {
    PDL_ENTRY();
    const int t = blockIdx.x, h = blockIdx.y;
    const float *sr = S + ((size_t)h * Tq + t) * Ce;
    __nv_bfloat16 *pr = P + ((size_t)h * Tq + t) * Ce;
    const int n = causal ? min(p0 + t + 1, min(n_ctx, Ce)) : min(n_ctx, Ce);
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, sr[j] * scale);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += expf(sr[j] * scale - mx);
    const float inv = 1.0f / block_sum(s);
    for (int j = threadIdx.x; j < Ce; j += blockDim.x)
        pr[j] = __float2bfloat16_rn(j < n ? expf(sr[j] * scale - mx) * inv : 0.0f);
}

/* ---- expanded MLA in one fused kernel (flash attention) --------------------------------------
 * The cuBLAS path above writes every score (f32) and probability (BF16) of a chunk to memory and
 * reads them back: at 8192 tokens x 32 heads that traffic, not the products, was its time
 * (bench/RESULTS.md session 6). Here block (64 query rows, head) keeps everything on chip: its 4
 * warps hold 16 query rows each as BF16 tensor-core fragments (mma.sync m16n8k16, f32
 * accumulation), walk the visible keys in tiles of 64, and keep the running maximum, sum and output
 * of each row in registers (online softmax). The tiles of keys and values go by cp.async into one
 * of two stages as they lie in memory (rows past C zero-filled), the next on its way while this one
 * is multiplied, and the fragments come out by ldmatrix — K's as stored, V's transposed by
 * ldmatrix.trans. (Staged by plain loads and stores, V transposed by the stores, the kernel was
 * a third slower at 8192 tokens x 32 heads, the same bits: bench/RESULTS.md session 10.) The same
 * BF16 rounding of Q, K, V and P as the cuBLAS path.
 * Fragment layouts as the PTX ISA gives them for m16n8k16: lane = 4 g + l4 holds A's rows g and
 * g + 8 at columns 2 l4 (+1) and 2 l4 + 8 (+1); B's column g at rows 2 l4 (+1) and 2 l4 + 8
 * (+1); C's rows g and g + 8 at columns 2 l4 (+1). */
enum { FL_BQ = 64 }; /* (FL_BK keys a tile: mla.cuh) */

template <int DQ, int DV> struct fl_smem {
    static constexpr int KLD = DQ + 8, VLD = DV + 8; /* row strides 4 banks apart: conflict-free */
    static constexpr int K_ELEMS = FL_BK * KLD, V_ELEMS = FL_BK * VLD;
    static constexpr size_t BYTES = (size_t)2 * (K_ELEMS + V_ELEMS) * sizeof(uint16_t);
};

/* o [T][Ha][DV] f32 from Qb [T][Ha][DQ], Kb [C][Ha][DQ], Vb [C][Ha][DV] (BF16); query t sits at
 * position p0 + t and, causal, sees keys j <= p0 + t (and j < C); p0 may be negative (a block of
 * keys that starts after some queries: those see none of it). lse [T][Ha] or NULL: each row's
 * log-sum-exp of its scaled scores (-inf for a row that saw no key), so that blocks of keys
 * attended one at a time can be merged (ds_cu_mla_merge_lse). */
/* long: the online softmax keeps each row's maximum, sum and output fragments in registers
 * across the pipelined tiles of keys. */
template <int DQ, int DV>
__global__ void __launch_bounds__(128)
    mla_flash_k(float *o, float *lse, const uint16_t *Qb, const uint16_t *Kb, const uint16_t *Vb,
                int T, int C, int Ha, int p0, int causal, float scale) {
    PDL_ENTRY();
    typedef fl_smem<DQ, DV> L;
    constexpr int KP = DQ / 8, VP = DV / 8; /* 16-byte pieces of a key row, of a value row */
    /* threads (8 warps sharing each tile, 128 query rows, measured slower: RESULTS session 10) */
    constexpr int NT = 128;
    static_assert((FL_BK * KP) % NT == 0 && (FL_BK * VP) % NT == 0, "tile split");
    static_assert(FL_BK % 16 == 0 && DQ % 16 == 0 && DV % 16 == 0, "ldmatrix tiles");
    extern __shared__ __align__(16) uint16_t fsh[];
    uint16_t *Ks = fsh;                  /* [2][FL_BK][KLD] keys as stored */
    uint16_t *Vs = fsh + 2 * L::K_ELEMS; /* [2][FL_BK][VLD] values as stored */
    /* the longest (last) query blocks first: causal work grows with the position */
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, q0 = qb * FL_BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, l4 = lane & 3;
    const size_t qs = (size_t)Ha * DQ, vs = (size_t)Ha * DV;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8; /* this thread's two query rows */
    const int last = min(q0 + FL_BQ, T) - 1;
    const int n_end = fl_keys(last, T, C, p0, causal);
    /* tile kb into stage st: every thread's pieces in flight at once */
    auto stage = [&](int kb, int st) {
        uint16_t *ks = Ks + st * L::K_ELEMS, *vsm = Vs + st * L::V_ELEMS;
#pragma unroll
        for (int x = 0; x < FL_BK * KP / NT; x++) {
            const int i = tid + x * NT, j = i / KP, c8 = i % KP, row = kb + j;
            cp_async16_zfill(ks + j * L::KLD + c8 * 8,
                             Kb + (size_t)min(row, C - 1) * qs + (size_t)h * DQ + c8 * 8, row < C);
        }
#pragma unroll
        for (int x = 0; x < FL_BK * VP / NT; x++) {
            const int i = tid + x * NT, j = i / VP, d8 = i % VP, row = kb + j;
            cp_async16_zfill(vsm + j * L::VLD + d8 * 8,
                             Vb + (size_t)min(row, C - 1) * vs + (size_t)h * DV + d8 * 8, row < C);
        }
        cp_async_commit();
    };
    if (n_end > 0) stage(0, 0); /* on its way while the queries load */
    uint32_t qf[DQ / 16][4];    /* the warp's queries as A fragments */
    fl_load_q<DQ>(qf, Qb, r0, r1, T, Ha, h, l4);
    /* keys each row may see (none for rows past T) */
    const int lim0 = fl_keys(r0, T, C, p0, causal);
    const int lim1 = fl_keys(r1, T, C, p0, causal);
    float oacc[DV / 8][4];
    fl_zero<DV>(oacc);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    /* ldmatrix: lane L gives the address of row L % 8 of matrix L / 8 */
    const int mi = lane >> 3, mr = lane & 7;
    for (int kb = 0, it = 0; kb < n_end; kb += FL_BK, it++) {
        const int st = it & 1;
        if (kb + FL_BK < n_end) { /* the next tile into the other stage, then wait for this one */
            stage(kb + FL_BK, st ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
        const uint16_t *ks = Ks + st * L::K_ELEMS, *vsm = Vs + st * L::V_ELEMS;
        float sc[FL_BK / 8][4]; /* scores: rows r0 (0, 1) and r1 (2, 3), keys kb + 8 t + 2 l4 */
#pragma unroll
        for (int t = 0; t < FL_BK / 8; t++) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQ / 16; kk++)
#pragma unroll
            for (int t = 0; t < FL_BK / 8; t += 2) {
                /* matrices: keys of tile t (+1 for mi >= 2), channels kk 16 (+8 for odd mi) */
                uint32_t b[4];
                ldsm_x4(b, ks + ((t + (mi >> 1)) * 8 + mr) * L::KLD + kk * 16 + (mi & 1) * 8);
                mma_16816(sc[t], qf[kk], b[0], b[1]);
                mma_16816(sc[t + 1], qf[kk], b[2], b[3]);
            }
        /* masks, the online softmax and the output's rescale (mla.cuh); P V: the score tiles 2 kk
         * and 2 kk + 1 are the A fragment of keys [16 kk, +16) */
        float a0, a1;
        uint32_t pas[FL_BK / 16][4];
        fl_softmax(sc, m0, m1, l0, l1, a0, a1, kb, lim0, lim1, l4, scale);
        fl_rescale<DV>(oacc, a0, a1);
        fl_pack(sc, pas);
#pragma unroll
        for (int kk = 0; kk < FL_BK / 16; kk++) {
            const uint32_t(&pa)[4] = pas[kk];
#pragma unroll
            for (int n = 0; n < DV / 8; n += 2) {
                /* matrices: keys kk 16 (+8 for odd mi), value columns of tile n (+1 for mi >= 2),
                 * transposed: lane 4 g + l4 gets keys 2 l4, 2 l4 + 1 of column g */
                uint32_t b[4];
                ldsm_x4_trans(b,
                              vsm + (kk * 16 + (mi & 1) * 8 + mr) * L::VLD + (n + (mi >> 1)) * 8);
                mma_16816(oacc[n], pa, b[0], b[1]);
                mma_16816(oacc[n + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads(); /* this stage is refilled two tiles on */
    }
    fl_store<DV>(o, lse, oacc, m0, m1, l0, l1, r0, r1, T, Ha, h, l4);
}

extern "C" void ds_cu_set_mla_flash(ds_cu *c, int mode) {
    c->mla_flash = mode >= 2 && mode <= 4 ? mode : mode > 0; /* (4: two, pipelined) */
}

static int mla_expanded_gemm(ds_cu *c, float *o, float *lse, const float *q, const float *kN,
                             const float *kR, const float *v, int T, int n_ctx, int Ha, int dn,
                             int dr, int dvh, int pos0, int causal, float scale, ds_err *err) {
    const int dq = dn + dr, C = n_ctx;
    const int flash = c->mla_flash && dq == 192 && dvh == 128; /* Kimi's MLA (the instance) */
    /* query rows per chunk: S (f32) and P (bf16) of all heads within ~1.5 GB */
    const int Tq = (int)DS_MAX(1, DS_MIN((size_t)T, ((size_t)3 << 29) / ((size_t)Ha * C * 6)));
    /* Kb [C][Ha][dq], Vb [C][Ha][dvh], Qb [T][Ha][dq] bf16 | S [Ha][Tq][C] f32 | P likewise bf16
     * (the last two not with the fused kernel) */
    const size_t sz[5] = {(size_t)C * Ha * dq * 2, (size_t)C * Ha * dvh * 2,
                          (size_t)T * Ha * dq * 2, (size_t)Ha * Tq * C * 4,
                          (size_t)Ha * Tq * C * 2};
    void *b[5];
    if (carve_scratch(c, &c->mlag, &c->mlag_bytes, sz, b, flash ? 3 : 5, "mla gemm scratch", err))
        return DS_ERR;
    __nv_bfloat16 *Kb = (__nv_bfloat16 *)b[0], *Vb = (__nv_bfloat16 *)b[1];
    __nv_bfloat16 *Qb = (__nv_bfloat16 *)b[2], *P = (__nv_bfloat16 *)b[4];
    float *S = (float *)b[3];
    launch_k(c, mla_kcat_k, (unsigned)DS_MIN(C, 1 << 20), 256, 0, Kb, kN, kR, C, Ha, dn, dr);
    CU_TRY(cudaGetLastError(), "mla gemm: keys");
    round_rows(c, Vb, v, Ha * dvh, Ha * dvh, C);
    round_rows(c, Qb, q, Ha * dq, Ha * dq, T);
    CU_TRY(cudaGetLastError(), "mla gemm: values, queries");
    if (flash && c->mla_flash >= 2 && c->sm90) /* wgmma: 1, 2 warpgroups a block, pipelined */
        return mla_flash_wg_launch(c, o, lse, (const uint16_t *)Qb, (const uint16_t *)Kb,
                                   (const uint16_t *)Vb, T, C, Ha, pos0, causal, scale,
                                   c->mla_flash - 1, err);
    if (flash) {
        if (!c->mla_flash_smem) { /* once: prefills are never captured */
            CU_TRY(cudaFuncSetAttribute(mla_flash_k<192, 128>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)fl_smem<192, 128>::BYTES),
                   "mla (fused): shared memory");
            c->mla_flash_smem = 1;
        }
        launch_k(c, mla_flash_k<192, 128>, dim3((unsigned)((T + FL_BQ - 1) / FL_BQ), (unsigned)Ha),
                 128, fl_smem<192, 128>::BYTES, o, lse, (const uint16_t *)Qb, (const uint16_t *)Kb,
                 (const uint16_t *)Vb, T, C, Ha, pos0, causal, scale);
        CU_TRY(cudaGetLastError(), "mla (fused)");
        return DS_OK;
    }
    if (lse) return ds_errf(err, "cuda: mla: log-sum-exp rows come from the fused kernel only");
    const float one = 1.0f, zero = 0.0f;
    for (int t0 = 0; t0 < T; t0 += Tq) {
        const int tq = DS_MIN(Tq, T - t0);
        const int Ce = causal ? DS_MIN(C, pos0 + t0 + tq) : C; /* what this chunk can see */
        if (Ce <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
        /* S_h^T (Ce x tq, column-major) = K_h (Ce x dq) Q_h^T: rows of K and Q are Ha*dq apart */
        BLAS_TRY(cublasGemmStridedBatchedEx(
                     c->blas, CUBLAS_OP_T, CUBLAS_OP_N, Ce, tq, dq, &one, Kb, CUDA_R_16BF, Ha * dq,
                     (long long)dq, Qb + (size_t)t0 * Ha * dq, CUDA_R_16BF, Ha * dq, (long long)dq,
                     &zero, S, CUDA_R_32F, Ce, (long long)tq * Ce, Ha, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
                 "mla gemm: scores");
        launch_k(c, mla_softmax_k, dim3((unsigned)tq, (unsigned)Ha), 256, 0, P, S, tq, Ce,
                 pos0 + t0, n_ctx, causal, scale);
        CU_TRY(cudaGetLastError(), "mla gemm: softmax");
        /* O_h^T (dvh x tq) = V_h^T (dvh x Ce) P_h^T (Ce x tq); O rows are Ha*dvh apart */
        BLAS_TRY(cublasGemmStridedBatchedEx(
                     c->blas, CUBLAS_OP_N, CUBLAS_OP_N, dvh, tq, Ce, &one, Vb, CUDA_R_16BF,
                     Ha * dvh, (long long)dvh, P, CUDA_R_16BF, Ce, (long long)tq * Ce, &zero,
                     o + (size_t)t0 * Ha * dvh, CUDA_R_32F, Ha * dvh, (long long)dvh, Ha,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "mla gemm: values");
    }
    return DS_OK;
}

extern "C" int ds_cu_mla_attend_expanded(ds_cu *c, float *o, const float *q, const float *kN,
                                         const float *kR, const float *v, int T, int n_ctx, int Ha,
                                         int dn, int dr, int dvh, int pos0, int causal, float scale,
                                         ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    if (c->mla_gemm && !c->batch_invariant && T >= MLA_GEMM_MIN_ROWS)
        return mla_expanded_gemm(c, o, NULL, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, causal,
                                 scale, err);
    const int n_max = causal ? DS_MIN(pos0 + T, n_ctx) : n_ctx;
    if (n_max <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    const int n_split = (n_max + MLA_CHUNK - 1) / MLA_CHUNK, rows = T * Ha;
    size_t need = (size_t)rows * n_split * ((size_t)dvh + 2);
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                     err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * dvh;
    launch_k(c, mla_exp_split_k, dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml,
             q, kN, kR, v, Ha, dn, dr, dvh, pos0, n_ctx, causal, scale, n_split);
    CU_TRY(cudaGetLastError(), "mla expanded");
    mla_merge(c, o, part_o, part_ml, rows, dvh, n_split);
    CU_TRY(cudaGetLastError(), "mla expanded merge");
    return DS_OK;
}

/* Whether the fused kernel, the one form that gives each row's log-sum-exp, serves this head
 * shape (ds_cu_mla_attend_expanded_lse runs it for any number of rows: below
 * MLA_GEMM_MIN_ROWS the split kernel is the faster choice for a whole context, but a long
 * context's blocks need the merge). Not in the batch-invariant mode, whose split sums do not
 * depend on the context's length being cut. */
extern "C" int ds_cu_mla_lse_ok(const ds_cu *c, int T, int dn, int dr, int dvh) {
    return T > 0 && c->mla_gemm && c->mla_flash && !c->batch_invariant && dn + dr == 192 &&
           dvh == 128;
}

extern "C" int ds_cu_mla_attend_expanded_lse(ds_cu *c, float *o, float *lse, const float *q,
                                             const float *kN, const float *kR, const float *v,
                                             int T, int n_ctx, int Ha, int dn, int dr, int dvh,
                                             int pos0, int causal, float scale, ds_err *err) {
    if (!ds_cu_mla_lse_ok(c, T, dn, dr, dvh))
        return ds_errf(err, "cuda: mla: %d rows of heads %d + %d -> %d have no fused kernel", T, dn,
                       dr, dvh);
    if (T <= 0 || Ha <= 0 || n_ctx <= 0) return DS_OK;
    return mla_expanded_gemm(c, o, lse, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, causal,
                             scale, err);
}

/* Block (row q): o[q] and lse[q] (the keys so far) take in ob[q] and lb[q] (the next block's):
 * weights e^{lse - new} with new = log(e^lse + e^lb); a side that saw no key (-inf) weighs 0. */
__global__ void mla_merge_lse_k(float *o, float *lse, const float *ob, const float *lb, int dvh) {
    PDL_ENTRY();
    const size_t q = blockIdx.x;
    const float a = lse[q], b = lb[q];
    const float mx = fmaxf(a, b);
    const float nw = mx == -INFINITY ? -INFINITY : mx + logf(expf(a - mx) + expf(b - mx));
    const float wa = a == -INFINITY ? 0.0f : expf(a - nw),
                wb = b == -INFINITY ? 0.0f : expf(b - nw);
    for (int i = threadIdx.x; i < dvh; i += blockDim.x)
        o[q * dvh + i] = o[q * dvh + i] * wa + ob[q * dvh + i] * wb;
    __syncthreads(); /* every thread has read lse[q] */
    if (threadIdx.x == 0) lse[q] = nw;
}

extern "C" int ds_cu_mla_merge_lse(ds_cu *c, float *o, float *lse, const float *ob, const float *lb,
                                   int rows, int dvh, ds_err *err) {
    if (rows <= 0) return DS_OK;
    launch_k(c, mla_merge_lse_k, (unsigned)rows, 128, 0, o, lse, ob, lb, dvh);
    CU_TRY(cudaGetLastError(), "mla merge (log-sum-exp)");
    return DS_OK;
}

extern "C" void ds_cu_set_mla_ctx_block(ds_cu *c, int rows) {
    c->mla_ctx_block = rows > 0 ? rows : 0;
}

extern "C" int ds_cu_mla_ctx_block(const ds_cu *c) {
    return c->mla_ctx_block;
}
