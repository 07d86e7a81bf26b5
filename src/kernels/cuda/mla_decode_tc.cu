/* mla_decode_tc.cu — absorbed MLA over a long context on tensor cores (decode).
 *
 * A decode token's absorbed attention costs ~120 FLOPs a head for every latent row it reads
 * (scores over R + dr channels, outputs over R): at 32 heads ~70 KFLOP a 2,304-byte f32 row, ~30
 * FLOPs a byte, beyond what CUDA cores deliver at the memory's rate (mla_absorbed.cu's all-heads
 * kernel, f32 FMA, reads long contexts far below it: bench/RESULTS.md, session 32). Here both
 * products run as BF16 mma with
 * f32 accumulation, every head of the token at once as the M dimension (FlashMLA's layout):
 * block (token t, split s) takes its share of the token's rows in tiles of BK rows, and per tile
 *   1. cp.async the rows as stored into a ring of NST stages, NST - 1 tiles ahead of the one in
 *      use (the ring as deep as shared memory holds: a block an SM must keep enough bytes in
 *      flight by itself);
 *   2. f32 rows: converted to BF16 [BK][R + dr], rounded once; FP8 rows: their codes' bit fields
 *      moved into BF16's (exact, on the integer units: below), the rope part copied, the tiles'
 *      scales set aside for steps 3 and 4; BF16 rows (--kv-cache-dtype bf16) are staged in that
 *      form and used where they land;
 *   3. scores S [Ha][BK] = Q [Ha][R + dr] C^T: warp (channel group, row half), every head of the
 *      token as the M tiles, so a B fragment loaded from shared memory serves all of them; the
 *      groups' partial sums added in order through shared memory;
 *   4. an online softmax a head (max, sum, the rescale alpha), P in BF16;
 *   5. O [Ha][R] += P C[:, :R]: warp w the output columns [64 w, 64 w + 64) of every head,
 *      fragments by ldmatrix(.trans).
 * The splits' unnormalised outputs, maxima and sums go to mla_merge_k, as the other kernels'.
 * The BF16 rounding of the query, the rows and P is the fused prefill kernel's (mla_expanded.cu);
 * it is taken from DS_CUDA_MLA_DECODE_TC context rows (tuning.c), below which the f32 kernels
 * stay. The split of a token's rows is made from its own length inside the kernel, so a graph
 * captured at the step's power-of-two context cap keeps every block busy. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mla.cuh"

enum { TCD_R = 512, TCD_DR = 64 };

/* FP8 rows. Converting a code to f32, scaling it and rounding the product to BF16 takes the
 * conversion unit (a fraction of the integer units' rate) three times a pair of codes, ~15
 * instructions for four. Instead an E4M3 code becomes the BF16 word with its sign, exponent and
 * mantissa fields moved into BF16's (tcd_e4m3x8): exactly its value times 2^-120 (the biases differ
 * by 120; subnormal codes land on BF16 subnormals; a NaN code, which only a NaN latent writes,
 * reads as +-480), about two integer instructions a code. The tile's scale s (one a row for each
 * 128 c channels) and the 2^120 move to the other operand: the query's c channels are scaled by
 * 2^64 (exact; q C then runs 2^-56 below q c, in f32's normal range), a score warp's c part (its 8
 * k-steps lie in one scale tile) is multiplied by 2^56 and its rows' s before the rope k-step adds
 * in, and P is written once a tile for each of the four scale tiles, times 2^64 s of its row, so
 * that P C over the 64 output columns a warp holds (within one tile) sums p s c 2^-56, multiplied
 * by 2^56 when stored. Every product is as exact as the f32 rows' (the query, P times s and the
 * rope part rounded to BF16 once, the codes not rounded at all). */
#define TCD_F8_Q 0x1p64f /* the query's c channels */
#define TCD_F8_O 0x1p56f /* 2^120 / TCD_F8_Q: the scores' c part and the outputs */

/* eight E4M3 codes (the bytes of w, then of v; the first lowest) as BF16 words of their values
 * times 2^-120, in order */
static __device__ __forceinline__ uint4 tcd_e4m3x8(uint32_t w, uint32_t v) {
    const uint32_t mw = w & 0x7f7f7f7fu, sw = w & 0x80808080u;
    const uint32_t mv = v & 0x7f7f7f7fu, sv = v & 0x80808080u;
    /* codes 0 and 1 into the low and high halves: magnitude bits 4 up, the sign to bit 15 (the
     * two never overlap: + makes it one shift-add) */
    return make_uint4((__byte_perm(mw, 0, 0x4140) << 4) + __byte_perm(sw, 0, 0x1404),
                      (__byte_perm(mw, 0, 0x4342) << 4) + __byte_perm(sw, 0, 0x3424),
                      (__byte_perm(mv, 0, 0x4140) << 4) + __byte_perm(sv, 0, 0x1404),
                      (__byte_perm(mv, 0, 0x4342) << 4) + __byte_perm(sv, 0, 0x3424));
}

/* A stored row's bytes (kv_row.h's forms at R 512, dr 64: f32 2,304, FP8 656, BF16 1,152). */
template <int KV> __host__ __device__ constexpr int tcd_row_bytes() {
    return KV == DS_KV_FP8
               ? (TCD_R + 4 * ((TCD_R + DS_KV_FP8_TILE - 1) / DS_KV_FP8_TILE) + 2 * TCD_DR + 15) /
                     16 * 16
           : KV == DS_KV_BF16 ? 2 * (TCD_R + TCD_DR)
                              : 4 * (TCD_R + TCD_DR);
}

/* MT: 16-head M tiles (Ha = 16 MT); KV: the rows' dtype; BK: rows a tile (32, or 64 for the
 * quantized forms: fewer barriers and softmax passes a row, a shallower ring); NW: warps a block,
 * 8 (the query's fragments in registers) or 16 (BF16 rows and 64-row tiles only: the query in
 * shared memory and half the output columns a warp, so that a thread needs at most 128 registers
 * and twice the warps hide each phase's latency; Nsight Compute found the 8-warp kernel waiting
 * on its own dependency chains at 2 warps a scheduler, bench/RESULTS.md session 33) */
template <int MT, int KV, int BK, int NW = 8> struct tcd_shape {
    static constexpr int HA = 16 * MT, RQ = TCD_R + TCD_DR, NKS = RQ / 16, NT = 32 * NW;
    static constexpr int CG = 4, RH = NW / CG; /* score warps: channel groups x row groups */
    static constexpr int KSW = NKS / CG;       /* k-steps a score warp takes */
    static constexpr int NTR = BK / RH / 8;    /* 8-row score tiles a warp holds */
    static constexpr int NTW = TCD_R / 8 / NW; /* 8-column output tiles a warp holds */
    static constexpr bool QREG = NW == 8;      /* the query's A fragments in registers */
    static constexpr bool F8 = KV == DS_KV_FP8;
    static constexpr int NPG = F8 ? 4 : 1; /* P's copies: one a scale tile (FP8 rows) */
    static_assert(NKS % CG == 0 && NTR % 2 == 0 && NTW % 2 == 0 && (NW == 8 || NW == 16),
                  "warp layout");
    static_assert(!F8 || (NW == 8 && NTW == 8), "FP8 rows: an output warp within one scale tile");
    /* row strides: C's and P's rows 4 banks apart (ldmatrix without conflicts), the partial
     * scores' 8 (a warp's pair stores in two wavefronts) */
    static constexpr int CLD = RQ + 8, PLD = BK + 8, SLD = BK + 8;
    static constexpr int RB = tcd_row_bytes<KV>();
    static constexpr bool CONV = KV != DS_KV_BF16; /* staged as stored, then converted to C */
    /* a stage: BF16 rows in C's form, else the rows as stored */
    static constexpr int SB = CONV ? BK * RB : BK * CLD * 2;
    /* the ring as deep as 227 KB hold beside the rest (32-row tiles: f32 2 x 72 KB, FP8 6 x 21
     * KB, BF16 5 x 37 KB; 64-row tiles: 2) */
    static constexpr int NST = BK == 64 ? 2 : KV == DS_KV_F32 ? 2 : KV == DS_KV_FP8 ? 6 : 5;
    /* stages, C [BK][CLD] bf16 (converting forms), the rows' scales [BK][4] f32 (FP8), partial
     * scores [CG][HA][SLD] f32, P [NPG][HA][PLD] bf16, m, l, alpha [HA] f32, the query [HA][CLD]
     * bf16 (16 warps) */
    static constexpr size_t SMEM = (size_t)NST * SB + (CONV ? (size_t)BK * CLD * 2 : 0) +
                                   (F8 ? (size_t)BK * 4 * 4 : 0) + (size_t)CG * HA * SLD * 4 +
                                   (size_t)NPG * HA * PLD * 2 + (size_t)3 * HA * 4 +
                                   (QREG ? 0 : (size_t)HA * CLD * 2);
    static_assert(SMEM <= 227 * 1024, "shared memory");
};

