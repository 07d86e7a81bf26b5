/* kda_chunk_scan.cu — chunked KDA's passes 2 and 3 (kda_chunked.cuh has the chunk algebra):
 * the walk over a sequence's chunks with the state in registers, and the outputs, in f32 on CUDA
 * cores or on tensor cores (TF32, 3xTF32, BF16), the outputs in a pass of their own or made
 * beside the walk. */
#include "kernels/cuda/kda_chunked.cuh"
#include "kernels/cuda/tf32.cuh"

/* State columns and threads per block: a thread's 2 x 4 U entries and 4 x 4 state entries reuse
 * each shared-memory load 8 and 16 times (512 threads halve that: shared memory is what the scan
 * waits on). */
enum { KS_BV = 32, KS_NT = 256 };

/* Pass 2's shared memory: two stages of a chunk's operands (W, Kc, Ut, e^{G_L}), then the state's
 * columns and U. The tensor-core form pads Kc, Ut, the state and U so that its fragment loads
 * (lanes 4 g + l4 reading rows l4 and columns g) fall on 32 different banks. B16 (the BF16 mode):
 * W [KC][WLD] and Kc transposed [KD][KLD] as BF16 (kda_chunked.cuh), rows 4 words past a multiple
 * of 32 so that a fragment's 32-bit loads (row g, word l4) fall on 32 banks; sizes in floats. */
template <int KD, bool TC, bool B16 = false> struct kda_scan_smem {
    static constexpr int WLD = B16 ? KD + 8 : KD + 4; /* W: a warp's 8 rows on 8 bank quads */
    static constexpr int KLD = B16 ? KC + 8 : TC ? KD + 8 : KD; /* Kc (B16: Kc^T) */
    static constexpr int ULD = TC ? KS_BV + 8 : KS_BV;          /* Ut, the state and U */
    static constexpr int W_FL = B16 ? KC * WLD / 2 : KC * WLD, K_FL = B16 ? KD * KLD / 2 : KC * KLD;
    static constexpr int STAGE = W_FL + K_FL + KC * ULD + KD;
    static constexpr size_t BYTES = ((size_t)2 * STAGE + KD * ULD + KC * ULD) * sizeof(float);
};

/* Chunk ci's operands (head h, columns [cg, cg + KS_BV)) into stage s of pass 2's shared memory,
 * every thread its share of 16-byte cp.async pieces (one commit group). */
