/* kda_fused.cu — KDA's decode step in one kernel: convs, head norms, gate matmuls, the gate,
 * the recurrence and the gated output norm, in clusters (sm_90). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_stream.cuh"
#include "kernels/cuda/kda.cuh"

/* ---- KDA decode in one kernel (ds_cu_kda_decode_fused) ------------------------------------------
 * At batch 1 every kernel of the step is a chain of latencies after its wait for the one before
 * (bench/RESULTS.md, sessions 8-9), and KDA's middle was seven of them: the convs, the head
 * norms, f_b's and g_b's matmuls, the gate, the recurrence and the gated output norm (by the
 * what-if, bench/RESULTS.md session 14). Here a cluster of KDF_CL blocks per
 * (head, sequence) does all of them: block r of the cluster owns a quarter of the head — the
 * convs of its q, k and v channels (their tails: one writer each), f_b's and g_b's rows of its
 * channels and the recurrence of its value columns — and hands the q, k and decay values every
 * block needs to the others' shared memory (distributed shared memory), as it does the
 * recurrence's outputs for the output norm. A block per head was no faster than the seven: one
 * SM then reads and writes the head's 64 KB state and 64 KB of weights alone. Its state, conv
 * weights and tails are read, and its f_b and g_b rows start on their way to shared memory
 * (cp.async), before the wait for the previous kernel. Each value takes the operations of the
 * kernel it stands in for (short_conv_batch_k, l2norm_heads_k, stream_rows_dot through a warp's
 * shuffle tree, kda_gate_k, kda_run at SPLIT 2, gated_rmsnorm_heads_k), so the bits are the
 * same as theirs. */
enum { KDF_DK = 128, KDF_CL = 4, KDF_THREADS = 128, KDF_K_MAX = 128 };
enum { KDF_Q = KDF_DK / KDF_CL }; /* channels (and value columns) a block owns: 32 */
enum { KDF_U = KDF_K_MAX / 64 };  /* f_b's and g_b's 64-column steps (FP8), all loaded at once */

/* the dynamic shared memory: the block's f_b rows then its g_b rows, BF16 (FP8: none, each warp
 * holds its tile's codes in registers) */
static size_t kdf_smem(int Kf, int Kg, bool f8) {
    return f8 ? 0 : (size_t)KDF_Q * (Kf + Kg) * sizeof(uint16_t);
}

/* With ptpc FP8 f_b and g_b (docs/quantization.md §3), their products as matmul_fp8.cu's
 * gemv_f8m_k computes them, bit for bit (fp8_stream.cuh; one warp a tile, S = 1, as
 * ds_cu_kda_decode_fits requires): warp w takes the 16-row tile w & 1 of the block's rows of f_b
 * (w < 2) or g_b, its codes (a) and row scales (sr) loaded before the wait; the block quantizes
 * f_a x and g_a x (fas, gas) per token as the dense kernel's prologue does, and the results go to
 * fo and go [Q]. Every thread of the block calls it. */
static __device__ __forceinline__ __attribute__((unused)) void
kdf_gates_f8(const ds_cu_kda_decode &d, uint4 (&a)[KDF_U][2], const uint4 *w0, const uint4 *w1,
             float sr0, float sr1, const float *fas, const float *gas, float *fo, float *go) {
    __shared__ __align__(16) uint16_t fq[KDF_K_MAX], gq[KDF_K_MAX]; /* F16 code values */
    const float sf = f8_quant_row(fq, d.Kf, [fas](int c) { return fas[c]; });
    const float sg = f8_quant_row(gq, d.Kg, [gas](int c) { return gas[c]; });
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, l4 = lane & 3;
    const bool isf = warp < 2;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    f8_tile<KDF_U>(acc, a, w0, w1, g == 0 ? (const uint4 *)(isf ? fq : gq) + 2 * l4 : NULL, 0, 1,
                   isf ? d.Kf : d.Kg, l4);
    if (l4 == 0) { /* C's column 0: rows g (element 0) and g + 8 (2) */
        const float st = isf ? sf : sg;
        float *o = (isf ? fo : go) + 16 * (warp & 1) + g;
        o[0] = (acc[0] * st) * sr0, o[8] = (acc[2] * st) * sr1;
    }
    __syncthreads();
}

/* long: seven kernels' steps in one, the head's state kept in registers from the first load to
 * the last store, with cluster barriers between the steps. */