/* query channels c, c + 1 (c even) of head h of token t as a BF16 pair: q̄ times qs (a power of
 * two: 1, or TCD_F8_Q for FP8 rows) below R, qR above */
static __device__ __forceinline__ uint32_t tcd_q2(const float *qbar, const float *qr, int ldqr,
                                                  int HA, int t, int h, int c, float qs) {
    if (c < TCD_R) {
        const float2 v = *(const float2 *)(qbar + ((size_t)t * HA + h) * TCD_R + c);
        return pack_bf16x2(v.x * qs, v.y * qs);
    }
    const float2 v = *(const float2 *)(qr + ((size_t)t * HA + h) * ldqr + c - TCD_R);
    return pack_bf16x2(v.x, v.y);
}

/* k-step ks (16 channels) of score warp cg's KSW: a contiguous quarter of the NKS = 36; FP8 rows:
 * tile cg's 8 (its 128 c channels share each row's scale), then rope k-step cg */
template <int KV, int KSW> static __device__ __forceinline__ int tcd_kstep(int cg, int ks) {
    if constexpr (KV == DS_KV_FP8) {
        static_assert(KSW == 9, "four score warps a row group");
        return ks < 8 ? 8 * cg + ks : 32 + cg;
    } else {
        return cg * KSW + ks;
    }
}

/* score warp cg's A fragments of every head of token t, in registers: qf[mt][ks] the heads
 * 16 mt + g (+8), channels of k-step ks (tcd_kstep) 2 l4 (+1, +8, +9); RAW (FP8 rows, the scores
 * from the staged codes, tcd_scores_raw): the k-steps' channels permuted as there, k indices 2 l4
 * (+1) and 2 l4 + 8 (+9) standing for channels c (+1) and c + 2 (+3), c = 128 cg + 64 (ks / 4) +
 * 16 l4 + 4 (ks % 4) of the c part, and 512 + 16 cg + 4 l4 of the rope part (ks 8) */
template <int MT, int KV, int KSW, bool RAW = false>
static __device__ __forceinline__ void tcd_query_regs(uint32_t (&qf)[MT][KSW][4], const float *qbar,
                                                      const float *qr, int ldqr, int t, int cg,
                                                      int lane) {
    constexpr int HA = 16 * MT;
    const float qs = KV == DS_KV_FP8 ? TCD_F8_Q : 1.0f;
    const int g = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int ks = 0; ks < KSW; ks++) {
            const int h0 = 16 * mt + g;
            int c = 16 * tcd_kstep<KV, KSW>(cg, ks) + 2 * l4, c2 = c + 8;
            if constexpr (RAW) {
                c = ks < 8 ? 128 * cg + 64 * (ks >> 2) + 16 * l4 + 4 * (ks & 3)
                           : TCD_R + 16 * cg + 4 * l4;
                c2 = c + 2;
            }
            qf[mt][ks][0] = tcd_q2(qbar, qr, ldqr, HA, t, h0, c, qs);
            qf[mt][ks][1] = tcd_q2(qbar, qr, ldqr, HA, t, h0 + 8, c, qs);
            qf[mt][ks][2] = tcd_q2(qbar, qr, ldqr, HA, t, h0, c2, qs);
            qf[mt][ks][3] = tcd_q2(qbar, qr, ldqr, HA, t, h0 + 8, c2, qs);
        }
}

/* staged row (its bytes at `raw`, f32 or FP8) as BF16 channels c .. c + 3 (c a multiple of 4):
 * the f32 values the CPU reads (kv_row_vals), rounded once */
template <int KV> static __device__ __forceinline__ uint2 tcd_vals(const uint8_t *raw, int c) {
    float x[4];
    kv_row_vals<KV, 4>(raw, 0, TCD_R, c, x);
    return make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]));
}

/* ---- the phases both kernels below run (one definition, so the same words) ---- */

/* split s of token t's context (n_split shares of whole BK-row tiles): rows [*j0, *j1), *ntile
 * tiles */
template <int BK>
static __device__ __forceinline__ void tcd_split(const int32_t *tok_pos, int t, int s, int n_split,
                                                 int *j0, int *j1, int *ntile) {
    const int n = tok_pos[t] + 1;
    const int per = ((n + n_split - 1) / n_split + BK - 1) / BK * BK;
    *j0 = min(n, s * per), *j1 = min(n, *j0 + per), *ntile = (*j1 - *j0 + BK - 1) / BK;
}

/* rows [a, a + BK) of a token's context (page table `table`, pages of bs rows; from j1 on, zeros)
 * into dst, DLD bytes apart, by cp.async: a warp a row (warps w0, w0 + NWS, ..), its lanes along
 * it, the page looked up once a row — every row's page first, so that the warp waits for its
 * lookups once, not once a row: with most of L1 given to shared memory a lookup is a trip to L2,
 * and four of them in a row were most of the staging warps' time a tile (the timing build,
 * bench/RESULTS.md session 43). (sm_90's bulk copies, one instruction a row, were tried in session
 * 33: no faster.) */
template <int BK, int RB, int DLD, int NWS>
static __device__ __forceinline__ void tcd_stage_rows(uint8_t *dst, const void *pool,
                                                      const int32_t *table, int bs, int a, int j1,
                                                      int w0, int lane) {
    static_assert(BK % NWS == 0, "whole rows a warp");
    constexpr int RPW = BK / NWS; /* rows a warp */
    int page[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) page[r] = __ldg(table + min(a + w0 + r * NWS, j1 - 1) / bs);
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        const int j = w0 + r * NWS, p = min(a + j, j1 - 1);
        const uint8_t *src = (const uint8_t *)pool + ((size_t)page[r] * bs + p % bs) * RB;
        for (int c = lane; c < RB / 16; c += 32)
            cp_async16_zfill(dst + j * DLD + 16 * c, src + 16 * c, a + j < j1);
    }
}

/* the whole query of token t as BF16 pairs, Qs [HA][CLD], by threads tid, tid + NTH, .. */
template <int HA, int CLD, int NTH>
static __device__ __forceinline__ void tcd_query_smem(uint16_t *Qs, const float *qbar,
                                                      const float *qr, int ldqr, int t, int tid) {
    constexpr int RQ = TCD_R + TCD_DR;
    for (int i = tid; i < HA * (RQ / 2); i += NTH) {
        const int h = i / (RQ / 2), c = 2 * (i - h * (RQ / 2));
        *(uint32_t *)(Qs + h * CLD + c) = tcd_q2(qbar, qr, ldqr, HA, t, h, c, 1.0f);
    }
}

