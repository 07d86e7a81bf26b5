/* sample.cu — sampling on the device: greedy (argmax keys) and the draw (ds_sample_row's
 * definition, kernels/shared/draw_exp.h), a block a row. */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/draw_exp.h"

/* ---- greedy sampling ---------------------------------------------------------------------------
 * ds_argmax in one pass: each element becomes a 64-bit key, its value's bits ordered as the floats
 * are (above) and its index inverted (below), so the largest key is the largest value at its
 * lowest index; NaN is key 0, which never wins, and a row of NaN gives 0. -0 becomes +0 first,
 * since ds_argmax finds them equal. A block takes one part of a row (ds_cu_argmax_parts), 4 loads
 * in flight a thread; the host takes the largest of a row's part keys (ds_cu_argmax_token). */
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    if (v != v) return 0ull;
    if (v == 0.0f) v = 0.0f;
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* -inf is 0x007fffff: above NaN's 0 */
    return ((unsigned long long)u << 32) | (unsigned)~i;
}

enum { ARGMAX_THREADS = 256, ARGMAX_MIN_PART = 4096 };

__global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_k(unsigned long long *keys, const float *x, int V, int part_len) {
    PDL_ENTRY();
    const float *xr = x + (size_t)blockIdx.y * V;
    const int nt = ARGMAX_THREADS, end = min(V, (blockIdx.x + 1) * part_len);
    unsigned long long best = 0ull;
    int i = blockIdx.x * part_len + threadIdx.x;
    for (; i + 3 * nt < end; i += 4 * nt) {
        const float v0 = xr[i], v1 = xr[i + nt], v2 = xr[i + 2 * nt], v3 = xr[i + 3 * nt];
        best = max(max(best, argmax_key(v0, i)), argmax_key(v1, i + nt));
        best = max(max(best, argmax_key(v2, i + 2 * nt)), argmax_key(v3, i + 3 * nt));
    }
    for (; i < end; i += nt) best = max(best, argmax_key(xr[i], i));
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ unsigned long long red[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) red[wid] = best;
    __syncthreads();
    if (threadIdx.x) return;
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) best = max(best, red[w]);
    keys[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = best;
}

extern "C" int ds_cu_argmax_parts(int rows, int V) {
    /* two blocks an SM of an H200 (132), parts of at least ARGMAX_MIN_PART values */
    const int want = (264 + rows - 1) / DS_MAX(rows, 1);
    return DS_MAX(1, DS_MIN(want, (V + ARGMAX_MIN_PART - 1) / ARGMAX_MIN_PART));
}

extern "C" void ds_cu_argmax_rows(ds_cu *c, uint64_t *keys, const float *x, int rows, int V,
                                  int parts) {
    if (rows <= 0 || V <= 0 || parts <= 0) return;
    const int part_len = (V + parts - 1) / parts;
    launch_k(c, argmax_k, dim3((unsigned)parts, (unsigned)rows), ARGMAX_THREADS, 0,
             (unsigned long long *)keys, x, V, part_len);
    note_launch(c);
}

/* ---- sampling ------------------------------------------------------------------------------
 * ds_sample_row's definition (engine/sampler.c, draw()) computed by one block of DRAW_THREADS a
 * row: the same float operations for the edits and the weights (every one rounded as written:
 * no contraction into FMAs), integer masses, so every sum is exact and no order of adding
 * changes a bit. The kept prefix of the candidate order (logit descending, id ascending) is
 * found by radix selection over the logits' ordered bits, a byte a pass (counts for top-k,
 * masses for top-p), and the ties at the boundary in id order; the draw is the first id, in id
 * order, whose prefix mass passes floor(u * S). The weights are stored once and re-read. */
enum { DRAW_THREADS = 1024, DRAW_WARPS = DRAW_THREADS / 32 };

/* the CPU sampler's exp_nonpos (kernels/shared/draw_exp.h) */
__device__ __forceinline__ float draw_exp(float x) {
    return ds_exp_nonpos(x);
}