template <int KD, bool TC, bool B16 = false>
__device__ __forceinline__ void kda_scan_stage(float *ssh, int s, const float *prep, int ci, int H,
                                               int h, int cg) {
    using SM = kda_scan_smem<KD, TC, B16>;
    const float *pr = prep + ((size_t)ci * H + h) * kda_ch_floats(KD);
    float *W = ssh + s * SM::STAGE, *Kc = W + SM::W_FL, *Ut = Kc + SM::K_FL,
          *gL = Ut + KC * SM::ULD;
    if constexpr (B16) { /* 16-byte pieces of BF16 rows: W's 8 to a float4, Kc^T's likewise */
        for (int i = threadIdx.x; i < KC * KD / 8; i += KS_NT) {
            const int r = i / (KD / 8), c = (i % (KD / 8)) * 4; /* (floats) */
            cp_async16(W + r * (SM::WLD / 2) + c, pr + r * (KD / 2) + c);
            const int r2 = i / (KC / 8), c2 = (i % (KC / 8)) * 4;
            cp_async16(Kc + r2 * (SM::KLD / 2) + c2, pr + 3 * KC * KD + r2 * (KC / 2) + c2);
        }
    } else {
        /* W's and Kc's pieces interleaved: copied one matrix after the other (cp_async_rows
         * twice), the TF32 chunked KDA was slower (bench/RESULTS.md session 10) */
        for (int i = threadIdx.x; i < KC * KD / 4; i += KS_NT) {
            const int r = i / (KD / 4), c = (i % (KD / 4)) * 4;
            cp_async16(W + r * SM::WLD + c, pr + r * KD + c);
            cp_async16(Kc + r * SM::KLD + c, pr + 3 * KC * KD + r * KD + c);
        }
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
 * before is computed (two stages): the version that loaded them as it went spent most of each
 * chunk waiting on memory, several times its arithmetic. */
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

/* tf32_kstep at PREC 2 with A handed over in BF16 (kda_chunked.cuh): a is this lane's word of
 * row g (row g + 8 lda words on) */
template <int NT>
__device__ __forceinline__ void b16_kstep(float (&acc)[NT][4], const uint32_t *a, int lda,
                                          const float *b, int ldb) {
    const uint32_t a0 = __ldg(a), a1 = __ldg(a + 8 * lda);
#pragma unroll
    for (int n = 0; n < NT; n++)
        mma_bf16_k8(acc[n], a0, a1, pack_bf16x2(b[n * 8], b[4 * ldb + n * 8]));
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
    if constexpr (PREC == 2) { /* Qp and P handed over in BF16: rows' words (kda_chunked.cuh) */
        const uint32_t *Qw = (const uint32_t *)Qp + (r0 + g) * (KD / 2) + l4;
        const uint32_t *Pw = (const uint32_t *)P + (r0 + g) * (KC / 2) + l4;
#pragma unroll 4
        for (int k0 = 0; k0 < KD; k0 += 8)
            b16_kstep<NT>(acc, Qw + k0 / 2, KD / 2, S0s + (k0 + l4) * BLD + c0 + g, BLD);
        for (int k0 = 0; k0 < r0 + 16; k0 += 8)
            b16_kstep<NT>(acc, Pw + k0 / 2, KC / 2, Us + (k0 + l4) * BLD + c0 + g, BLD);
    } else {
        /* Qp S0: k over the KD key channels */
#pragma unroll 4
        for (int k0 = 0; k0 < KD; k0 += 8)
            tf32_kstep<NT, PREC>(acc, Qp + (size_t)(r0 + g) * KD + k0 + l4, KD,
                                 S0s + (k0 + l4) * BLD + c0 + g, BLD);
        /* P U: k over the chunk's tokens, up to this warp's last row (P is lower triangular) */
        for (int k0 = 0; k0 < r0 + 16; k0 += 8)
            tf32_kstep<NT, PREC>(acc, P + (size_t)(r0 + g) * KC + k0 + l4, KC,
                                 Us + (k0 + l4) * BLD + c0 + g, BLD);
    }
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

/* The A fragment of rows row, row + 8 at k step k0 of a row-major A in shared memory: f32 rows
 * lda floats apart, or (B16) BF16 rows lda halves apart in kda_b16_slot order, a pair a word */
template <int PREC, bool B16>
__device__ __forceinline__ tf32_a<PREC> a_rows(const float *A, int lda, int row, int k0, int l4) {
    if constexpr (B16) {
        const uint32_t *w = (const uint32_t *)A + row * (lda / 2) + k0 / 2 + l4;
        tf32_a<PREC> a;
        a.hi[0] = w[0], a.hi[1] = w[4 * lda];
        return a;
    } else {
        const float *p = A + row * lda + k0 + l4;
        return tf32_a<PREC>(p[0], p[8 * lda], p[4], p[8 * lda + 4]);
    }
}

/* The walk's block barrier. With OUT its two kinds of warps reach it from different places in
 * the code, so it is a named barrier (1) that counts their 2 KS_NT threads. */
template <bool OUT> __device__ __forceinline__ void kda_scan_bar() {
    if constexpr (OUT)
        asm volatile("bar.sync 1, %0;" ::"n"(2 * KS_NT) : "memory");
    else
        __syncthreads();
}

/* The output warps of kda_chunk_scan_tc_k<.., OUT>: chunk after chunk, O = Qp S0 while the walk
 * makes U from the same S0 (Ss), then O += P U while the walk updates the state, then the rows
 * out — between the walk's two barriers a chunk. Warp w's tile: rows m1 + g (+ 8), columns
 * n1 + 8 n + 2 l4 (+ 1), n < 2, of the block's column group cg. */
template <int KD, int PREC>
__device__ __forceinline__ void kda_scan_outputs(float *o, const float *prep,
                                                 const kda_chunk *chunks, const float *Ss,
                                                 const float *Us, int c0, int c1, int H, int h,
                                                 int cg, int m1, int n1, int g, int l4) {
    constexpr int ULD = kda_scan_smem<KD, true>::ULD;
    for (int ci = c0; ci < c1; ci++) {
        kda_scan_bar<true>(); /* S0 of chunk ci is in Ss */
        const float *pr = prep + ((size_t)ci * H + h) * kda_ch_floats(KD);
        const float *Qp = pr + 2 * KC * KD + (m1 + g) * KD + l4;
        const float *P = pr + 4 * KC * KD + (m1 + g) * KC + l4;
        /* BF16 mode: rows g and g + 8's words l4 of each k step (kda_chunked.cuh) */
        const uint32_t *Qw = (const uint32_t *)(pr + 2 * KC * KD) + (m1 + g) * (KD / 2) + l4;
        const uint32_t *Pw = (const uint32_t *)(pr + 4 * KC * KD) + (m1 + g) * (KC / 2) + l4;
        float oacc[2][4] = {}; /* [n][C fragment] the warp's tile of O (above) */
        /* (Qp requested a chunk ahead, in registers, measured slower: bench/RESULTS.md) */
#pragma unroll
        for (int j = 0; j < KD / 8; j++) {
            tf32_a<PREC> qf;
            if constexpr (PREC == 2)
                qf.hi[0] = __ldg(Qw + 4 * j), qf.hi[1] = __ldg(Qw + 4 * KD + 4 * j);
            else
                qf = tf32_a<PREC>(__ldg(Qp + 8 * j), __ldg(Qp + 8 * KD + 8 * j),
                                  __ldg(Qp + 8 * j + 4), __ldg(Qp + 8 * KD + 8 * j + 4));
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const float *sb = Ss + (8 * j + l4) * ULD + n1 + 8 * n + g;
                mma_tf32x<PREC>(oacc[n], qf, sb[0], sb[4 * ULD]);
            }
        }
        /* P's fragments for the k steps up to this warp's last row (P is lower triangular) */
        float pa[KC / 8][4];    /* [k step][A fragment] */
        uint32_t pw[KC / 8][2]; /* (BF16 mode) */
#pragma unroll
        for (int j = 0; j < KC / 8; j++)
            if (8 * j < m1 + 16) {
                if constexpr (PREC == 2)
                    pw[j][0] = __ldg(Pw + 4 * j), pw[j][1] = __ldg(Pw + 4 * KC + 4 * j);
                else
                    pa[j][0] = __ldg(P + 8 * j), pa[j][1] = __ldg(P + 8 * KC + 8 * j),
                    pa[j][2] = __ldg(P + 8 * j + 4), pa[j][3] = __ldg(P + 8 * KC + 8 * j + 4);
            }
        kda_scan_bar<true>(); /* U is whole in Us; the walk is done reading Ss */
#pragma unroll
        for (int j = 0; j < KC / 8; j++) {
            if (8 * j >= m1 + 16) break;
            tf32_a<PREC> pf;
            if constexpr (PREC == 2)
                pf.hi[0] = pw[j][0], pf.hi[1] = pw[j][1];
            else
                pf = tf32_a<PREC>(pa[j][0], pa[j][1], pa[j][2], pa[j][3]);
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const float *ub = Us + (8 * j + l4) * ULD + n1 + 8 * n + g;
                mma_tf32x<PREC>(oacc[n], pf, ub[0], ub[4 * ULD]);
            }
        }
        const kda_chunk ch = chunks[ci];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int t = m1 + g + 8 * hh;
            if (t >= ch.len) continue;
            float *orow = o + ((size_t)(ch.t0 + t) * H + h) * KD + cg + n1 + 2 * l4;
#pragma unroll
            for (int n = 0; n < 2; n++)
                *(float2 *)(orow + 8 * n) = make_float2(oacc[n][2 * hh], oacc[n][2 * hh + 1]);
        }
    }
}