/* a tile's stored f32 rows rs (RB bytes apart) as BF16 rows C [BK][CLD], by threads tid, + NTH,
 * .. */
template <int KV, int BK, int RB, int CLD, int NTH>
static __device__ __forceinline__ void tcd_convert(uint16_t *C, const uint8_t *rs, int tid) {
    constexpr int RQ = TCD_R + TCD_DR;
    for (int i = tid; i < BK * (RQ / 4); i += NTH) {
        const int j = i / (RQ / 4), c = 4 * (i - j * (RQ / 4));
        *(uint2 *)(C + j * CLD + c) = tcd_vals<KV>(rs + j * RB, c);
    }
}

/* FP8 rows: what score warp (cg, rh) reads of the tile, made by that warp alone (so that no
 * barrier stands between the conversion and the scores): rows [RW rh, RW rh + RW) of the stored
 * tile rs (RB bytes apart), their c channels of scale tile cg as tcd_e4m3x8 words and rope
 * channels [16 cg, 16 cg + 16) as stored into C [BK][CLD], and the rows' scale cg into Ss [BK][4]
 * (the softmax, after the scores' barrier, reads all four). A half-warp reads the 128 code bytes
 * of one row. */
template <int RW, int RB, int CLD>
static __device__ __forceinline__ void tcd_convert_f8(uint16_t *C, float *Ss, const uint8_t *rs,
                                                      int cg, int rh, int lane) {
    constexpr int RA = TCD_R + 4 * (TCD_R / DS_KV_FP8_TILE); /* the rope part's byte */
    static_assert(RW % 16 == 0 && RW <= 32 && RA % 16 == 0 && TCD_DR == 64 && DS_KV_FP8_TILE == 128,
                  "conversion layout");
    const int q = lane & 15, r0 = RW * rh;
#pragma unroll 4
    for (int j = r0 + (lane >> 4); j < r0 + RW; j += 2) { /* codes [128 cg + 8 q, + 8) */
        const uint2 w = *(const uint2 *)(rs + j * RB + 128 * cg + 8 * q);
        *(uint4 *)(C + j * CLD + 128 * cg + 8 * q) = tcd_e4m3x8(w.x, w.y);
    }
#pragma unroll
    for (int j = r0 + (lane >> 1); j < r0 + RW; j += 16) /* rope: 16 bytes a lane, two a row */
        *(uint4 *)(C + j * CLD + TCD_R + 16 * cg + 8 * (lane & 1)) =
            *(const uint4 *)(rs + j * RB + RA + 32 * cg + 16 * (lane & 1));
    if (lane < RW)
        Ss[4 * (r0 + lane) + cg] = *(const float *)(rs + (r0 + lane) * RB + TCD_R + 4 * cg);
    __syncwarp();
}

/* FP8 rows, the warp-specialized form's OCV: the codes of output warp w's own columns [64 w,
 * 64 w + 64) of the BK staged rows rs (DLD bytes apart) as tcd_e4m3x8 words into C [BK][CLD], by
 * that warp alone (it alone reads them, so no barrier: the warp's own ldmatrix before and after).
 * A quarter warp takes two rows' 64 codes (DLD 64 mod 128: every bank once), its stores 16 bytes
 * a lane (CLD's rows 16 bytes apart in the banks: once each too). */
template <int BK, int DLD, int CLD>
static __device__ __forceinline__ void tcd_convert_f8_cols(uint16_t *C, const uint8_t *rs, int w,
                                                           int lane) {
    const int q = lane & 3;
    __syncwarp(); /* the warp's last reads of this buffer are done */
#pragma unroll
    for (int j = lane >> 2; j < BK; j += 8) {
        const uint4 u = *(const uint4 *)(rs + j * DLD + 64 * w + 16 * q);
        uint4 *d = (uint4 *)(C + j * CLD + 64 * w + 16 * q);
        d[0] = tcd_e4m3x8(u.x, u.y);
        d[1] = tcd_e4m3x8(u.z, u.w);
    }
    __syncwarp();
}

/* a score warp's C fragments sc (heads 16 mt + g (+8), rows (NTR rh + nt) 8 + 2 l4 (+1)) into its
 * group cg's partial scores Sp [CG][HA][SLD] */
template <int MT, int NTR, int SLD>
static __device__ __forceinline__ void tcd_scores_out(float *Sp, const float (&sc)[MT][NTR][4],
                                                      int cg, int rh, int lane) {
    constexpr int HA = 16 * MT;
    const int g = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float *sp = Sp + ((size_t)cg * HA + 16 * mt) * SLD + 8 * NTR * rh;
#pragma unroll
        for (int nt = 0; nt < NTR; nt++) {
            *(float2 *)(sp + g * SLD + nt * 8 + 2 * l4) = make_float2(sc[mt][nt][0], sc[mt][nt][1]);
            *(float2 *)(sp + (g + 8) * SLD + nt * 8 + 2 * l4) =
                make_float2(sc[mt][nt][2], sc[mt][nt][3]);
        }
    }
}

/* Scores of every head over a warp's channels (group cg: KSW k-steps, tcd_kstep) and rows (half
 * rh: NTR 8-row tiles) of the tile C, into Sp [CG][HA][SLD]: the query's A fragments from qf
 * (QREG) or from Qs by ldmatrix; FP8 rows: the c part times 2^56 and the rows' scales Ss [BK][4]
 * of tile cg before the rope k-step. */
template <int MT, int KV, int KSW, int NTR, int CLD, int SLD, bool QREG, int QM, int QK>
static __device__ __forceinline__ void tcd_scores(float *Sp, const uint16_t *C, const uint16_t *Qs,
                                                  const uint32_t (&qf)[QM][QK][4], const float *Ss,
                                                  int cg, int rh, int lane) {
    const int l4 = lane & 3, mi = lane >> 3, mr = lane & 7;
    float sc[MT][NTR][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < NTR; i++)
            sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KSW; ks++) {
        const int kk = tcd_kstep<KV, KSW>(cg, ks);
        if constexpr (KV == DS_KV_FP8) {
            if (ks == 8) /* the c part complete: element e's row (NTR rh + nt) 8 + 2 l4 + e % 2 */
#pragma unroll
                for (int nt = 0; nt < NTR; nt++) {
                    const int r0 = (NTR * rh + nt) * 8 + 2 * l4;
                    const float s0 = Ss[4 * r0 + cg], s1 = Ss[4 * r0 + 4 + cg];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        float *d = sc[mt][nt];
                        d[0] = d[0] * TCD_F8_O * s0, d[1] = d[1] * TCD_F8_O * s1;
                        d[2] = d[2] * TCD_F8_O * s0, d[3] = d[3] * TCD_F8_O * s1;
                    }
                }
        }
        uint32_t qa[MT][4]; /* heads +8 for odd mi, channels +8 for mi >= 2 */
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if constexpr (QREG) {
#pragma unroll
                for (int e = 0; e < 4; e++) qa[mt][e] = qf[mt][ks][e];
            } else {
                ldsm_x4(qa[mt], Qs + (16 * mt + (mi & 1) * 8 + mr) * CLD + kk * 16 + (mi >> 1) * 8);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NTR; nt += 2) {
            uint32_t
                b[4]; /* rows of the warp's tiles nt (+1 for mi >= 2), channels +8 for odd mi */
            ldsm_x4(b, C + ((NTR * rh + nt + (mi >> 1)) * 8 + mr) * CLD + kk * 16 + (mi & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(sc[mt][nt], qa[mt], b[0], b[1]);
                mma_16816(sc[mt][nt + 1], qa[mt], b[2], b[3]);
            }
        }
    }
    tcd_scores_out<MT, NTR, SLD>(Sp, sc, cg, rh, lane);
}