__device__ __forceinline__ unsigned long long draw_mass(float w) {
    return (unsigned long long)__float2ll_rz(__fmul_rn(w, 0x1p40f)); /* sampler.c's mass_of */
}

/* a logit's place in the candidate order: larger first; -0 and +0 equal (candidates hold no NaN) */
__device__ __forceinline__ unsigned draw_key(float v) {
    if (v == 0.0f) v = 0.0f;
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct draw_bound { /* ids up to here in the candidate order: key > k, or key == k and id <= id */
    unsigned k;
    int id;
    bool on;
};
__device__ __forceinline__ bool draw_within(const draw_bound &b, unsigned key, int i) {
    return !b.on || key > b.k || (key == b.k && i <= b.id);
}

/* v summed over the block (every thread gets it). */
__device__ unsigned long long draw_block_sum(unsigned long long v, unsigned long long *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long t = 0;
    for (int w = 0; w < DRAW_WARPS; w++) t += red[w]; /* exact: the order is immaterial */
    return t;
}

/* What element i (logit xi, weight wi) adds in a pass: MODE 0 a count, 1 its mass (both only for
 * candidates inside lim whose key matches pre under pmask), 2 its mass when also wi >= min_w. */
template <int MODE>
__device__ __forceinline__ unsigned long long draw_val(float xi, float wi, int i,
                                                       const draw_bound &lim, unsigned pre,
                                                       unsigned pmask, float min_w) {
    const unsigned long long m = draw_mass(wi);
    if (!m) return 0;
    const unsigned key = draw_key(xi);
    if ((key & pmask) != pre || !draw_within(lim, key, i)) return 0;
    if (MODE == 2 && !(wi >= min_w)) return 0;
    return MODE == 0 ? 1ull : m;
}

/* The elements a thread takes in order for draw_find: a contiguous run of `per` ids (a multiple
 * of 4 when V is, so that the run is read as float4). */
__device__ __forceinline__ int draw_per(int V) {
    const int per = (V + DRAW_THREADS - 1) / DRAW_THREADS;
    return (V & 3) ? per : (per + 3) & ~3;
}

/* The first id, in id order, whose inclusive prefix of draw_val passes r (r < the row's total):
 * each thread sums its run, a block scan of the runs finds the thread that holds r, and that
 * thread walks its run. Loads are independent of the sums, so they stay in flight. */
template <int MODE>
__device__ int draw_find(const float *x, const float *w, int V, const draw_bound &lim, unsigned pre,
                         unsigned pmask, float min_w, unsigned long long r, unsigned long long *red,
                         int *found) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, per = draw_per(V);
    const int i0 = min(V, threadIdx.x * per), i1 = min(V, i0 + per);
    unsigned long long tot = 0;
    if (!(V & 3)) {
        const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 4
        for (int j = i0 >> 2; j < i1 >> 2; j++) {
            const float4 a = x4[j], b = w4[j];
            const int i = 4 * j;
            tot += draw_val<MODE>(a.x, b.x, i, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.y, b.y, i + 1, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.z, b.z, i + 2, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.w, b.w, i + 3, lim, pre, pmask, min_w);
        }
    } else {
#pragma unroll 4
        for (int i = i0; i < i1; i++) tot += draw_val<MODE>(x[i], w[i], i, lim, pre, pmask, min_w);
    }
    unsigned long long inc = tot; /* inclusive scan over the warp, then the warps before */
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) red[wid] = inc;
    if (threadIdx.x == 0) *found = -1;
    __syncthreads();
    unsigned long long acc = inc - tot;
    for (int v = 0; v < wid; v++) acc += red[v];
    if (tot && r >= acc && r < acc + tot) /* this thread holds it */
        for (int i = i0; i < i1; i++) {
            acc += draw_val<MODE>(x[i], w[i], i, lim, pre, pmask, min_w);
            if (r < acc) {
                *found = i;
                break;
            }
        }
    __syncthreads();
    return *found;
}

