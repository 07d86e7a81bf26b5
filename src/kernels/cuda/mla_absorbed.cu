/* mla_absorbed.cu — MLA attention in the absorbed form over the paged latent cache (decode):
 * split over the context and merged, or all heads of a token in one block. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mla.cuh"

/* ---- MLA, absorbed, over the paged latent cache ---------------------------------------------
 * Split over the context (flash-decoding): block (query row q = t*Ha + h, split s) takes rows
 * [s*MLA_CHUNK, ...) of what q sees: their scores in shared memory (a warp per row, lanes across
 * the R + dr latent entries), its own max m and sum l of exp(score - m), and the unnormalised
 * partial o = sum exp(score - m) c over its rows (threads across R). A second kernel merges the
 * splits: M = max m_s, o = sum o_s e^{m_s - M} / sum l_s e^{m_s - M}. Every head still reads the
 * rows on its own (an all-heads block was tried and measured slower: bench/RESULTS.md). */

/* BATCH: query token t belongs to its own sequence, at position tok_pos[t] with its block table
 * at table + tok_bt[t] (causal); otherwise one sequence, pos0 / n_ctx / causal as given.
 * V: floats per load (4 when R, dr and row are multiples of 4: a row is then 16-byte aligned).
 * A decode step attends over a few hundred rows per head, so this kernel is bound by load latency,
 * not bandwidth: at batch 1 of the 48B shape the first version (a warp per row, one 4-byte word
 * per lane per trip, a trip per 32 words) waited on those trips (bench/RESULTS.md session 9).
 * Each lane now issues all its loads for MLA_RW rows before using any (MLA_KV vectors per row per
 * trip), and the output pass has every thread sum 16-byte columns over a share of the rows with
 * many loads in flight, the shares added in a fixed order. */