/* FP8 rows, the warp-specialized form's OCV: tcd_scores' products, with the B fragments taken
 * straight from the staged codes rs (rows DLD bytes apart) instead of a converted tile. Within a
 * k-step the order of the 16 channels is free as long as the query's fragments follow it
 * (tcd_query_regs' RAW): k-step 4 h + j of the c part (channels 128 cg + 64 h + [0, 64)) gives lane
 * (g, l4) the channels 64 h + 16 l4 + 4 j + [0, 4) of its row g, so that one 16-byte load of a
 * row's codes is four k-steps' fragments (two tcd_e4m3x8 words a k-step); the rope k-step the
 * channels 16 cg + 4 l4 + [0, 4) (8 bytes, as stored). The c part times 2^56 and the rows' scales
 * before the rope k-step adds in, as in tcd_scores; the warp first copies its rows' scale cg into
 * St [4][BK] (rows DLD bytes apart meet two banks; there each lane's pair is one load, and the
 * softmax reads all four after the scores' barrier). */
template <int MT, int NTR, int BK, int DLD, int SLD>
static __device__ __forceinline__ void tcd_scores_raw(float *Sp, float *St, const uint8_t *rs,
                                                      const uint32_t (&qf)[MT][9][4], int cg,
                                                      int rh, int lane) {
    constexpr int RA = TCD_R + 4 * (TCD_R / DS_KV_FP8_TILE);
    static_assert(RA % 16 == 0 && DLD % 16 == 0 && DS_KV_FP8_TILE == 128, "raw layout");
    const int g = lane >> 2, l4 = lane & 3;
    float sc[MT][NTR][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < NTR; i++)
            sc[mt][i][0] = sc[mt][i][1] = sc[mt][i][2] = sc[mt][i][3] = 0.0f;
    if (lane < 8 * NTR)
        St[cg * BK + 8 * NTR * rh + lane] =
            *(const float *)(rs + (8 * NTR * rh + lane) * DLD + TCD_R + 4 * cg);
    uint4 raw[NTR][2]; /* row (NTR rh + nt) 8 + g: codes 128 cg + 64 h + 16 l4 + [0, 16) */
#pragma unroll
    for (int nt = 0; nt < NTR; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            raw[nt][h] = *(const uint4 *)(rs + ((NTR * rh + nt) * 8 + g) * DLD + 128 * cg + 64 * h +
                                          16 * l4);
#pragma unroll
    for (int kp = 0; kp < 4; kp++) { /* k-steps 2 kp, 2 kp + 1: 8 codes of each row */
#pragma unroll
        for (int nt = 0; nt < NTR; nt++) {
            const uint4 u = raw[nt][kp >> 1];
            const uint4 b = kp & 1 ? tcd_e4m3x8(u.z, u.w) : tcd_e4m3x8(u.x, u.y);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(sc[mt][nt], qf[mt][2 * kp], b.x, b.y);
                mma_16816(sc[mt][nt], qf[mt][2 * kp + 1], b.z, b.w);
            }
        }
    }
    __syncwarp(); /* St's rows of this warp written */
#pragma unroll
    for (int nt = 0; nt < NTR; nt++) { /* element e's row (NTR rh + nt) 8 + 2 l4 + e % 2 */
        const float2 s = *(const float2 *)(St + cg * BK + (NTR * rh + nt) * 8 + 2 * l4);
        const float s0 = s.x * TCD_F8_O, s1 = s.y * TCD_F8_O;
        const uint2 b =
            *(const uint2 *)(rs + ((NTR * rh + nt) * 8 + g) * DLD + RA + 2 * (16 * cg + 4 * l4));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            sc[mt][nt][0] *= s0, sc[mt][nt][1] *= s1, sc[mt][nt][2] *= s0, sc[mt][nt][3] *= s1;
            mma_16816(sc[mt][nt], qf[mt][8], b.x, b.y);
        }
    }
    tcd_scores_out<MT, NTR, SLD>(Sp, sc, cg, rh, lane);
}

/* The online softmax of a tile whose first row is a (rows from j1 on masked) over its CG groups'
 * partial scores: NTH / HA threads a head (thread tid), BK / that rows each; P [HA][PLD] in BF16
 * (FP8 rows: P [4][HA][PLD], copy i times 2^64 and the rows' scales Ss [BK][SST] of tile i, or
 * with SST 0 Ss [4][BK]), the rescale of each head into al[h], m and l updated. */
template <int KV, int HA, int NTH, int BK, int CG, int SLD, int PLD, int SST = 4>
static __device__ __forceinline__ void tcd_softmax(const float *Sp, uint16_t *P, const float *Ss,
                                                   float *m_sh, float *l_sh, float *al, int tid,
                                                   int a, int j1, float scale) {
    constexpr int TPH = NTH / HA, EPT = BK / TPH;
    const int h = tid / TPH, e0 = (tid % TPH) * EPT;
    const float m_old = m_sh[h];
    float v[EPT], mx = -INFINITY;
#pragma unroll
    for (int e = 0; e < EPT; e++) {
        float x = 0.0f;
#pragma unroll
        for (int k = 0; k < CG; k++) x += Sp[((size_t)k * HA + h) * SLD + e0 + e];
        v[e] = a + e0 + e < j1 ? x * scale : -INFINITY;
        mx = fmaxf(mx, v[e]);
    }
#pragma unroll
    for (int o = TPH / 2; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m_old, mx); /* finite: the tile has a row */
    float ps = 0.0f;
#pragma unroll
    for (int e = 0; e < EPT; e += 2) {
        const float p0 = v[e] == -INFINITY ? 0.0f : expf(v[e] - m_new);
        const float p1 = v[e + 1] == -INFINITY ? 0.0f : expf(v[e + 1] - m_new);
        ps += p0 + p1;
        if constexpr (KV == DS_KV_FP8) {
            float4 s0, s1; /* rows e0 + e, e0 + e + 1: their four scales */
            if constexpr (SST == 0) {
                float2 st[4];
#pragma unroll
                for (int i = 0; i < 4; i++) st[i] = *(const float2 *)(Ss + i * BK + e0 + e);
                s0 = make_float4(st[0].x, st[1].x, st[2].x, st[3].x);
                s1 = make_float4(st[0].y, st[1].y, st[2].y, st[3].y);
            } else {
                s0 = *(const float4 *)(Ss + SST * (e0 + e));
                s1 = *(const float4 *)(Ss + SST * (e0 + e + 1));
            }
            const float q0 = p0 * TCD_F8_Q, q1 = p1 * TCD_F8_Q;
            uint32_t *pp = (uint32_t *)(P + h * PLD + e0 + e);
            pp[0] = pack_bf16x2(q0 * s0.x, q1 * s1.x);
            pp[HA * PLD / 2] = pack_bf16x2(q0 * s0.y, q1 * s1.y);
            pp[HA * PLD] = pack_bf16x2(q0 * s0.z, q1 * s1.z);
            pp[3 * HA * PLD / 2] = pack_bf16x2(q0 * s0.w, q1 * s1.w);
        } else {
            *(uint32_t *)(P + h * PLD + e0 + e) = pack_bf16x2(p0, p1);
        }
    }
#pragma unroll
    for (int o = TPH / 2; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    if (tid % TPH == 0) {
        const float alpha = expf(m_old - m_new); /* 0 at the first tile */
        al[h] = alpha, l_sh[h] = l_sh[h] * alpha + ps, m_sh[h] = m_new;
    }
}

/* oacc (every head x the output columns [8 NTW w, 8 NTW (w + 1)) of R) rescaled by al, unless no
 * head of the token found a new maximum (over a long context, most tiles), then += P C over the
 * tile's BK rows */
template <int MT, int NTW, int BK, int CLD, int PLD>
static __device__ __forceinline__ void tcd_outputs(float (&oacc)[MT][NTW][4], const uint16_t *P,
                                                   const uint16_t *C, const float *al, int w,
                                                   int lane) {
    const int g = lane >> 2, mi = lane >> 3, mr = lane & 7;
    bool same = true;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) same &= al[16 * mt + g] == 1.0f && al[16 * mt + g + 8] == 1.0f;
    if (!__all_sync(0xffffffffu, same))
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const float al0 = al[16 * mt + g], al1 = al[16 * mt + g + 8];
#pragma unroll
            for (int i = 0; i < NTW; i++)
                oacc[mt][i][0] *= al0, oacc[mt][i][1] *= al0, oacc[mt][i][2] *= al1,
                    oacc[mt][i][3] *= al1;
        }
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        uint32_t pa[MT][4]; /* heads +8 for odd mi, rows +8 for mi >= 2 */
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            ldsm_x4(pa[mt], P + (16 * mt + (mi & 1) * 8 + mr) * PLD + kk * 16 + (mi >> 1) * 8);
#pragma unroll
        for (int i = 0; i < NTW; i += 2) {
            uint32_t b[4]; /* rows +8 for odd mi, columns of tile i (+1 for mi >= 2) */
            ldsm_x4_trans(b,
                          C + (kk * 16 + (mi & 1) * 8 + mr) * CLD + (w * NTW + i + (mi >> 1)) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(oacc[mt][i], pa[mt], b[0], b[1]);
                mma_16816(oacc[mt][i + 1], pa[mt], b[2], b[3]);
            }
        }
    }
}