/* A logit's coarse bin for draw_select: 256 bins over the candidates' span of logits (a weight
 * of at least 2^-40 is (x - max) / T >= -27.73), in the candidate order — monotone in the key,
 * equal logits in one bin. Only a guide: the exact key decides within the bin. */
__device__ __forceinline__ unsigned draw_cbin(float xi, float mx, float scale) {
    const float d = __fmul_rn(__fsub_rn(mx, xi), scale);
    return d < 255.0f ? (unsigned)d : 255u;
}

/* Radix selection: the key of the element where the running total (in the candidate order, over
 * candidates within lim) first reaches goal — counts (MODE 0) or masses (1). On return *goal is
 * what is still to reach among the elements of that key, in id order. A first pass over coarse
 * bins of the logits' span (spread, so shared atomics rarely collide) picks a bin; four passes
 * over the key's bytes, counting only that bin's elements, pick the key. */
template <int MODE>
__device__ unsigned draw_select(const float *x, const float *w, int V, const draw_bound &lim,
                                float mx, float scale, unsigned long long *goal,
                                unsigned long long *hist) {
    unsigned pre = 0, pmask = 0, cb = 0;
    for (int pass = 0; pass < 5; pass++) {
        const int shift = 32 - 8 * pass; /* pass 0: the coarse bins */
        for (int b = threadIdx.x; b < 256; b += DRAW_THREADS) hist[b] = 0;
        __syncthreads();
        auto add = [&](float xi, float wi, int i) {
            const unsigned long long v = draw_val<MODE>(xi, wi, i, lim, pre, pmask, 0.0f);
            if (!v) return;
            const unsigned c = draw_cbin(xi, mx, scale);
            if (pass == 0)
                atomicAdd(&hist[c], v);
            else if (c == cb)
                atomicAdd(&hist[(draw_key(xi) >> shift) & 255u], v);
        };
        if (!(V & 3)) {
            const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 2
            for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
                const float4 a = x4[j], b = w4[j];
                add(a.x, b.x, 4 * j), add(a.y, b.y, 4 * j + 1);
                add(a.z, b.z, 4 * j + 2), add(a.w, b.w, 4 * j + 3);
            }
        } else {
            for (int i = threadIdx.x; i < V; i += DRAW_THREADS) add(x[i], w[i], i);
        }
        __syncthreads();
        /* the bin where the goal is reached, in the candidate order (every thread alike): the
         * coarse bins from 0 (the largest logits) up, the key's bytes from 255 down */
        unsigned long long acc = 0;
        int b;
        if (pass == 0) {
            for (b = 0; b < 255 && acc + hist[b] < *goal; b++) acc += hist[b];
            cb = (unsigned)b;
        } else {
            for (b = 255; b > 0 && acc + hist[b] < *goal; b--) acc += hist[b];
            pre |= (unsigned)b << shift;
            pmask |= 255u << shift;
        }
        __syncthreads(); /* everyone has read hist before the next pass clears it */
        *goal -= acc;
    }
    return pre;
}

/* sum over the block of draw_val<MODE> (float4 loads where V allows) */
template <int MODE>
__device__ unsigned long long draw_total(const float *x, const float *w, int V,
                                         const draw_bound &lim, float min_w,
                                         unsigned long long *red) {
    unsigned long long t = 0;
    if (!(V & 3)) {
        const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j], b = w4[j];
            const int i = 4 * j;
            t += draw_val<MODE>(a.x, b.x, i, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.y, b.y, i + 1, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.z, b.z, i + 2, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.w, b.w, i + 3, lim, 0u, 0u, min_w);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS)
            t += draw_val<MODE>(x[i], w[i], i, lim, 0u, 0u, min_w);
    }
    return draw_block_sum(t, red);
}