template <int W, bool F8>
__global__ void __launch_bounds__(KDF_THREADS) kda_decode_fused_k(ds_cu_kda_decode d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 /* (launched in clusters of KDF_CL) */
    namespace cg = cooperative_groups;
    constexpr int DK = KDF_DK, Q = KDF_Q, SPLIT = 2, DP = DK / SPLIT;
    static_assert(KDF_THREADS == 4 * Q && Q == 32, "a warp per 32 rows of a block's share");
    static_assert(KDF_K_MAX <= 32 * 8, "f_b's and g_b's rows: one 16-byte piece a lane");
    static_assert(KDF_K_MAX <= KDF_THREADS, "f_a x and g_a x: one element a thread");
    extern __shared__ uint4 kdf_dyn[]; /* [Q][Kf] f_b's rows, then [Q][Kg] g_b's */
    __shared__ __align__(16) float fas[KDF_K_MAX], gas[KDF_K_MAX]; /* f_a x, g_a x */
    /* the head's q and k after the conv (then their norms), e^g: every block's whole copy */
    __shared__ __align__(16) float qs[DK], ks[DK], ds[DK], os[DK];
    __shared__ float vs[Q], gts[Q], beta_s; /* this block's v, output gate */
    __shared__ float fo8[Q], go8[Q];        /* f_b's and g_b's outputs (F8) */
    cg::cluster_group cl = cg::this_cluster();
    const int r = (int)cl.block_rank(), h = blockIdx.x / KDF_CL, z = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int P = d.H * DK, Kf = d.Kf, Kg = d.Kg, q0 = r * Q; /* this block's channels q0 + .. */
    const uint16_t *fbw = (const uint16_t *)kdf_dyn, *gbw = fbw + (size_t)Q * Kf;
    /* the recurrence: threads 0..63, two a value column q0 + col */
    const bool rec = tid < SPLIT * Q;
    const int col = q0 + (tid & 63) / SPLIT, part = tid % SPLIT, c0 = part * DP;
    /* before the wait: nothing of this step writes these (as kda_run's state; the tails are
     * this kernel's alone within a step) */
    /* this thread's column from row c0 on: entry c at Sc[c DK], a constant offset (an address
     * worked out per entry took four instructions and a register each) */
    float *Sc = d.S[z] + (size_t)h * DK * DK + (size_t)c0 * DK + col;
    float s[DP];
#pragma unroll
    for (int c = 0; c < DP; c++) s[c] = __ldcg(Sc + c * DK); /* (threads 64.. repeat 0..63's) */
    /* F8: this warp's tile of f_b or g_b (kdf_gates_f8) */
    const int tw = threadIdx.x >> 5, trow = h * DK + q0 + 16 * (tw & 1) + ((threadIdx.x & 31) >> 2);
    const int tK = tw < 2 ? Kf : Kg;
    const uint8_t *tcodes = (const uint8_t *)(tw < 2 ? d.f_b : d.g_b);
    const float *tsc = tw < 2 ? d.f_bs : d.g_bs;
    const uint4 *tw0 = (const uint4 *)(tcodes + (size_t)trow * tK) + (threadIdx.x & 3),
                *tw1 = (const uint4 *)(tcodes + (size_t)(trow + 8) * tK) + (threadIdx.x & 3);
    uint4 ta[KDF_U][2];
    float tsr0 = 0.0f, tsr1 = 0.0f;
    if constexpr (F8) {
        f8_load<KDF_U>(ta, tw0, tw1, 0, 1, tK / 64);
        tsr0 = tsc[trow], tsr1 = tsc[trow + 8];
    } else {
        uint16_t *dst = (uint16_t *)kdf_dyn;
        const uint16_t *fb = d.f_b + (size_t)(h * DK + q0) * Kf;
        const uint16_t *gb = d.g_b + (size_t)(h * DK + q0) * Kg;
        /* (trip counts bounded at compile time: a run-time loop here was unrolled with its
         * remainders into more code than the rest of the kernel) */
        constexpr int PT = Q * KDF_K_MAX / 8 / KDF_THREADS; /* pieces a thread, at most */
#pragma unroll
        for (int u = 0; u < PT; u++) {
            const int i = tid + u * KDF_THREADS;
            if (i < Q * Kf / 8) cp_async16(dst + i * 8, fb + i * 8);
        }
        dst += (size_t)Q * Kf;
#pragma unroll
        for (int u = 0; u < PT; u++) {
            const int i = tid + u * KDF_THREADS;
            if (i < Q * Kg / 8) cp_async16(dst + i * 8, gb + i * 8);
        }
        cp_async_commit();
    }
    /* thread tid < 3 Q: projection j = tid / Q's channel q0 + tid % Q */
    const bool cv = tid < 3 * Q;
    const int j = tid / Q, cc = h * DK + q0 + tid % Q;
    float *tail = d.tails[z];
    const size_t tn = (size_t)(W - 1) * P; /* one projection's tail */
    float wc[W], win[W];
    if (cv) {
#pragma unroll
        for (int i = 0; i < W; i++) wc[i] = d.conv_w[((size_t)j * P + cc) * W + i];
#pragma unroll
        for (int i = 0; i < W - 1; i++) win[i] = __ldcg(tail + j * tn + (size_t)i * P + cc);
    }
    /* lane l < 8 of warp w holds the bias of f_b row q0 + 8 w + l, the rows the warp sums */
    const float bias = lane < 8 ? d.dt_bias[h * DK + q0 + 8 * warp + lane] : 0.0f;
    const float a_log = d.A_log[h], nw = d.o_norm[q0 + lane];
    /* every block of the cluster has started before any writes into another's shared memory */
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    PDL_ENTRY();
    const float *pre = d.pre + (size_t)z * d.ld;
    if (tid < Kf) fas[tid] = pre[d.fa_off + tid]; /* (Kf, Kg <= KDF_THREADS) */
    if (tid < Kg) gas[tid] = pre[d.ga_off + tid];
    if (tid == 0) beta_s = 1.0f / (1.0f + expf(-pre[d.b_off + h])); /* as kda_gate_k */
    float cout = 0.0f; /* the conv (short_conv_batch_k at one token); the new tail at the end */
    if (cv) {
        win[W - 1] = pre[(size_t)j * P + cc];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < W; i++) acc += wc[i] * win[i];
        cout = acc / (1.0f + expf(-acc));
    }
    cp_async_wait_all();
    __syncthreads();
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    if (cv && j < 2) /* q and k to every block */
        for (int b = 0; b < KDF_CL; b++)
            cl.map_shared_rank(j == 0 ? qs : ks, b)[q0 + tid % Q] = cout;
    else if (cv)
        vs[tid % Q] = cout;
    /* f_b's and g_b's rows q0 + 8 warp + i (stream_rows_dot's order: lane l's pieces l, l + 32,
     * .., then the shuffle tree); the decay gate (kda_gate_k) and its exponential (as kda_run
     * stages it) to every block */
    const float a = expf(a_log);
    float fl = 0.0f, gl = 0.0f; /* lane l < 8 takes row 8 warp + l */
    if constexpr (F8) {
        kdf_gates_f8(d, ta, tw0, tw1, tsr0, tsr1, fas, gas, fo8, go8);
        if (lane < 8) fl = fo8[8 * warp + lane], gl = go8[8 * warp + lane];
    } else {
        float f[8], gt[8]; /* rows 8 warp + i: the partial sums side by side, then their trees */
        /* A lane has one piece of a row at most (K <= 32 x 8): its sum is 0 + that piece, or 0.
         * Lanes past the row compute a piece they then drop (no branch a row). */
        const bool fl_on = lane < Kf / 8, gl_on = lane < Kg / 8;
        const int fk = fl_on ? lane : 0, gk = gl_on ? lane : 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int n = 8 * warp + i; /* of this block's Q rows */
            const float fv =
                dot8(((const uint4 *)(fbw + (size_t)n * Kf))[fk], fas + (size_t)fk * 8);
            const float gv =
                dot8(((const uint4 *)(gbw + (size_t)n * Kg))[gk], gas + (size_t)gk * 8);
            f[i] = fl_on ? 0.0f + fv : 0.0f;
            gt[i] = gl_on ? 0.0f + gv : 0.0f;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < 8; i++) {
                f[i] += __shfl_xor_sync(0xffffffffu, f[i], o);
                gt[i] += __shfl_xor_sync(0xffffffffu, gt[i], o);
            }
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (lane == i) fl = f[i], gl = gt[i];
    }
    if (lane < 8) {
        const int n = 8 * warp + lane;
        const float eg = expf(kda_decay(fl + bias, a, d.lower_bound_form, d.lb));
        for (int b = 0; b < KDF_CL; b++) cl.map_shared_rank(ds, b)[q0 + n] = eg;
        gts[n] = gl;
    }
    cl.sync(); /* every block's q, k and e^g in place */
    /* Every warp runs the shuffles below, whatever part of the result it keeps: a shuffle
     * under a branch the compiler cannot see is warp-uniform gets a second, collective copy of
     * the code around it (the recurrence was in the kernel twice). */
    /* q's and k's head norms (l2norm_heads_k: a warp a row; each block its own copy). Warps 2
     * and 3 sum e^g (read-only here) and keep nothing. */
    {
        const float *xr = warp == 0 ? qs : warp == 1 ? ks : ds;
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss += xr[i] * xr[i];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float sc = (warp == 0 ? d.q_scale : 1.0f) / sqrtf(ss + d.eps);
        if (warp < 2)
            for (int i = lane; i < DK; i += 32) (warp == 0 ? qs : ks)[i] *= sc;
    }
    __syncthreads();
    /* the recurrence at one token (kda_run), this block's value columns (warps 2 and 3 repeat
     * 0 and 1 and keep nothing) */
    const float acc = kda_token<DP, SPLIT>(s, qs, ks, ds, c0, vs[col - q0], beta_s, true);
    if (rec && part == 0)
        for (int b = 0; b < KDF_CL; b++) cl.map_shared_rank(os, b)[col] = acc;
    /* (A cluster barrier's release is a GPU-wide memory barrier on this hardware: it waits for
     * every store still in flight. The state's and the tails' stores, read only by the next
     * step, go after the last one.) */
    cl.sync(); /* the head's outputs in every block (and no block reads another's memory after) */
    if (rec)
