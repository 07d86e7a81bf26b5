/* kda_chunked.cuh — what the passes of chunked KDA (prefill) share: the chunk, the layout of
 * pass 1's output, and passes 2 and 3 as kda_chunked.cu launches them (kda_chunk_scan.cu). */
#ifndef DS_CUDA_KDA_CHUNKED_CUH
#define DS_CUDA_KDA_CHUNKED_CUH

#include "kernels/cuda/common.cuh"

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
 * the state's 32 columns kept in registers; the outputs O = Qp S0 + P U (pass 3) are made beside
 * that walk by a second set of warps in its block (tensor-core modes, the default), or by a block
 * per chunk and head after it. */
enum { KC = 64 };
/* pass 1's output per (chunk, head): W, Ut, Qp, Kc [KC][KD], P [KC][KC], gL [KD]. In the BF16
 * mode (2) the products' A operands are handed over as BF16 instead, each in the first half of
 * its region (the offsets stay): W16 and Qp16 [KC][KD], Kc16 transposed [KD][KC], P16 [KC][KC],
 * every row's entries in kda_b16_slot order; Ut and gL stay f32 (Ut is subtracted from, not
 * multiplied). The scan would round them to BF16 as it loaded them, with the same rounding, so
 * the outputs are the same bits for half the bytes. */
__host__ __device__ constexpr size_t kda_ch_floats(int KD) {
    return (size_t)4 * KC * KD + (size_t)KC * KC + KD;
}

/* Where entry k of a BF16 operand row sits: within each 8, k = l4 and l4 + 4 side by side at
 * 2 l4, 2 l4 + 1 — the pair that lane l4 of a BF16 m16n8k8 fragment holds (tf32.cuh, PREC 2), so
 * the fragment is one 32-bit load. */
__host__ __device__ constexpr int kda_b16_slot(int k) {
    return (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1);
}

struct kda_chunk {
    int t0, len, seg; /* its tokens [t0, t0 + len) of segment seg */
};

/* Passes 2 and 3 (kda_chunk_scan.cu), KD = 64 or 128: their shared-memory limits (once per
 * head size, outside any capture), then their launches in the context's mode (ds_cu_set_kda_tc,
 * ds_cu_set_kda_out_fused) over pass 1's output prep [n_ch][H][kda_ch_floats(KD)]; states
 * [n_ch][H][KD][KD] and ug [n_ch][H][KC][KD] are scratch for the chunks' starting states and U
 * when the outputs take a pass of their own; o [tokens][H][KD]; S [n_seq] the sequences' states. */
template <int KD> cudaError_t kda_scan_attrs();
template <int KD>
void kda_scan_launch(ds_cu *c, float *o, float *states, float *ug, const float *prep,
                     const kda_chunk *tab, const int *first, float *const *S, int n_ch, int n_seq,
                     int H);

#endif