__global__ void __launch_bounds__(DRAW_THREADS, 1)
    draw_k(int *tokens, float *x, size_t ld, int V, const ds_cu_draw *draws, const int *edits,
           float *wbuf) {
    PDL_ENTRY();
    __shared__ unsigned long long hist[256], red[DRAW_WARPS];
    __shared__ float mxs[DRAW_WARPS];
    __shared__ int found;
    const ds_cu_draw d = draws[blockIdx.x];
    float *xr = x + (size_t)d.row * ld;
    float *w = wbuf + (size_t)blockIdx.x * V;
    /* the edits: penalties, then the stops masked (sampler.c's edit_logits) */
    const int *cnt = edits + d.edits, *mask = cnt + 2 * d.n_counts;
    if (d.presence != 0.0f || d.frequency != 0.0f)
        for (int j = threadIdx.x; j < d.n_counts; j += DRAW_THREADS) {
            const int id = cnt[2 * j], c = cnt[2 * j + 1];
            if (id < 0 || id >= V) continue;
            const float v = __fsub_rn(xr[id], __fmul_rn(d.frequency, (float)c));
            xr[id] = __fsub_rn(v, d.presence);
        }
    __syncthreads();
    for (int j = threadIdx.x; j < d.n_mask; j += DRAW_THREADS)
        if (mask[j] >= 0 && mask[j] < V) xr[mask[j]] = -INFINITY;
    if (d.n_allow > 0) { /* constrained decoding: V/32 words came up, not the row down */
        const unsigned *allow = (const unsigned *)(mask + d.n_mask);
        for (int j = threadIdx.x; j < V; j += DRAW_THREADS)
            if (j >= d.n_allow || !((allow[j >> 5] >> (j & 31)) & 1u)) xr[j] = -INFINITY;
    }
    __syncthreads();
    /* the maximum and the argmax (ds_argmax: the lowest id among the largest, NaN ignored) */
    float mx = -INFINITY;
    unsigned long long best = 0;
    const bool vec = !(V & 3);
    if (vec) {
        const float4 *x4 = (const float4 *)xr;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j];
            mx = fmaxf(fmaxf(mx, a.x), fmaxf(a.y, fmaxf(a.z, a.w)));
            best = max(max(best, argmax_key(a.x, 4 * j)), argmax_key(a.y, 4 * j + 1));
            best = max(max(best, argmax_key(a.z, 4 * j + 2)), argmax_key(a.w, 4 * j + 3));
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            mx = fmaxf(mx, xr[i]);
            best = max(best, argmax_key(xr[i], i));
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    }
    if ((threadIdx.x & 31) == 0) {
        mxs[threadIdx.x >> 5] = mx;
        red[threadIdx.x >> 5] = best;
    }
    __syncthreads();
    for (int v = 0; v < DRAW_WARPS; v++) {
        mx = fmaxf(mx, mxs[v]);
        best = max(best, red[v]);
    }
    if (d.greedy || !(mx > -INFINITY) || mx == INFINITY) {
        if (threadIdx.x == 0) tokens[blockIdx.x] = best ? (int)~(unsigned)best : 0;
        return;
    }
    /* the weights, stored once; the candidates counted and their mass summed on the way */
    unsigned long long n_cand = 0, s_all = 0;
    if (vec) {
        const float4 *x4 = (const float4 *)xr;
        float4 *w4 = (float4 *)w;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j];
            float4 b;
            b.x = draw_exp(__fmul_rn(__fsub_rn(a.x, mx), d.inv_t));
            b.y = draw_exp(__fmul_rn(__fsub_rn(a.y, mx), d.inv_t));
            b.z = draw_exp(__fmul_rn(__fsub_rn(a.z, mx), d.inv_t));
            b.w = draw_exp(__fmul_rn(__fsub_rn(a.w, mx), d.inv_t));
            w4[j] = b;
            const unsigned long long m0 = draw_mass(b.x), m1 = draw_mass(b.y);
            const unsigned long long m2 = draw_mass(b.z), m3 = draw_mass(b.w);
            n_cand += (m0 != 0) + (m1 != 0) + (m2 != 0) + (m3 != 0);
            s_all += m0 + m1 + m2 + m3;
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            const float wi = draw_exp(__fmul_rn(__fsub_rn(xr[i], mx), d.inv_t));
            w[i] = wi;
            n_cand += draw_mass(wi) != 0;
            s_all += draw_mass(wi);
        }
    }
    n_cand = draw_block_sum(n_cand, red);
    s_all = draw_block_sum(s_all, red);
    draw_bound lim = {0u, 0, false};
    const float cscale = __fmul_rn(d.inv_t, 256.0f / 27.8f); /* draw_cbin's: 27.8 > 40 ln 2 */
    /* top-k binds only when there are more candidates than k */
    if (d.top_k > 0 && n_cand > (unsigned long long)d.top_k) {
        unsigned long long goal = (unsigned long long)d.top_k;
        const unsigned k = draw_select<0>(xr, w, V, lim, mx, cscale, &goal, hist);
        const int id = draw_find<0>(xr, w, V, lim, k, 0xffffffffu, 0.0f, goal - 1, red, &found);
        lim = {k, id, true};
    }
    if (d.top_p < 1.0f) {
        const unsigned long long kept = lim.on ? draw_total<1>(xr, w, V, lim, 0.0f, red) : s_all;
        unsigned long long goal =
            (unsigned long long)__double2ll_rz(__dmul_rn((double)d.top_p, __ull2double_rn(kept)));
        if (!goal) goal = 1;
        const unsigned k = draw_select<1>(xr, w, V, lim, mx, cscale, &goal, hist);
        const int id = draw_find<1>(xr, w, V, lim, k, 0xffffffffu, 0.0f, goal - 1, red, &found);
        lim = {k, id, true};
    }
    const unsigned long long S =
        lim.on || d.min_w > 0.0f ? draw_total<2>(xr, w, V, lim, d.min_w, red) : s_all;
    unsigned long long r = (unsigned long long)__double2ll_rz(__dmul_rn(d.u, __ull2double_rn(S)));
    if (r >= S) r = S - 1;
    const int tok = draw_find<2>(xr, w, V, lim, 0u, 0u, d.min_w, r, red, &found);
    if (threadIdx.x == 0) tokens[blockIdx.x] = tok;
}