#pragma unroll
        for (int c = 0; c < DP; c++) Sc[c * DK] = s[c];
    if (cv)
#pragma unroll
        for (int i = 0; i < W - 1; i++) tail[j * tn + (size_t)i * P + cc] = win[i + 1];
    /* the gated output norm (gated_rmsnorm_heads_k: a warp a row), this block's columns: warp
     * 0's to keep */
    {
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss += os[i] * os[i];
        for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
        const float rr = 1.0f / sqrtf(ss / (float)DK + d.norm_eps);
        if (warp == 0)
            d.y[((size_t)z * d.H + h) * DK + q0 + lane] =
                os[q0 + lane] * rr * nw / (1.0f + expf(-gts[lane]));
    }
#endif
}

extern "C" int ds_cu_kda_decode_fits(const ds_cu *c, int dk, int W, int Kf, int Kg, int f8) {
    /* FP8: whole 16-byte pieces, and the dense kernel's tiles take one warp each (S = 1) */
    const int kq = f8 ? 16 : 8;
    static_assert(KDF_K_MAX / 64 < 2 * F8_SPLIT_MIN, "f8_splits gives f_b and g_b one warp a tile");
    return c->sm90 && dk == KDF_DK && W == 4 && Kf > 0 && Kf % kq == 0 && Kf <= KDF_K_MAX &&
           Kg > 0 && Kg % kq == 0 && Kg <= KDF_K_MAX;
}