enum { MLA_RW = 4, MLA_KV = 5 }; /* rows a warp scores at once; vectors a lane loads per row */
template <int V> __device__ __forceinline__ float dot_x(const float *a, const float *y) {
    if constexpr (V == 4) {
        const float4 x = *(const float4 *)a;
        return x.x * y[0] + x.y * y[1] + x.z * y[2] + x.w * y[3];
    } else {
        return *a * *y;
    }
}
/* the latent rows and both query parts can be read as float4 (16-byte aligned) */
static int mla_vec4(int R, int dr, int row, int ldqr, const float *qbar, const float *qr,
                    const void *pool) {
    return R % 4 == 0 && dr % 4 == 0 && row % 4 == 0 && ldqr % 4 == 0 &&
           ((uintptr_t)qbar | (uintptr_t)qr | (uintptr_t)pool) % 16 == 0;
}
/* KV: the rows' dtype (DS_KV_*), `row` their stride: floats for f32 rows, bytes for the others. */
template <bool BATCH, int V, int KV>
__global__ void __launch_bounds__(256, 4) /* 4 blocks an SM: a batch-1 step's 512 in one wave */
    mla_split_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr, int Ha,
                int R, int dr, const void *pool, const int32_t *table, int bs, int row, int pos0,
                int n_ctx, int causal, float scale, int n_split, const int32_t *tok_bt,
                const int32_t *tok_pos, int chunk) {
    __shared__ float sc[MLA_CHUNK];  /* chunk <= MLA_CHUNK rows per split */
    __shared__ size_t ro[MLA_CHUNK]; /* where each of those rows starts in the pool */
    __shared__ float red[256 * V]; /* [groups][R] the output pass's shares (groups * R <= 256 V) */
    const int q = blockIdx.x, t = q / Ha, s = blockIdx.y, tid = threadIdx.x;
    /* Before waiting for the previous kernel (PDL): the positions and block tables (the host
     * uploads them before a step; no kernel writes them) and from them the split's row offsets.
     * (An L2 prefetch of the rows here as well was measured slower: bench/RESULTS.md.) */
    int n;
    if (BATCH) {
        n = __ldcg(tok_pos + t) + 1;
        table += __ldcg(tok_bt + t);
    } else {
        n = causal ? min(pos0 + t + 1, n_ctx) : n_ctx; /* never past the cache's rows */
    }
    const int j0 = s * chunk, j1 = min(n, j0 + chunk);
    for (int j = j0 + tid; j < j1; j += blockDim.x)
        ro[j - j0] = ((size_t)__ldcg(table + j / bs) * bs + j % bs) * row;
    PDL_ENTRY();
    __syncthreads(); /* ro[] is the block's */
    float *po = part_o + ((size_t)q * n_split + s) * R,
          *pml = part_ml + ((size_t)q * n_split + s) * 2;
    if (j0 >= j1) { /* nothing visible in this split: an empty partial */
        for (int i = tid; i < R; i += blockDim.x) po[i] = 0.0f;
        if (tid == 0) pml[0] = -INFINITY, pml[1] = 0.0f;
        return;
    }
    const float *qb = qbar + (size_t)q * R, *qp = qr + (size_t)q * ldqr;
    const int lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5, nv = (R + dr) / V, nvb = R / V;
    /* a warp scores rows jb .. jb + MLA_RW - 1; each row's sum in a fixed order */
    for (int jb = j0 + wid * MLA_RW; jb < j1; jb += nw * MLA_RW) {
        size_t at[MLA_RW];
        float d[MLA_RW];
#pragma unroll
        for (int r = 0; r < MLA_RW; r++) at[r] = ro[min(jb + r, j1 - 1) - j0], d[r] = 0.0f;
        for (int v0 = 0; v0 < nv; v0 += 32 * MLA_KV)
#pragma unroll
            for (int k = 0; k < MLA_KV; k++) {
                const int v = v0 + 32 * k + lane;
                if (v < nv) {
                    const float *qv = v < nvb ? qb + (size_t)v * V : qp + (size_t)(v - nvb) * V;
                    float y[MLA_RW][V];
#pragma unroll
                    for (int r = 0; r < MLA_RW; r++)
                        kv_row_vals<KV, V>(pool, at[r], R, v * V, y[r]);
#pragma unroll
                    for (int r = 0; r < MLA_RW; r++) d[r] += dot_x<V>(qv, y[r]);
                }
            }
#pragma unroll
        for (int r = 0; r < MLA_RW; r++) {
            float x = d[r];
            for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            const int j = jb + r;
            if (lane == 0 && j < j1) sc[j - j0] = x * scale;
        }
    }
    __syncthreads();
    float sum;
    const float mx = exp_shifted(sc, j1 - j0, &sum);
    /* o = sum_j sc[j] c_j: threads across the R / V column vectors, the block's remaining threads
     * in `groups` row shares (rows g, g + groups, ...), added in order of g */
    const int nj = j1 - j0, ncv = R / V, across = min(ncv, (int)blockDim.x),
              groups = blockDim.x / across, g = tid / across;
    if (g < groups)
        for (int cv = tid % across; cv < ncv; cv += across) {
            float acc[V];
#pragma unroll
            for (int e = 0; e < V; e++) acc[e] = 0.0f;
#pragma unroll 16
            for (int jj = g; jj < nj; jj += groups) {
                const float p = sc[jj];
                float x[V];
                kv_row_vals<KV, V>(pool, ro[jj], R, cv * V, x);
#pragma unroll
                for (int e = 0; e < V; e++) acc[e] += p * x[e];
            }
#pragma unroll
            for (int e = 0; e < V; e++) {
                if (groups == 1)
                    po[(size_t)cv * V + e] = acc[e];
                else
                    red[(size_t)g * R + (size_t)cv * V + e] = acc[e];
            }
        }
    if (groups > 1) {
        __syncthreads();
        for (int i = tid; i < R; i += blockDim.x) {
            float o = 0.0f;
            for (int gg = 0; gg < groups; gg++) o += red[(size_t)gg * R + i];
            po[i] = o;
        }
    }
    if (tid == 0) pml[0] = mx, pml[1] = sum;
}

/* Block (query row q, 128 outputs blockIdx.y): a thread per output. Its loads over the splits
 * are unrolled so that several are in flight: one at a time, a decode step's merge (16 splits)
 * spent most of its time waiting on L2 in turn (Nsight Compute, bench/RESULTS.md session 9). The
 * sums run in split order. */