extern "C" int ds_cu_draw_rows(ds_cu *c, int32_t *tokens, float *x, size_t ld, int V,
                               const ds_cu_draw *d, int n, const int32_t *edits, size_t n_edits,
                               ds_err *err) {
    if (n <= 0) return DS_OK;
    void *b[4];
    const size_t sz[4] = {(size_t)n * sizeof *d, DS_MAX(n_edits, (size_t)1) * sizeof *edits,
                          (size_t)n * V * sizeof(float), (size_t)n * sizeof(int32_t)};
    if (carve_scratch(c, &c->drawb, &c->drawb_bytes, sz, b, 4, "draw scratch", err)) return DS_ERR;
    CU_TRY(cudaMemcpyAsync(b[0], d, sz[0], cudaMemcpyHostToDevice, c->stream), "draws up");
    if (n_edits)
        CU_TRY(cudaMemcpyAsync(b[1], edits, n_edits * sizeof *edits, cudaMemcpyHostToDevice,
                               c->stream),
               "draw edits up");
    launch_k(c, draw_k, dim3((unsigned)n), DRAW_THREADS, 0, (int *)b[3], x, ld, V,
             (const ds_cu_draw *)b[0], (const int *)b[1], (float *)b[2]);
    CU_TRY(cudaGetLastError(), "draw");
    CU_TRY(cudaMemcpyAsync(tokens, b[3], sz[3], cudaMemcpyDeviceToHost, c->stream), "tokens down");
    return ds_cu_sync(c, err);
}