/* oacc's C fragments (heads g (elements 0, 1) and g + 8 (2, 3), columns 2 l4 (+1)) times os (1,
 * or TCD_F8_O for FP8 rows) into split s of token t's part_o rows; an empty split leaves zeros and
 * l = 0, which the merge skips */
template <int MT, int NTW>
static __device__ __forceinline__ void tcd_store(float *part_o, const float (&oacc)[MT][NTW][4],
                                                 int t, int s, int n_split, int w, int lane,
                                                 float os) {
    constexpr int HA = 16 * MT;
    const int g = lane >> 2, l4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < NTW; i++) {
            const int col = (w * NTW + i) * 8 + 2 * l4, h0 = 16 * mt + g;
            float *po0 = part_o + (((size_t)t * HA + h0) * n_split + s) * TCD_R + col;
            float *po1 = part_o + (((size_t)t * HA + h0 + 8) * n_split + s) * TCD_R + col;
            *(float2 *)po0 = make_float2(oacc[mt][i][0] * os, oacc[mt][i][1] * os);
            *(float2 *)po1 = make_float2(oacc[mt][i][2] * os, oacc[mt][i][3] * os);
        }
}

/* long: the five phases above share the block's stages and the output fragments in registers. */
template <int MT, int KV, int BK, int NW>
__global__ void __launch_bounds__(32 * NW, 1)
    mla_tcd_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr,
              const void *pool, const int32_t *tables, const int32_t *tok_bt,
              const int32_t *tok_pos, int bs, float scale, int n_split) {
    typedef tcd_shape<MT, KV, BK, NW> L;
    constexpr int HA = L::HA, CLD = L::CLD, PLD = L::PLD, SLD = L::SLD, NTR = L::NTR, NT = L::NT;
    constexpr int NST = L::NST, RB = L::RB;
    constexpr int DLD = L::CONV ? RB : CLD * 2; /* a staged row's stride, bytes */
    extern __shared__ __align__(16) uint8_t tsh[];
    uint8_t *ring = tsh;                                                 /* [NST][SB] */
    uint16_t *Cc = (uint16_t *)(ring + (size_t)NST * L::SB);             /* [BK][CLD] (CONV) */
    float *Ss = (float *)((uint8_t *)Cc + (L::CONV ? BK * CLD * 2 : 0)); /* [BK][4] (FP8) */
    float *Sp = Ss + (L::F8 ? BK * 4 : 0);                               /* [CG][HA][SLD] */
    uint16_t *Ps = (uint16_t *)(Sp + L::CG * HA * SLD);                  /* [NPG][HA][PLD] */
    float *m_sh = (float *)(Ps + L::NPG * HA * PLD), *l_sh = m_sh + HA, *a_sh = l_sh + HA;
    uint16_t *Qs = (uint16_t *)(a_sh + HA); /* [HA][CLD] (16 warps) */
    const int t = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
    const int lane = tid & 31;
    const int cg = warp % L::CG, rh = warp / L::CG; /* scores: channel group, row half */
    PDL_ENTRY();
    const int32_t *table = tables + tok_bt[t];
    int j0, j1, ntile; /* this split's rows: the token's own context in shares of whole tiles */
    tcd_split<BK>(tok_pos, t, s, n_split, &j0, &j1, &ntile);
    /* tile it's rows (zeros past j1) into ring slot it % NST, one commit group whether or not
     * there is such a tile, so that the group count says which tiles have landed */
    auto stage = [&](int it) {
        if (it < ntile) {
            const int a = j0 + it * BK;
            uint8_t *dst = ring + (size_t)(it % NST) * L::SB;
            tcd_stage_rows<BK, RB, DLD, NW>(dst, pool, table, bs, a, j1, warp, lane);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < NST - 1; i++) stage(i); /* on their way while the queries load */
    /* every head, the warp's channels, as A fragments: in registers (8 warps), or the whole
     * query in shared memory as BF16 pairs (16 warps: the same values, read by ldmatrix) */
    uint32_t qf[L::QREG ? MT : 1][L::QREG ? L::KSW : 1][4];
    if constexpr (L::QREG) {
        tcd_query_regs<MT, KV, L::KSW>(qf, qbar, qr, ldqr, t, cg, lane);
    } else {
        tcd_query_smem<HA, CLD, NT>(Qs, qbar, qr, ldqr, t, tid);
    } /* (Qs is read after the first tile's barrier) */
    if (tid < HA) m_sh[tid] = -INFINITY, l_sh[tid] = 0.0f;
    float oacc[MT][L::NTW][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < L::NTW; i++)
            oacc[mt][i][0] = oacc[mt][i][1] = oacc[mt][i][2] = oacc[mt][i][3] = 0.0f;
    for (int it = 0; it < ntile; it++) {
        const int a = j0 + it * BK;
        /* NST - 1 + it groups committed, tile it's the (it + 1)-th */
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NST - 2) : "memory");
        __syncthreads(); /* tile it has landed; tile it - 1's products are done with its slot */
        stage(it + NST - 1);
        const uint8_t *rs = ring + (size_t)(it % NST) * L::SB;
        const uint16_t *C = (const uint16_t *)rs;
        if constexpr (KV == DS_KV_FP8) { /* (each warp its own part: no barrier) */
            tcd_convert_f8<BK / L::RH, RB, CLD>(Cc, Ss, rs, cg, rh, lane);
            C = Cc;
        } else if constexpr (L::CONV) {
            tcd_convert<KV, BK, RB, CLD, NT>(Cc, rs, tid);
            __syncthreads();
            C = Cc;
        }
        /* scores of every head over the warp's channels and rows */
        tcd_scores<MT, KV, L::KSW, NTR, CLD, SLD, L::QREG>(Sp, C, Qs, qf, Ss, cg, rh, lane);
        __syncthreads();
        tcd_softmax<KV, HA, NT, BK, L::CG, SLD, PLD>(Sp, Ps, Ss, m_sh, l_sh, a_sh, tid, a, j1,
                                                     scale);
        __syncthreads();
        /* (FP8 rows: warp w's 64 columns lie in scale tile w / 2, P's copy w / 2) */
        tcd_outputs<MT, L::NTW, BK, CLD, PLD>(oacc, Ps + (L::F8 ? (warp >> 1) * HA * PLD : 0), C,
                                              a_sh, warp, lane);
    }
    cp_async_wait_all(); /* (the groups past the last tile are empty) */
    tcd_store<MT, L::NTW>(part_o, oacc, t, s, n_split, warp, lane, L::F8 ? TCD_F8_O : 1.0f);
    __syncthreads(); /* (m and l of an empty split are their initial values) */
    if (tid < HA) {
        float *pml = part_ml + (((size_t)t * HA + tid) * n_split + s) * 2;
        pml[0] = m_sh[tid], pml[1] = l_sh[tid];
    }
}