/* Pass 2 on TF32 tensor cores (with ds_cu_set_kda_tc): the same walk and staging, both products
 * as mma.sync m16n8k8 with f32 accumulation (the operands rounded to TF32). The state stays in
 * the accumulators of the second product: warp w holds channels 16 (w mod M2) + [0, 16) of
 * N2 8-column tiles, M2 = KD / 16 tiles of channels.
 * OUT (ds_cu_set_kda_out_fused): pass 3 inside the walk, by eight more warps. The block has a
 * chunk's starting state and U in shared memory anyway: while the walk's warps make U = Ut - W S0
 * the output warps make Qp S0 from the same S0, and while the walk updates the state they add
 * P U — the block's two barriers a chunk are the only hand-overs (the walk alone measured no
 * faster doing both: its chain is what a chunk waits for, so the outputs go beside it, not in
 * it). Each output element takes the same mma steps in the same order as kda_chunk_out_tc_k, so
 * the outputs are the same bits. Nothing goes through memory between the passes (the chunks'
 * starting states and U, two thirds of what pass 3 read, are neither written nor read) and there
 * is no third launch. Qp and P rows come from memory as pass 3 read them; the four column groups
 * of a head read the same ones, mostly from L2. */
template <int KD, int PREC, bool OUT>
__global__ void __launch_bounds__(OUT ? 2 * KS_NT : KS_NT)
    kda_chunk_scan_tc_k(float *states, float *ug, float *o, const float *prep,
                        const kda_chunk *chunks, const int *seg_chunk0, float *const *S, int H) {
    PDL_ENTRY();
    constexpr bool B16 = PREC == 2; /* W and Kc^T handed over in BF16 (kda_chunked.cuh) */
    using SM = kda_scan_smem<KD, true, B16>;
    constexpr int WLD = SM::WLD, KLD = SM::KLD, ULD = SM::ULD;
    constexpr int M2 = KD / 16, N2 = 4 * M2 / 8; /* channel tiles; column tiles a warp holds */
    extern __shared__ float ssh[];
    float *Ss = ssh + 2 * SM::STAGE; /* [KD][ULD] the state's columns, as of this chunk */
    float *Us = Ss + KD * ULD;       /* [KC][ULD] this chunk's U */
    const int h = blockIdx.x, cg = blockIdx.y * KS_BV, z = blockIdx.z;
    const int warp = (threadIdx.x >> 5) & 7, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    float *Sh = S[z] + (size_t)h * KD * KD; /* [dk][dv] */
    /* second product's tile: channels m2 + g (+ 8), columns n2 + 8 n + 2 l4 (+ 1) */
    const int m2 = 16 * (warp % M2), n2 = 8 * N2 * (warp / M2);
    /* first product's tile (and an output warp's): rows m1 + g (+ 8), columns n1 + 8 n + 2 l4
     * (+ 1), n < 2 */
    const int m1 = 16 * (warp & 3), n1 = 16 * (warp >> 2);
    const int c0 = seg_chunk0[z], c1 = seg_chunk0[z + 1];
    if (OUT && threadIdx.x >= KS_NT) { /* the output warps: their own loop, the same barriers */
        kda_scan_outputs<KD, PREC>(o, prep, chunks, Ss, Us, c0, c1, H, h, cg, m1, n1, g, l4);
        return;
    }
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
    if (c0 < c1) kda_scan_stage<KD, true, B16>(ssh, 0, prep, c0, H, h, cg);
    for (int ci = c0; ci < c1; ci++) {
        const int s = (ci - c0) & 1;
        const float *W = ssh + s * SM::STAGE, *Kc = W + SM::W_FL, *Ut = Kc + SM::K_FL;
        const float *gL = Ut + KC * ULD;
        cp_async_wait_all();
        kda_scan_bar<OUT>(); /* stage s has landed for all; everyone is done with the last chunk */
        if (ci + 1 < c1) kda_scan_stage<KD, true, B16>(ssh, s ^ 1, prep, ci + 1, H, h, cg);
        if constexpr (!OUT) {
            float *sg =
                states + ((size_t)ci * H + h) * KD * KD; /* the state this chunk starts from */
#pragma unroll
            for (int n = 0; n < N2; n++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
                    *(float2 *)(sg + (size_t)(m2 + g + 8 * hh) * KD + cg + n2 + 8 * n + 2 * l4) =
                        make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
        }
        { /* U = Ut - W S0 */
            float acc[2][4] = {};
#pragma unroll 4
            for (int k0 = 0; k0 < KD; k0 += 8) {
                const tf32_a<PREC> af = a_rows<PREC, B16>(W, WLD, m1 + g, k0, l4);
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
                    if constexpr (!OUT)
                        *(float2 *)(ug + ((size_t)ci * H + h) * KC * KD + (size_t)row * KD + cg +
                                    cl) = u2;
                }
        }
        kda_scan_bar<OUT>(); /* U is whole; every read of Ss is done */
        { /* S0 <- e^{G_L} S0 + Kc^T U (rows past the chunk's length are zeros in Kc and U) */
            const float gl0 = gL[m2 + g], gl1 = gL[m2 + g + 8];
#pragma unroll
            for (int n = 0; n < N2; n++)
                st[n][0] *= gl0, st[n][1] *= gl0, st[n][2] *= gl1, st[n][3] *= gl1;
#pragma unroll 2
            for (int k0 = 0; k0 < KC; k0 += 8) {
                tf32_a<PREC> af; /* A = Kc^T: A(m, k) = Kc(k, m) */
                if constexpr (B16) {
                    af = a_rows<PREC, true>(Kc, KLD, m2 + g, k0, l4); /* (Kc^T's rows) */
                } else {
                    const float *ka = Kc + (k0 + l4) * KLD + m2 + g;
                    af = tf32_a<PREC>(ka[0], ka[8], ka[4 * KLD], ka[4 * KLD + 8]);
                }
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

/* the tensor-core passes' shared memory above the default 48 KB */
template <int KD, int PREC> static cudaError_t kda_tc_attrs() {
    cudaError_t e = cudaFuncSetAttribute(kda_chunk_out_tc_k<KD, PREC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)kda_out_tc_smem<KD>());
    constexpr int bytes = (int)kda_scan_smem<KD, true, PREC == 2>::BYTES;
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_scan_tc_k<KD, PREC, false>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_scan_tc_k<KD, PREC, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    return e;
}

template <int KD> cudaError_t kda_scan_attrs() {
    cudaError_t e =
        cudaFuncSetAttribute(kda_chunk_scan_k<KD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)kda_scan_smem<KD, false>::BYTES);
    if (e == cudaSuccess) e = kda_tc_attrs<KD, 1>();
    if (e == cudaSuccess) e = kda_tc_attrs<KD, 2>();
    if (e == cudaSuccess) e = kda_tc_attrs<KD, 3>();
    if (e == cudaSuccess) e = kda_tc_attrs<KD, 4>();
    return e;
}

/* Pass 2 on tensor cores in precision PREC, with pass 3 inside it (OUT) or after it. */
template <int KD, int PREC>
static void kda_scan_tc(ds_cu *c, dim3 sgrid, dim3 ogrid, float *o, float *states, float *ug,
                        const float *prep, const kda_chunk *tab, const int *first, float *const *S,
                        int H) {
    const size_t smem = kda_scan_smem<KD, true, PREC == 2>::BYTES;
    if (!c->kda_out_sep) {
        launch_k(c, kda_chunk_scan_tc_k<KD, PREC, true>, sgrid, 2 * KS_NT, smem, states, ug, o,
                 prep, tab, first, S, H);
        return;
    }
    launch_k(c, kda_chunk_scan_tc_k<KD, PREC, false>, sgrid, KS_NT, smem, states, ug, o, prep, tab,
             first, S, H);
    ds_cu_prof_mark(c, "kda chunks: outputs");
    launch_k(c, kda_chunk_out_tc_k<KD, PREC>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
             prep, tab, H);
}

template <int KD>
void kda_scan_launch(ds_cu *c, float *o, float *states, float *ug, const float *prep,
                     const kda_chunk *tab, const int *first, float *const *S, int n_ch, int n_seq,
                     int H) {
    const dim3 sgrid((unsigned)H, KD / KS_BV, (unsigned)n_seq), ogrid((unsigned)n_ch, (unsigned)H);
    if (c->kda_tc == 3)
        kda_scan_tc<KD, 3>(c, sgrid, ogrid, o, states, ug, prep, tab, first, S, H);
    else if (c->kda_tc == 4)
        kda_scan_tc<KD, 4>(c, sgrid, ogrid, o, states, ug, prep, tab, first, S, H);
    else if (c->kda_tc == 2)
        kda_scan_tc<KD, 2>(c, sgrid, ogrid, o, states, ug, prep, tab, first, S, H);
    else if (c->kda_tc)
        kda_scan_tc<KD, 1>(c, sgrid, ogrid, o, states, ug, prep, tab, first, S, H);
    else {
        launch_k(c, kda_chunk_scan_k<KD>, sgrid, KS_NT, kda_scan_smem<KD, false>::BYTES, states, ug,
                 prep, tab, first, S, H);
        ds_cu_prof_mark(c, "kda chunks: outputs");
        launch_k(c, kda_chunk_out_k<KD>, ogrid, 256, 0, o, states, ug, prep, tab, H);
    }
}

template cudaError_t kda_scan_attrs<64>();
template cudaError_t kda_scan_attrs<128>();
template void kda_scan_launch<64>(ds_cu *, float *, float *, float *, const float *,
                                  const kda_chunk *, const int *, float *const *, int, int, int);
template void kda_scan_launch<128>(ds_cu *, float *, float *, float *, const float *,
                                   const kda_chunk *, const int *, float *const *, int, int, int);