enum { MLA_MERGE_THREADS = 128 };
__global__ void __launch_bounds__(MLA_MERGE_THREADS)
    mla_merge_k(float *obar, const float *part_o, const float *part_ml, int R, int n_split) {
    PDL_ENTRY();
    const int q = blockIdx.x, i = blockIdx.y * MLA_MERGE_THREADS + threadIdx.x;
    if (i >= R) return;
    const float *ml = part_ml + (size_t)q * n_split * 2, *po = part_o + (size_t)q * n_split * R + i;
    float M = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < n_split; s++) M = fmaxf(M, ml[2 * s]);
    float L = 0.0f, acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < n_split; s++) {
        const float l = ml[2 * s + 1], o = po[(size_t)s * R];
        if (l > 0.0f) {
            const float e = expf(ml[2 * s] - M);
            L += l * e;
            acc += o * e;
        }
    }
    obar[(size_t)q * R + i] = acc / L;
}

/* The same merge with the splits spread over a block's 8 warps (ds_cu_set_mla_merge_warps): block
 * (query row q, 128 outputs blockIdx.y), lane l of warp w holds outputs 4l..4l+3 of the slice and
 * sums splits w, w + 8, ... in order; the warps' sums are then added in warp order. Why: with a
 * split an SM (mla_decode_tc: 132 splits at one token) a thread of mla_merge_k waits on L2 for
 * n_split / 8 batches of loads in turn, where here each warp waits for n_split / 64. The order
 * of the sums depends on n_split alone, as mla_merge_k's (batch invariance). Needs R % 128 == 0
 * (part_o's rows then 16-byte aligned). */
enum { MLA_MERGE_WARPS = 8 };
__global__ void __launch_bounds__(32 * MLA_MERGE_WARPS)
    mla_merge_w_k(float *obar, const float *part_o, const float *part_ml, int R, int n_split) {
    PDL_ENTRY();
    __shared__ float acc_s[MLA_MERGE_WARPS][128]; /* [warp][output of the slice] */
    __shared__ float l_s[MLA_MERGE_WARPS];        /* [warp]: its share of the softmax's sum */
    const int q = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i0 = blockIdx.y * 128 + 4 * lane;
    const float *ml = part_ml + (size_t)q * n_split * 2;
    const float4 *po = (const float4 *)(part_o + (size_t)q * n_split * R + i0);
    const int R4 = R / 4;
    float M = -INFINITY; /* every warp finds the maximum over all splits */
    for (int s = lane; s < n_split; s += 32) M = fmaxf(M, ml[2 * s]);
#pragma unroll
    for (int o = 16; o; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int s = w; s < n_split; s += MLA_MERGE_WARPS) {
        const float l = ml[2 * s + 1];
        const float4 o = po[(size_t)s * R4];
        if (l > 0.0f) {
            const float e = expf(ml[2 * s] - M);
            L += l * e;
            a.x += o.x * e, a.y += o.y * e, a.z += o.z * e, a.w += o.w * e;
        }
    }
    acc_s[w][4 * lane] = a.x, acc_s[w][4 * lane + 1] = a.y;
    acc_s[w][4 * lane + 2] = a.z, acc_s[w][4 * lane + 3] = a.w;
    if (lane == 0) l_s[w] = L;
    __syncthreads();
    const int t = threadIdx.x;
    if (t < 128 && blockIdx.y * 128 + t < R) {
        float sum = 0.0f, lsum = 0.0f;
#pragma unroll
        for (int k = 0; k < MLA_MERGE_WARPS; k++) sum += acc_s[k][t], lsum += l_s[k];
        obar[(size_t)q * R + blockIdx.y * 128 + t] = sum / lsum;
    }
}

extern "C" void ds_cu_set_mla_merge_warps(ds_cu *c, int on) {
    c->mla_merge_warps = on;
}

void mla_merge(ds_cu *c, float *obar, const float *part_o, const float *part_ml, int rows, int R,
               int n_split) {
    if (c->mla_merge_warps && R % 128 == 0) {
        launch_k(c, mla_merge_w_k, dim3((unsigned)rows, (unsigned)(R / 128)), 32 * MLA_MERGE_WARPS,
                 0, obar, part_o, part_ml, R, n_split);
        return;
    }
    launch_k(c, mla_merge_k,
             dim3((unsigned)rows, (unsigned)((R + MLA_MERGE_THREADS - 1) / MLA_MERGE_THREADS)),
             MLA_MERGE_THREADS, 0, obar, part_o, part_ml, R, n_split);
}