/* ---- the warp-specialized form (BF16 and FP8 rows) ---------------------------------------------
 * The kernel above runs its phases one after another, every warp in each, a barrier between: with
 * one block an SM each phase's chain of latencies is exposed (Nsight Compute, bench/RESULTS.md
 * session 33: 6.3 cycles between a warp's instructions, the tensor pipe 21% busy). Here 16 warps
 * split the work as FlashMLA's two warpgroups do: warps 0-7 (S) make the scores and the softmax of
 * tile it while warps 8-15 (O) add tile it - 1's P C to the outputs, so that the two chains
 * overlap. The O warps also stage the rows (cp.async into a ring of four 32-row tiles: tile it + 4
 * into tile it's slot once its outputs are done), which balances the groups' instructions. They
 * hand over through named barriers: FULL[b] (P and alpha of tile it written to buffer b = it % 2)
 * and LAND[b] (tile it's rows landed, and tile it - 2's outputs done, so that P[b] and C[b] may be
 * written again). The S warps hold the query's fragments in registers (they hold no outputs).
 * FP8 rows are converted into C[b], a double-buffered BF16 tile, by the S warps, each its own part
 * (the 8-warp 32-row kernel's products, softmax and orders: 4 channel groups x 2 row halves for
 * the scores, 8 threads a head for the softmax at 32 heads, 64 output columns a warp, so its
 * words are that kernel's, as the BF16 rows' are) or, with OCV (ds_cu_set_mla_ws_oconv), the S
 * warps take their B fragments straight from the staged codes in registers (tcd_scores_raw: no
 * conversion through shared memory on the chain that sets the pace) and each O warp converts the
 * 64 columns it multiplies itself, a tile ahead (tcd_convert_f8_cols). */
template <int MT, int KV, bool OCV = false> struct tcw_shape {
    static constexpr int HA = 16 * MT, RQ = TCD_R + TCD_DR, NKS = RQ / 16;
    static constexpr int BK = 32, NST = 4, NS = 256; /* rows a tile; ring slots; S threads */
    static constexpr int CG = 4, RH = 2, KSW = NKS / CG, NTR = BK / RH / 8, NTW = TCD_R / 8 / 8;
    static constexpr int CLD = RQ + 8, PLD = BK + 8, SLD = BK + 8, RB = tcd_row_bytes<KV>();
    static constexpr bool CONV = KV == DS_KV_FP8; /* staged as stored, converted into C[b] */
    static constexpr bool RAW = CONV && OCV;      /* scores from the staged codes */
    static constexpr int NPG = CONV ? 4 : 1;      /* P's copies: one a scale tile (FP8) */
    /* a staged row's stride, bytes: RAW 64 (mod 128) past RB, so that the S warps' 16-byte loads
     * of two rows' 64 codes each (a quarter warp) fall on all 32 banks once */
    static constexpr int DLD = RAW ? RB + (64 - RB % 128 + 128) % 128 : CONV ? RB : CLD * 2;
    static constexpr int SB = BK * DLD; /* a ring slot's bytes */
    /* ring [NST][BK][DLD] bytes, (FP8) C [2][BK][CLD] bf16 and the rows' scales [2][BK][4] f32
     * (RAW: [4][BK], each tile's column, so that neither the scores' loads of rows 2 l4 nor the
     * softmax's of rows 4 k meet a bank twice, as they would in the staged rows), partial scores
     * [CG][HA][SLD] f32, P [2][NPG][HA][PLD] bf16, m and l [HA] f32, alpha [2][HA] f32 (the
     * query's fragments are in the S warps' registers) */
    static constexpr int NSS = CONV ? (RAW ? 4 * BK : 2 * BK * 4) : 0; /* the scales' floats */
    static constexpr size_t SMEM = (size_t)NST * SB + (CONV ? (size_t)2 * BK * CLD * 2 : 0) +
                                   (size_t)NSS * 4 + (size_t)CG * HA * SLD * 4 +
                                   (size_t)2 * NPG * HA * PLD * 2 + (size_t)4 * HA * 4;
    static_assert(NKS % CG == 0 && NTR == 2 && NS % HA == 0 && (BK * HA / NS) % 2 == 0, "layout");
    static_assert(!RAW || (DLD % 128 == 64 && KSW == 9), "RAW: staged rows' banks, k-steps");
    static_assert(SMEM <= 227 * 1024, "shared memory");
};

/* Built with -DDS_MLA_TCW_CLOCKS (pack_devbin.sh's timing build), the warp-specialized kernel adds
 * up the cycles each warp's lane 0 spends in each phase of its loop (clock() between the marks;
 * a phase's asynchronous loads and mma may finish in the next one) for ds_cu_mla_tcw_clocks: S
 * warps 0 LAND's wait, 1 the FP8 conversion (the default form), 2 the scores, 3 their barrier, 4
 * the softmax; O warps 5 FULL's wait, 6 the outputs, 7 their barrier, 8 the staging and LAND, 9
 * the conversion of their columns (OCV). Otherwise the marks are nothing. */
#ifdef DS_MLA_TCW_CLOCKS
__device__ unsigned long long g_mla_tcw_clk[10];
#define TCW_CLK_START()                                                                            \
    unsigned tclk_ = (unsigned)clock();                                                            \
    unsigned tacc_[10] = {}
#define TCW_CLK(k)                                                                                 \
    do {                                                                                           \
        const unsigned t_ = (unsigned)clock();                                                     \
        tacc_[k] += t_ - tclk_; /* (a warp's sum over its tiles fits 32 bits) */                   \
        tclk_ = t_;                                                                                \
    } while (0)
#define TCW_CLK_END()                                                                              \
    do {                                                                                           \
        if (lane == 0)                                                                             \
            for (int k_ = 0; k_ < 10; k_++)                                                        \
                if (tacc_[k_]) atomicAdd(&g_mla_tcw_clk[k_], (unsigned long long)tacc_[k_]);       \
    } while (0)
#else
#define TCW_CLK_START()
#define TCW_CLK(k)
#define TCW_CLK_END()
#endif

extern "C" int ds_cu_mla_tcw_clocks(double cycles[10]) {
#ifdef DS_MLA_TCW_CLOCKS
    return take_clocks(g_mla_tcw_clk, cycles);
#else
    (void)cycles;
    return -1;
#endif
}