extern "C" int ds_cu_kda_decode_fused(ds_cu *c, const ds_cu_kda_decode *d, ds_err *err) {
    const bool f8 = d->f_bs != NULL;
    if (!ds_cu_kda_decode_fits(c, d->dk, d->W, d->Kf, d->Kg, f8))
        return ds_errf(err,
                       "cuda: kda decode (fused): head dim %d, conv width %d, f_b and g_b of "
                       "%d and %d columns (128, 4, multiples of 8 (FP8: 16) up to 128; sm_90)",
                       d->dk, d->W, d->Kf, d->Kg);
    if (d->n_seq <= 0 || d->H <= 0) return DS_OK;
    if (d->n_seq > 65535) return ds_errf(err, "cuda: kda decode (fused): %d sequences", d->n_seq);
    if ((uintptr_t)d->f_b % 16 || (uintptr_t)d->g_b % 16)
        return ds_errf(err, "cuda: kda decode (fused): f_b or g_b not 16-byte aligned");
    if (f8 != (d->g_bs != NULL))
        return ds_errf(err, "cuda: kda decode (fused): f_b and g_b of different formats");
    launch_cluster_k(c, f8 ? kda_decode_fused_k<4, true> : kda_decode_fused_k<4, false>,
                     dim3((unsigned)(d->H * KDF_CL), (unsigned)d->n_seq), KDF_THREADS,
                     kdf_smem(d->Kf, d->Kg, f8), KDF_CL, *d);
    CU_TRY(cudaGetLastError(), "kda decode (fused)");
    return DS_OK;
}