extern "C" int ds_cu_mla_attend_absorbed(ds_cu *c, float *obar, const float *qbar, const float *qr,
                                         int T, int Ha, int R, int dr, const float *pool,
                                         const int32_t *block_table, int block_size, int row,
                                         int pos0, int n_ctx, int causal, float scale,
                                         ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    const int n_max = causal ? DS_MIN(pos0 + T, n_ctx) : n_ctx;
    if (n_max <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    const int n_split = (n_max + MLA_CHUNK - 1) / MLA_CHUNK, rows = T * Ha;
    size_t need = (size_t)rows * n_split * ((size_t)R + 2);
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                     err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
    launch_k(c,
             mla_vec4(R, dr, row, dr, qbar, qr, pool) ? mla_split_k<false, 4, DS_KV_F32>
                                                      : mla_split_k<false, 1, DS_KV_F32>,
             dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml, qbar, qr, dr, Ha, R,
             dr, (const void *)pool, block_table, block_size, row, pos0, n_ctx, causal, scale,
             n_split, (const int32_t *)NULL, (const int32_t *)NULL, (int)MLA_CHUNK);
    CU_TRY(cudaGetLastError(), "mla");
    mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
    CU_TRY(cudaGetLastError(), "mla merge");
    return DS_OK;
}

/* ---- absorbed MLA, all heads of a token in one block ------------------------------------------
 * The block-per-head kernel above reads every latent row once per head (32 times at Ha = 32): at
 * batch 256 that was most of a decode step's traffic. Here block (token t, split s) copies each
 * tile of 16 rows of its split once into shared memory (cp.async) and works on it as two small
 * matrix products held in registers, every head at once:
 *   scores S [Ha][16] = Q [Ha][rq] C [16][rq]^T: thread tiles of 4 heads x 4 rows over a slice of
 *     the rq columns (slices = 256 / Ha lanes side by side, summed by shuffles), 16-byte loads;
 *   an online softmax per head (a half-warp a head: max and sum by shuffles);
 *   O [Ha][R] += P [Ha][16] C [16][R]: thread tiles of 4 heads x OT outputs (4 floats every
 *     4 L apart, L = 1024 / Ha threads a head group, so a warp's loads are consecutive).
 * The version before (a thread a head's outputs, one dot product at a time) issued a scalar
 * shared load for every FMA and waited on shared memory (batch 256, context 512: bench/RESULTS.md
 * session 18).
 * The partials are merged by mla_merge_k as before. */
enum { MLA_AH_THREADS = 256, MLA_AH_SUB = 16, MLA_AH_MIN_ROWS = 64 };

extern "C" void ds_cu_set_mla_all_heads(ds_cu *c, int on) {
    c->mla_all_heads = on;
}

/* Shared memory of mla_allheads_k, floats: q [Ha][rq] | rows [SUB][rq] | p [SUB][Ha] | m, l,
 * alpha [Ha] each. (No padding: a quarter-warp's 16-byte loads are consecutive in every phase.)
 * At Ha = 32, rq = 576: 113 KB, two blocks an SM. */
static size_t mla_ah_floats(int Ha, int rq) {
    return (size_t)(Ha + MLA_AH_SUB) * rq + (size_t)MLA_AH_SUB * Ha + 3 * (size_t)Ha;
}

/* long: the scores, softmax and output passes share the block's staged rows and registers.
 * KV: the rows' dtype (DS_KV_*; `row` their stride in bytes but for f32), FP8 and BF16 ones
 * widened to f32 as they are staged. */
template <int OT, int KV>
__global__ void __launch_bounds__(MLA_AH_THREADS, 2)
    mla_allheads_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr,
                   int Ha, int R, int dr, const void *pool, const int32_t *tables,
                   const int32_t *tok_bt, const int32_t *tok_pos, int bs, int row, float scale,
                   int n_split, int per) {
    PDL_ENTRY();
    extern __shared__ float sh[];
    const int t = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, rq = R + dr, ld = rq;
    float *qs = sh, *cs = qs + (size_t)Ha * ld, *pt = cs + (size_t)MLA_AH_SUB * ld;
    float *m_sh = pt + MLA_AH_SUB * Ha, *l_sh = m_sh + Ha, *a_sh = l_sh + Ha;
    const int32_t *table = tables + tok_bt[t];
    const int n = tok_pos[t] + 1, j0 = s * per, j1 = min(n, j0 + per);
    for (int i = tid; i < Ha * (rq / 4); i += MLA_AH_THREADS) { /* every head's [q̄ | qR] */
        const int hh = i / (rq / 4), c = (i % (rq / 4)) * 4;
        const float *src = c < R ? qbar + ((size_t)t * Ha + hh) * R + c
                                 : qr + ((size_t)t * Ha + hh) * ldqr + c - R;
        *(float4 *)(qs + (size_t)hh * ld + c) = *(const float4 *)src;
    }
    if (tid < Ha) m_sh[tid] = -INFINITY, l_sh[tid] = 0.0f;
    /* the score tile: slice sl of the columns' 16-byte quads, heads 4 th.., rows 4 tr.. */
    const int slices = MLA_AH_THREADS / Ha, sl = tid % slices, tile = tid / slices;
    const int tr = tile % (MLA_AH_SUB / 4), th = tile / (MLA_AH_SUB / 4);
    /* the output tile: heads 4 hg.., floats 4 (lo + L k) .. + 3 for k < OT / 4 */
    const int L = MLA_AH_THREADS / (Ha / 4), hg = tid / L, lo = tid % L;
    float acc[4][OT];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int o = 0; o < OT; o++) acc[i][o] = 0.0f;
    for (int a = j0; a < j1; a += MLA_AH_SUB) {
        const int nr = min(MLA_AH_SUB, j1 - a);
        __syncthreads(); /* the previous tile and its p are used up (and q is staged) */
        for (int i = tid; i < nr * (rq / 4); i += MLA_AH_THREADS) {
            const int j = i / (rq / 4), c = (i % (rq / 4)) * 4, p = a + j;
            const size_t at = ((size_t)table[p / bs] * bs + p % bs) * row;
            if constexpr (KV != DS_KV_F32) {
                float x[4];
                kv_row_vals<KV, 4>(pool, at, R, c, x);
                *(float4 *)(cs + (size_t)j * ld + c) = make_float4(x[0], x[1], x[2], x[3]);
            } else {
                cp_async16(cs + (size_t)j * ld + c, (const float *)pool + at + c);
            }
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        { /* scores */
            float d[4][4] = {};
            for (int q4 = sl; q4 < rq / 4; q4 += slices) {
                float4 qv[4], cv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    qv[i] = *(const float4 *)(qs + (size_t)(4 * th + i) * ld + 4 * q4);
                    cv[i] = *(const float4 *)(cs + (size_t)(4 * tr + i) * ld + 4 * q4);
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        d[i][j] += qv[i].x * cv[j].x + qv[i].y * cv[j].y + qv[i].z * cv[j].z +
                                   qv[i].w * cv[j].w;
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    for (int m = 1; m < slices; m <<= 1)
                        d[i][j] += __shfl_xor_sync(0xffffffffu, d[i][j], m);
            if (sl == 0)
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) { /* raw scores for now, p after the softmax */
                        const int jj = 4 * tr + j;
                        pt[jj * Ha + 4 * th + i] = jj < nr ? d[i][j] * scale : -INFINITY;
                    }
        }
        __syncthreads();
        /* online softmax: a half-warp a head, lane j of it row j */
        for (int h = 2 * (tid / 32) + (tid % 32) / 16; h < Ha; h += 2 * (MLA_AH_THREADS / 32)) {
            const int j = tid % 16;
            const float sc = pt[j * Ha + h];
            float cmax = sc;
            for (int m = 8; m; m >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, m));
            const float m_old = m_sh[h], m_new = fmaxf(m_old, cmax); /* finite: nr >= 1 */
            const float p = j < nr ? expf(sc - m_new) : 0.0f;
            float ps = p;
            for (int m = 8; m; m >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, m);
            pt[j * Ha + h] = p;
            if (j == 0) {
                const float alpha = expf(m_old - m_new); /* 0 at the first tile */
                a_sh[h] = alpha, l_sh[h] = l_sh[h] * alpha + ps, m_sh[h] = m_new;
            }
        }
        __syncthreads();
        { /* outputs */
            const float4 al = *(const float4 *)(a_sh + 4 * hg);
            const float av[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int o = 0; o < OT; o++) acc[i][o] *= av[i];
            for (int j = 0; j < nr; j++) {
                const float4 p4 = *(const float4 *)(pt + j * Ha + 4 * hg);
                const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int k = 0; k < OT / 4; k++) {
                    const float4 c4 = *(const float4 *)(cs + (size_t)j * ld + 4 * (lo + L * k));
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        acc[i][4 * k] += pv[i] * c4.x, acc[i][4 * k + 1] += pv[i] * c4.y;
                        acc[i][4 * k + 2] += pv[i] * c4.z, acc[i][4 * k + 3] += pv[i] * c4.w;
                    }
                }
            }
        }
    }
    /* an empty split leaves zeros, l = 0: the merge skips it */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float *po = part_o + (((size_t)t * Ha + 4 * hg + i) * n_split + s) * R;