/* named barriers (0 is __syncthreads'): the S warps; the O warps; FULL[2]; LAND[2] */
enum { TCW_S = 1, TCW_O = 2, TCW_FULL = 3, TCW_LAND = 5 };
static __device__ __forceinline__ void bar_sync_n(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
static __device__ __forceinline__ void bar_arrive_n(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* long: the two groups' loops share the block's buffers. OCV: FP8 rows' scores from the staged
 * codes, each O warp converting its own columns. */
template <int MT, int KV, bool OCV = false>
__global__ void __launch_bounds__(512, 1)
    mla_tcw_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr,
              const void *pool, const int32_t *tables, const int32_t *tok_bt,
              const int32_t *tok_pos, int bs, float scale, int n_split) {
    typedef tcw_shape<MT, KV, OCV> L;
    constexpr int HA = L::HA, CLD = L::CLD, PLD = L::PLD, SLD = L::SLD, BK = L::BK;
    constexpr int NST = L::NST, RB = L::RB, NTR = L::NTR, NTW = L::NTW, DLD = L::DLD;
    extern __shared__ __align__(16) uint8_t tsh[];
    uint8_t *ring = tsh;                                      /* [NST][BK][DLD] */
    uint16_t *Cc = (uint16_t *)(ring + (size_t)NST * L::SB);  /* [2][BK][CLD] (FP8) */
    float *Ss = (float *)(Cc + (L::CONV ? 2 * BK * CLD : 0)); /* [2][BK][4] (FP8; RAW [4][BK]) */
    float *Sp = Ss + L::NSS;                                  /* [CG][HA][SLD] */
    uint16_t *Ps = (uint16_t *)(Sp + L::CG * HA * SLD);       /* [2][NPG][HA][PLD] */
    float *m_sh = (float *)(Ps + 2 * L::NPG * HA * PLD), *l_sh = m_sh + HA,
          *a_sh = l_sh + HA; /* a [2][HA] */
    const int t = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
    const int lane = tid & 31;
    PDL_ENTRY();
    const int32_t *table = tables + tok_bt[t];
    int j0, j1, ntile;
    tcd_split<BK>(tok_pos, t, s, n_split, &j0, &j1, &ntile);
    /* tile it's rows into ring slot it % NST by the O warps (a warp a row), one commit group
     * whether or not there is such a tile */
    auto stage = [&](int it) {
        if (it < ntile) {
            const int a = j0 + it * BK;
            uint8_t *dst = ring + (size_t)(it % NST) * L::SB;
            tcd_stage_rows<BK, RB, DLD, 8>(dst, pool, table, bs, a, j1, warp - 8, lane);
        }
        cp_async_commit();
    };
    const bool sg = warp < 8;
    if (!sg)
        for (int i = 0; i < NST; i++) stage(i); /* the ring's first tiles */
    if (tid < HA) m_sh[tid] = -INFINITY, l_sh[tid] = 0.0f;
    __syncthreads(); /* (the last barrier of the whole block) */
    if (!sg) {       /* tiles 0 and 1 landed (the groups of 2 and 3 may still be on their way) */
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
        for (int i = 0; i < 2 && i < ntile; i++) bar_arrive_n(TCW_LAND + i, 512);
        if constexpr (L::RAW) { /* tile 0's columns of this warp into C[0], once every O
                                 * thread's copies of it landed */
            bar_sync_n(TCW_O, 256);
            if (ntile > 0) tcd_convert_f8_cols<BK, DLD, CLD>(Cc, ring, warp - 8, lane);
        }
    }
    if (sg) {
        const int cg = warp % L::CG, rh = warp / L::CG;
        /* the S warps hold no outputs: the query's A fragments stay in their registers */
        uint32_t qf[MT][L::KSW][4];
        tcd_query_regs<MT, KV, L::KSW, L::RAW>(qf, qbar, qr, ldqr, t, cg, lane);
        TCW_CLK_START();
        for (int it = 0; it < ntile; it++) {
            const int b = it & 1;
            /* tile it's rows landed, tile it - 2's outputs are done (P[b] and C[b] free), and
             * every S warp is past the last softmax (Sp free) */
            bar_sync_n(TCW_LAND + b, 512);
            TCW_CLK(0);
            const uint8_t *rs = ring + (size_t)(it % NST) * L::SB;
            /* FP8 rows into C[b] and their scales into Ss[b] by each S warp its own part (no
             * barrier), or (RAW) the scores from the staged codes and scales */
            const uint16_t *C = L::CONV ? Cc + (size_t)b * BK * CLD : (const uint16_t *)rs;
            float *Sb = L::RAW ? Ss : Ss + b * BK * 4;
            if constexpr (L::RAW) {
                tcd_scores_raw<MT, NTR, BK, DLD, SLD>(Sp, Sb, rs, qf, cg, rh, lane);
            } else {
                if constexpr (L::CONV)
                    tcd_convert_f8<BK / L::RH, RB, CLD>(Cc + (size_t)b * BK * CLD, Sb, rs, cg, rh,
                                                        lane);
                TCW_CLK(1);
                tcd_scores<MT, KV, L::KSW, NTR, CLD, SLD, true>(Sp, C, nullptr, qf, Sb, cg, rh,
                                                                lane);
            }
            TCW_CLK(2);
            bar_sync_n(TCW_S, L::NS);
            TCW_CLK(3);
            /* the online softmax: P and alpha into buffer b */
            tcd_softmax<KV, HA, L::NS, BK, L::CG, SLD, PLD, L::RAW ? 0 : 4>(
                Sp, Ps + (size_t)b * L::NPG * HA * PLD, Sb, m_sh, l_sh, a_sh + b * HA, tid,
                j0 + it * BK, j1, scale);
            bar_arrive_n(TCW_FULL + b, 512); /* (a release: P and alpha) */
            TCW_CLK(4);
        }
        TCW_CLK_END();
        bar_sync_n(TCW_S, L::NS); /* the last softmax's m and l */
        if (tid < HA) {
            float *pml = part_ml + (((size_t)t * HA + tid) * n_split + s) * 2;
            pml[0] = m_sh[tid], pml[1] = l_sh[tid];
        }
        return;
    }
    const int wo = warp - 8; /* output columns [64 wo, 64 wo + 64) of every head */
    float oacc[MT][NTW][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < NTW; i++)
            oacc[mt][i][0] = oacc[mt][i][1] = oacc[mt][i][2] = oacc[mt][i][3] = 0.0f;
    TCW_CLK_START();
    for (int it = 0; it < ntile; it++) {
        const int b = it & 1;
        bar_sync_n(TCW_FULL + b, 512);
        TCW_CLK(5);
        const uint16_t *C = L::CONV ? Cc + (size_t)b * BK * CLD
                                    : (const uint16_t *)(ring + (size_t)(it % NST) * L::SB);
        /* (FP8 rows: warp wo's 64 columns lie in scale tile wo / 2, P's copy wo / 2) */
        const uint16_t *P = Ps + ((size_t)b * L::NPG + (L::CONV ? wo >> 1 : 0)) * HA * PLD;
        tcd_outputs<MT, NTW, BK, CLD, PLD>(oacc, P, C, a_sh + b * HA, wo, lane);
        TCW_CLK(6);
        /* ring slot it % NST takes tile it + 4 once every O warp is done with it (the S warps
         * were before FULL); tile it + 2's rows landed, buffers P[b] and C[b] free: LAND[b] */
        bar_sync_n(TCW_O, 256);
        TCW_CLK(7);
        stage(it + NST);
        asm volatile("cp.async.wait_group 2;\n" ::: "memory");
        if (it + 2 < ntile) bar_arrive_n(TCW_LAND + b, 512);
        TCW_CLK(8);
        /* RAW: tile it + 1's columns of this warp into C[b ^ 1] (its copies landed before this
         * iteration's TCW_O barrier; the warp's reads of C[b ^ 1], tile it - 1's, are done) */
        if constexpr (L::RAW)
            if (it + 1 < ntile)
                tcd_convert_f8_cols<BK, DLD, CLD>(Cc + (size_t)(b ^ 1) * BK * CLD,
                                                  ring + (size_t)((it + 1) % NST) * L::SB, wo,
                                                  lane);
        TCW_CLK(9);
    }
    TCW_CLK_END();
    cp_async_wait_all(); /* (the groups past the last tile are empty) */
    tcd_store<MT, NTW>(part_o, oacc, t, s, n_split, wo, lane, L::CONV ? TCD_F8_O : 1.0f);
}

extern "C" void ds_cu_set_mla_decode_tc(ds_cu *c, int min_rows) {
    c->mla_decode_tc = min_rows;
}

typedef void (*tcd_fn)(float *, float *, const float *, const float *, int, const void *,
                       const int32_t *, const int32_t *, const int32_t *, int, float, int);

/* the kernel and its shared memory for Ha heads (16 or 32), rows of dtype KV, BK-row tiles, NW
 * warps */
template <int KV, int BK, int NW = 8> static void tcd_pick(int mt, tcd_fn *k, size_t *smem) {
    *k = mt == 2 ? mla_tcd_k<2, KV, BK, NW> : mla_tcd_k<1, KV, BK, NW>;
    *smem = mt == 2 ? tcd_shape<2, KV, BK, NW>::SMEM : tcd_shape<1, KV, BK, NW>::SMEM;
}

/* the same for the warp-specialized form (OCV: FP8 scores from the staged codes) */
template <int KV, bool OCV = false> static void tcw_pick(int mt, tcd_fn *k, size_t *smem) {
    *k = mt == 2 ? mla_tcw_k<2, KV, OCV> : mla_tcw_k<1, KV, OCV>;
    *smem = mt == 2 ? tcw_shape<2, KV, OCV>::SMEM : tcw_shape<1, KV, OCV>::SMEM;
}

extern "C" void ds_cu_set_mla_decode_tc_tile(ds_cu *c, int rows) {
    c->mla_decode_tc_tile = rows;
}

extern "C" void ds_cu_set_mla_decode_tc_warps(ds_cu *c, int warps) {
    c->mla_decode_tc_warps = warps;
}

extern "C" void ds_cu_set_mla_decode_ws(ds_cu *c, int min_rows) {
    c->mla_decode_ws = min_rows;
}

extern "C" void ds_cu_set_mla_ws_oconv(ds_cu *c, int on) {
    c->mla_ws_oconv = on;
}

int mla_decode_tc(ds_cu *c, float *obar, const float *qbar, const float *qr, int ldqr, int T,
                  int Ha, int R, int dr, const void *pool, int kv_dtype, const int32_t *tables,
                  const int32_t *tok_bt, const int32_t *tok_pos, int max_ctx, int block_size,
                  size_t row_bytes, float scale, int *done, ds_err *err) {
    *done = 0;
    if (!c->mla_decode_tc || c->batch_invariant || max_ctx < c->mla_decode_tc || R != TCD_R ||
        dr != TCD_DR || (Ha != 16 && Ha != 32) || ldqr % 2 ||
        ((uintptr_t)qbar | (uintptr_t)qr) % 8 || (uintptr_t)pool % 16)
        return DS_OK;
    const int rb = kv_dtype == DS_KV_FP8    ? tcd_row_bytes<DS_KV_FP8>()
                   : kv_dtype == DS_KV_BF16 ? tcd_row_bytes<DS_KV_BF16>()
                                            : tcd_row_bytes<DS_KV_F32>();
    if ((int)row_bytes != rb) return DS_OK; /* a pool laid out otherwise: the f32 kernels */
    /* the tile: 64 rows for quantized rows when asked (ds_cu_set_mla_decode_tc_tile), else 32 */
    const int bk = c->mla_decode_tc_tile == 64 && kv_dtype != DS_KV_F32 ? 64 : 32;
    /* a wave of blocks (one an SM) over the tokens, at least a tile a split */
    const int n_split = DS_MAX(1, DS_MIN((c->n_sm + T - 1) / T, max_ctx / bk));
    const int rows = T * Ha;
    const size_t need = (size_t)rows * n_split * ((size_t)R + 2);
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                     err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
    const int mt = Ha / 16;
    /* 16 warps a block: BF16 rows in 64-row tiles only (the other forms' shared memory has no
     * room for the query beside their conversion buffer) */
    const int nw = c->mla_decode_tc_warps == 16 && kv_dtype == DS_KV_BF16 && bk == 64 ? 16 : 8;
    tcd_fn kernel;
    size_t smem;
    /* the warp-specialized form from its context cap, FP8 and BF16 rows (at 1M rows on an H100
     * faster than the 64-row and 16-warp forms since its S warps hold the query in registers:
     * bench/RESULTS.md session 42) */
    const int ws = c->mla_decode_ws > 0 && max_ctx >= c->mla_decode_ws &&
                   (kv_dtype == DS_KV_FP8 || kv_dtype == DS_KV_BF16);
    if (ws) { /* the warp-specialized form: 16 warps, 32-row tiles */
        const int f8 = kv_dtype == DS_KV_FP8, ocv = f8 && c->mla_ws_oconv;
        if (ocv)
            tcw_pick<DS_KV_FP8, true>(mt, &kernel, &smem);
        else if (f8)
            tcw_pick<DS_KV_FP8>(mt, &kernel, &smem);
        else
            tcw_pick<DS_KV_BF16>(mt, &kernel, &smem);
        size_t *wset = &c->mla_tcw_smem[(mt - 1) + 2 * f8 + 2 * ocv];
        if (smem > *wset) {
            CU_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem),
                   "mla (tensor cores, warp-specialized): shared memory");
            *wset = smem;
        }
    } else if (nw == 16)
        tcd_pick<DS_KV_BF16, 64, 16>(mt, &kernel, &smem);
    else if (kv_dtype == DS_KV_FP8 && bk == 64)
        tcd_pick<DS_KV_FP8, 64>(mt, &kernel, &smem);
    else if (kv_dtype == DS_KV_FP8)
        tcd_pick<DS_KV_FP8, 32>(mt, &kernel, &smem);
    else if (kv_dtype == DS_KV_BF16 && bk == 64)
        tcd_pick<DS_KV_BF16, 64>(mt, &kernel, &smem);
    else if (kv_dtype == DS_KV_BF16)
        tcd_pick<DS_KV_BF16, 32>(mt, &kernel, &smem);
    else
        tcd_pick<DS_KV_F32, 32>(mt, &kernel, &smem);
    /* raised once per kernel, before any capture can be open */
    size_t *set = &c->mla_tcd_smem[(mt - 1) + 2 * kv_dtype + 6 * (bk == 64) + 12 * (nw == 16)];
    if (!ws && smem > *set) {
        CU_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
               "mla (tensor cores): shared memory");
        *set = smem;
    }
    launch_k(c, kernel, dim3((unsigned)T, (unsigned)n_split), ws ? 512 : 32 * nw, smem, part_o,
             part_ml, qbar, qr, ldqr, pool, tables, tok_bt, tok_pos, block_size, scale, n_split);
    CU_TRY(cudaGetLastError(), "mla (tensor cores)");
    mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
    CU_TRY(cudaGetLastError(), "mla merge");
    *done = 1;
    return DS_OK;
}