#pragma unroll
        for (int k = 0; k < OT / 4; k++)
            *(float4 *)(po + 4 * (lo + L * k)) =
                make_float4(acc[i][4 * k], acc[i][4 * k + 1], acc[i][4 * k + 2], acc[i][4 * k + 3]);
    }
    __syncthreads(); /* (m and l of a split with no rows are their initial values) */
    if (tid < Ha) {
        float *pml = part_ml + (((size_t)t * Ha + tid) * n_split + s) * 2;
        pml[0] = m_sh[tid], pml[1] = l_sh[tid];
    }
}

extern "C" int ds_cu_mla_attend_absorbed_batch(ds_cu *c, float *obar, const float *qbar,
                                               const float *qr, int ldqr, int T, int Ha, int R,
                                               int dr, const void *pool, int kvd,
                                               const int32_t *tables, const int32_t *tok_bt,
                                               const int32_t *tok_pos, int max_ctx, int block_size,
                                               size_t row_bytes, float scale, ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    /* the kernels' row stride: floats for f32 rows, bytes for the others */
    if (kvd != DS_KV_F32 && kvd != DS_KV_FP8 && kvd != DS_KV_BF16)
        return ds_errf(err, "cuda: mla: latent dtype %d", kvd);
    const int row = (int)(kvd == DS_KV_F32 ? row_bytes / sizeof(float) : row_bytes);
    if (max_ctx <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    int done;
    if (mla_decode_tc(c, obar, qbar, qr, ldqr, T, Ha, R, dr, pool, kvd, tables, tok_bt, tok_pos,
                      max_ctx, block_size, row_bytes, scale, &done, err))
        return DS_ERR;
    if (done) return DS_OK;
    const int rows = T * Ha;
    /* all heads per block: splits of `per` rows (a multiple of the 16-row tile, at least 64 so that
     * staging every head's query stays a fraction of the rows read), aiming at two blocks per SM;
     * a step with fewer blocks than SMs (small batches, short contexts) has more parallelism in
     * the block-per-head path, where the re-read latents come from L2 anyway */
    const int want = (2 * c->n_sm + T - 1) / T;
    int per = (max_ctx + want - 1) / want;
    per = max(MLA_AH_MIN_ROWS, (per + MLA_AH_SUB - 1) / MLA_AH_SUB * MLA_AH_SUB);
    const int ah_split = (max_ctx + per - 1) / per;
    /* the kernel's tiles: 4-head groups, 256 / Ha column slices in a warp (Ha a power of two,
     * 8..256), OT = R Ha / 1024 outputs a head a thread (4, 8 or 16 registers' worth) */
    const int ot = (int)((long)R * Ha / 1024);
    const int ah_shape = Ha >= 8 && Ha <= MLA_AH_THREADS && (Ha & (Ha - 1)) == 0 &&
                         (long)R * Ha % 1024 == 0 && (ot == 4 || ot == 8 || ot == 16) &&
                         mla_vec4(R, dr, row, ldqr, qbar, qr, pool);
    const size_t ah_smem = mla_ah_floats(Ha, R + dr) * sizeof(float);
    if (c->mla_all_heads && !c->batch_invariant && ah_shape && ah_smem <= 200 * 1024 &&
        (c->mla_all_heads == 2 || (long)T * ah_split >= c->n_sm)) {
        const int n_split = ah_split;
        size_t need = (size_t)rows * n_split * ((size_t)R + 2);
        if (grow_scratch(c, (void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                         err))
            return DS_ERR;
        float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
        auto kernel = kvd == DS_KV_FP8    ? (ot == 16  ? mla_allheads_k<16, DS_KV_FP8>
                                             : ot == 8 ? mla_allheads_k<8, DS_KV_FP8>
                                                       : mla_allheads_k<4, DS_KV_FP8>)
                      : kvd == DS_KV_BF16 ? (ot == 16  ? mla_allheads_k<16, DS_KV_BF16>
                                             : ot == 8 ? mla_allheads_k<8, DS_KV_BF16>
                                                       : mla_allheads_k<4, DS_KV_BF16>)
                                          : (ot == 16  ? mla_allheads_k<16, DS_KV_F32>
                                             : ot == 8 ? mla_allheads_k<8, DS_KV_F32>
                                                       : mla_allheads_k<4, DS_KV_F32>);
        /* raised once per kernel, before any capture can be open */
        size_t *set = &c->mla_ah_smem[(ot == 16 ? 2 : ot == 8 ? 1 : 0) + 3 * kvd];
        if (ah_smem > *set) {
            CU_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)ah_smem),
                   "mla (all heads): shared memory");
            *set = ah_smem;
        }
        launch_k(c, kernel, dim3((unsigned)T, (unsigned)n_split), MLA_AH_THREADS, ah_smem, part_o,
                 part_ml, qbar, qr, ldqr, Ha, R, dr, pool, tables, tok_bt, tok_pos, block_size, row,
                 scale, n_split, per);
        CU_TRY(cudaGetLastError(), "mla (all heads)");
        mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
        CU_TRY(cudaGetLastError(), "mla merge");
        return DS_OK;
    }
    /* splits of MLA_CHUNK rows, or shorter (down to 32) when a small batch would leave SMs idle:
     * at batch 1 a block per head and 256 rows was bound by latency. Batch
     * invariance keeps MLA_CHUNK: the merge's order must not depend on the batch. */
    int chunk = MLA_CHUNK;
    if (!c->batch_invariant) {
        /* (aiming at 2 or 8 blocks an SM instead: slower or the same, bench/RESULTS.md) */
        const long want = 4L * c->n_sm; /* blocks */
        const long fit = ((long)max_ctx * rows + want - 1) / want;
        chunk = (int)DS_MAX(32L, DS_MIN((long)MLA_CHUNK, (fit + 31) / 32 * 32));
    }
    const int n_split = (max_ctx + chunk - 1) / chunk;
    size_t need = (size_t)rows * n_split * ((size_t)R + 2);
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                     err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
    const int v4 = mla_vec4(R, dr, row, ldqr, qbar, qr, pool);
    auto split = kvd == DS_KV_FP8
                     ? (v4 ? mla_split_k<true, 4, DS_KV_FP8> : mla_split_k<true, 1, DS_KV_FP8>)
                 : kvd == DS_KV_BF16
                     ? (v4 ? mla_split_k<true, 4, DS_KV_BF16> : mla_split_k<true, 1, DS_KV_BF16>)
                     : (v4 ? mla_split_k<true, 4, DS_KV_F32> : mla_split_k<true, 1, DS_KV_F32>);
    launch_k(c, split, dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml, qbar, qr,
             ldqr, Ha, R, dr, pool, tables, block_size, row, 0, 0, 1, scale, n_split, tok_bt,
             tok_pos, chunk);
    CU_TRY(cudaGetLastError(), "mla (batch)");
    mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
    CU_TRY(cudaGetLastError(), "mla merge");
    return DS_OK;
}
