/* test_cuda_kda.c — KDA against the CPU: the recurrence (one sequence, a step's batch, chunked
 * with its tensor-core modes), the short convs, the gates, the fused decode; the KDA timings and
 * --kda-io (the chunked kernel on a peer's inputs). */
#include "cuda_check.h"

/* q, k as the model gives them: L2-normalised per head (q also scaled by dk^-1/2). */
static void norm_heads(float *x, int T, int H, int d, float scale) {
    for (int i = 0; i < T * H; i++) {
        double s = 0;
        for (int j = 0; j < d; j++) s += (double)x[i * d + j] * x[i * d + j];
        float inv = (float)(scale / sqrt(s + 1e-6));
        for (int j = 0; j < d; j++) x[i * d + j] *= inv;
    }
}

static void check_kda(ds_cu *c, int T, int H, int dk, int dv, int rows) {
    size_t nq = (size_t)T * H * dk, nv = (size_t)T * H * dv, ns = (size_t)H * dk * dv;
    float *q = rand_f32(nq, -1, 1), *k = rand_f32(nq, -1, 1), *v = rand_f32(nv, -1, 1);
    float *g = rand_f32(nq, -0.7f, 0), *beta = rand_f32((size_t)T * H, 0, 1);
    float *S0 = rand_f32(ns, -0.5f, 0.5f);
    norm_heads(q, T, H, dk, 1.0f / sqrtf((float)dk));
    norm_heads(k, T, H, dk, 1.0f);
    float *Sref = malloc(ns * 4), *Sgot = malloc(ns * 4);
    memcpy(Sref, S0, ns * 4);
    float *oref = malloc(nv * 4), *ogot = malloc(nv * 4);
    float *Rref = rows ? malloc((size_t)T * ns * 4) : NULL;
    float *Rgot = rows ? malloc((size_t)T * ns * 4) : NULL;
    ds_kda_recurrent(oref, q, k, v, g, beta, Sref, Rref, T, H, dk, dv);
    float *dq = dev(c, q, nq * 4), *dk_ = dev(c, k, nq * 4), *dv_ = dev(c, v, nv * 4);
    float *dg = dev(c, g, nq * 4), *db = dev(c, beta, (size_t)T * H * 4), *dS = dev(c, S0, ns * 4);
    float *dout = dev(c, NULL, nv * 4), *dR = rows ? dev(c, NULL, (size_t)T * ns * 4) : NULL;
    poison(c, dout, nv * 4);
    if (rows) poison(c, dR, (size_t)T * ns * 4);
    ds_err err = {{0}};
    if (ds_cu_kda_recurrent(c, dout, dq, dk_, dv_, dg, db, dS, dR, T, H, dk, dv, &err))
        DIE("%s", err.msg);
    fetch(c, ogot, dout, nv * 4);
    fetch(c, Sgot, dS, ns * 4);
    char what[96];
    snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: out", T, H, dk, dv);
    report(what, rel_err(ogot, oref, 1, nv, nv), 1e-5);
    snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: state", T, H, dk, dv);
    report(what, rel_err(Sgot, Sref, 1, ns, ns), 1e-5);
    if (rows) {
        fetch(c, Rgot, dR, (size_t)T * ns * 4);
        snprintf(what, sizeof what, "kda_recurrent T=%d H=%d dk=%d dv=%d: rows", T, H, dk, dv);
        report(what, rel_err(Rgot, Rref, 1, (size_t)T * ns, (size_t)T * ns), 1e-5);
        ds_cu_dealloc(dR);
    }
    ds_cu_dealloc(dq), ds_cu_dealloc(dk_), ds_cu_dealloc(dv_), ds_cu_dealloc(dg);
    ds_cu_dealloc(db), ds_cu_dealloc(dS), ds_cu_dealloc(dout);
    free(q), free(k), free(v), free(g), free(beta), free(S0), free(Sref), free(Sgot);
    free(oref), free(ogot), free(Rref), free(Rgot);
}

/* A step's KDA as the forward runs it: sequences of different lengths, each on its own state,
 * the recurrent kernel for all of them in one launch (with state rows where rows[z]) or, with
 * chunked_min > 0, the chunked form for those of at least that many tokens without rows:
 * outputs, final states and rows against the CPU's recurrence of each sequence alone. Decays as
 * strong as g_min per token (at -3, a chunk's running decay reaches e^-192: any exponent taken
 * the wrong way round overflows). */
static int g_kda_tc;          /* ds_cu_set_kda_tc's mode as set by the caller (1 TF32, 3 3xTF32) */
static int g_kda_prep_tc = 1; /* ds_cu_set_kda_prep_tc's as set by the caller */
static void check_kda_step(ds_cu *c, const int *lens, const int *rows, int n_seq, int H, int dk,
                           int dv, float g_min, int chunked_min) {
    int off[17], cs[16], cl[16], nc = 0;
    off[0] = 0;
    for (int z = 0; z < n_seq; z++) off[z + 1] = off[z] + lens[z];
    int T = off[n_seq];
    size_t nq = (size_t)T * H * dk, nv = (size_t)T * H * dv, ns = (size_t)H * dk * dv;
    float *q = rand_f32(nq, -1, 1), *k = rand_f32(nq, -1, 1), *v = rand_f32(nv, -1, 1);
    float *g = rand_f32(nq, g_min, 0), *beta = rand_f32((size_t)T * H, 0, 1);
    float *S0 = rand_f32(ns * n_seq, -0.5f, 0.5f);
    norm_heads(q, T, H, dk, 1.0f / sqrtf((float)dk));
    norm_heads(k, T, H, dk, 1.0f);
    float *Sref = malloc(ns * n_seq * 4), *Sgot = malloc(ns * n_seq * 4);
    float *oref = malloc(nv * 4), *ogot = malloc(nv * 4);
    float *Rref = malloc((size_t)T * ns * 4), *Rgot = malloc((size_t)T * ns * 4);
    memcpy(Sref, S0, ns * n_seq * 4);
    for (int z = 0; z < n_seq; z++) {
        size_t t0 = (size_t)off[z];
        ds_kda_recurrent(oref + t0 * H * dv, q + t0 * H * dk, k + t0 * H * dk, v + t0 * H * dv,
                         g + t0 * H * dk, beta + t0 * H, Sref + z * ns, Rref + t0 * ns, lens[z], H,
                         dk, dv);
    }
    float *dq = dev(c, q, nq * 4), *dk_ = dev(c, k, nq * 4), *dv_ = dev(c, v, nv * 4);
    float *dg = dev(c, g, nq * 4), *db = dev(c, beta, (size_t)T * H * 4);
    float *dS = dev(c, S0, ns * n_seq * 4), *dR = dev(c, NULL, (size_t)T * ns * 4);
    float *dout = dev(c, NULL, nv * 4);
    float *sp[16], *rp[16], *csp[16];
    for (int z = 0; z < n_seq; z++) {
        sp[z] = dS + z * ns, rp[z] = rows[z] ? dR + (size_t)off[z] * ns : NULL;
        if (chunked_min > 0 && !rows[z] && lens[z] >= chunked_min)
            cs[nc] = off[z], cl[nc] = lens[z], csp[nc++] = sp[z];
    }
    int32_t *doff = dev(c, off, (size_t)(n_seq + 1) * 4);
    float **dsp = dev(c, sp, (size_t)n_seq * sizeof *sp), **drp = dev(c, rp, n_seq * sizeof *rp);
    float **dcsp = dev(c, csp, (size_t)(nc ? nc : 1) * sizeof *csp);
    poison(c, dout, nv * 4);
    poison(c, dR, (size_t)T * ns * 4);
    ds_err err = {{0}};
    if (ds_cu_kda_recurrent_batch(c, dout, dq, dk_, dv_, dg, db, doff, dsp, drp, 0, n_seq, H, dk,
                                  dv, chunked_min, &err) ||
        (nc && ds_cu_kda_chunked(c, dout, dq, dk_, dv_, dg, db, cs, cl, dcsp, nc, H, dk, dv, &err)))
        DIE("%s", err.msg);
    fetch(c, ogot, dout, nv * 4);
    fetch(c, Sgot, dS, ns * n_seq * 4);
    fetch(c, Rgot, dR, (size_t)T * ns * 4);
    char what[96];
    /* the chunked form sums in another order; its TF32 and BF16 passes round the operands */
    const double tol = !nc ? 1e-5 : g_kda_tc == 1 ? 1e-2 : g_kda_tc == 2 ? 3e-2 : 1e-4;
    snprintf(what, sizeof what, "kda %d seqs (T=%d, %d chunked%s%s) dk=%d dv=%d g>=%.1f: out",
             n_seq, T, nc,
             g_kda_tc == 1   ? ", tf32"
             : g_kda_tc == 2 ? ", bf16"
             : g_kda_tc == 3 ? ", 3xtf32"
             : g_kda_tc == 4 ? ", 3xbf16"
                             : "",
             g_kda_tc && !g_kda_prep_tc ? ", pass 1 f32" : "", dk, dv, g_min);
    report(what, rel_err(ogot, oref, 1, nv, nv), tol);
    snprintf(what, sizeof what, "kda %d seqs (%d chunked) dk=%d dv=%d: states", n_seq, nc, dk, dv);
    report(what, rel_err(Sgot, Sref, 1, ns * n_seq, ns * n_seq), tol);
    snprintf(what, sizeof what, "kda %d seqs", n_seq);
    report_seq_rows(what, Rgot, Rref, off, lens, rows, n_seq, ns, 1e-5);
    if (nc && g_kda_tc) { /* the outputs in a pass of their own: the same bits as the scan's */
        float *o2 = malloc(nv * 4), *S2 = malloc(ns * n_seq * 4);
        if (ds_cu_upload(c, dS, S0, ns * n_seq * 4, &err)) DIE("%s", err.msg);
        poison(c, dout, nv * 4);
        ds_cu_set_kda_out_fused(c, 0);
        if (ds_cu_kda_recurrent_batch(c, dout, dq, dk_, dv_, dg, db, doff, dsp, drp, 0, n_seq, H,
                                      dk, dv, chunked_min, &err) ||
            ds_cu_kda_chunked(c, dout, dq, dk_, dv_, dg, db, cs, cl, dcsp, nc, H, dk, dv, &err))
            DIE("%s", err.msg);
        ds_cu_set_kda_out_fused(c, 1);
        fetch(c, o2, dout, nv * 4);
        fetch(c, S2, dS, ns * n_seq * 4);
        snprintf(what, sizeof what, "kda %d seqs (T=%d) mode %d, outputs apart: words differing",
                 n_seq, T, g_kda_tc);
        report(what, (double)words_differ(o2, ogot, nv), 0);
        snprintf(what, sizeof what, "kda %d seqs mode %d, outputs apart: states' words differing",
                 n_seq, g_kda_tc);
        report(what, (double)words_differ(S2, Sgot, ns * n_seq), 0);
        free(o2), free(S2);
    }
    ds_cu_dealloc(dq), ds_cu_dealloc(dk_), ds_cu_dealloc(dv_), ds_cu_dealloc(dg);
    ds_cu_dealloc(db), ds_cu_dealloc(dS), ds_cu_dealloc(dR), ds_cu_dealloc(dout);
    ds_cu_dealloc(doff), ds_cu_dealloc(dsp), ds_cu_dealloc(drp), ds_cu_dealloc(dcsp);
    free(q), free(k), free(v), free(g), free(beta), free(S0), free(Sref), free(Sgot);
    free(oref), free(ogot), free(Rref), free(Rgot);
}

/* Chunked KDA on raw inputs (ds_cu_kda_chunked_raw: the gate, beta and head norms inside its
 * first pass) against the launches it replaces — ds_cu_kda_gate, ds_cu_l2norm_heads2, then
 * ds_cu_kda_chunked — word for word, outputs and states, in the context's mode: lens [n_seq]
 * (all chunked), f_b's outputs f and beta's logits (strided, as the model's projection leaves
 * them) drawn wide enough that the gate's decays range from nothing to emptying the state. */
static void check_kda_raw(ds_cu *c, const int *lens, int n_seq, int H, int D, int lb_form) {
    int cs[16], T = 0;
    for (int z = 0; z < n_seq; z++) cs[z] = T, T += lens[z];
    const int ld = H + 5; /* b_in [T][ld], the logits at columns [2, 2 + H) */
    const size_t n = (size_t)T * H * D, ns = (size_t)H * D * D;
    float *q = rand_f32(n, -2, 2), *k = rand_f32(n, -2, 2), *v = rand_f32(n, -1, 1);
    float *f = rand_f32(n, -6, 3), *A = rand_f32((size_t)H, -2, 0.5f);
    float *bias = rand_f32((size_t)H * D, -1, 1), *bi = rand_f32((size_t)T * ld, -4, 4);
    float *S0 = rand_f32(ns * n_seq, -0.5f, 0.5f);
    float *dq = dev(c, q, n * 4), *dk = dev(c, k, n * 4), *dv = dev(c, v, n * 4);
    float *df = dev(c, f, n * 4), *dA = dev(c, A, (size_t)H * 4);
    float *dbias = dev(c, bias, (size_t)H * D * 4), *dbi = dev(c, bi, (size_t)T * ld * 4);
    float *dg = dev(c, NULL, n * 4), *dbeta = dev(c, NULL, (size_t)T * H * 4);
    float *dqn = dev(c, q, n * 4), *dkn = dev(c, k, n * 4); /* normalized by the launches */
    float *dS = dev(c, S0, ns * n_seq * 4), *dS2 = dev(c, S0, ns * n_seq * 4);
    float *dout = dev(c, NULL, n * 4), *dout2 = dev(c, NULL, n * 4);
    float *sp[16], *sp2[16];
    for (int z = 0; z < n_seq; z++) sp[z] = dS + z * ns, sp2[z] = dS2 + z * ns;
    float **dsp = dev(c, sp, n_seq * sizeof *sp), **dsp2 = dev(c, sp2, n_seq * sizeof *sp2);
    const float q_scale = 1.0f / sqrtf((float)D), lb = -5.0f, eps = 1e-6f;
    poison(c, dout, n * 4);
    poison(c, dout2, n * 4);
    ds_err err = {{0}};
    ds_cu_kda_gate(c, dg, df, T, H, D, dA, dbias, lb_form, lb, dbeta, dbi + 2, ld);
    ds_cu_l2norm_heads2(c, dqn, q_scale, dkn, 1.0f, T, H, D, eps);
    if (ds_cu_kda_chunked(c, dout, dqn, dkn, dv, dg, dbeta, cs, lens, dsp, n_seq, H, D, D, &err))
        DIE("%s", err.msg);
    const ds_cu_kda_raw raw = {dA, dbias, lb_form, lb, dbi + 2, ld, q_scale, eps};
    if (ds_cu_kda_chunked_raw(c, dout2, dq, dk, dv, df, &raw, cs, lens, dsp2, n_seq, H, D, D, &err))
        DIE("%s", err.msg);
    float *o1 = malloc(n * 4), *o2 = malloc(n * 4);
    float *s1 = malloc(ns * n_seq * 4), *s2 = malloc(ns * n_seq * 4);
    fetch(c, o1, dout, n * 4);
    fetch(c, o2, dout2, n * 4);
    fetch(c, s1, dS, ns * n_seq * 4);
    fetch(c, s2, dS2, ns * n_seq * 4);
    char what[112];
    snprintf(what, sizeof what,
             "kda raw inputs, %d seqs (T=%d) H=%d D=%d mode %d%s%s: words differing", n_seq, T, H,
             D, g_kda_tc, lb_form ? ", lower bound" : "", g_kda_prep_tc ? "" : ", pass 1 f32");
    report(what, (double)words_differ(o2, o1, n), 0);
    snprintf(what, sizeof what, "kda raw inputs, %d seqs mode %d: states' words differing", n_seq,
             g_kda_tc);
    report(what, (double)words_differ(s2, s1, ns * n_seq), 0);
    /* and against the CPU's gate, norms and recurrence (the chunked form's own tolerance) */
    float *g = malloc(n * 4), *beta = malloc((size_t)T * H * 4), *oref = malloc(n * 4);
    ds_kda_gate(g, f, T, H, D, A, bias, lb_form, lb);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) beta[t * H + h] = 1.0f / (1.0f + expf(-bi[t * ld + 2 + h]));
    norm_heads(q, T, H, D, q_scale);
    norm_heads(k, T, H, D, 1.0f);
    for (int z = 0; z < n_seq; z++) {
        const size_t t0 = (size_t)cs[z];
        ds_kda_recurrent(oref + t0 * H * D, q + t0 * H * D, k + t0 * H * D, v + t0 * H * D,
                         g + t0 * H * D, beta + t0 * H, S0 + z * ns, NULL, lens[z], H, D, D);
    }
    const double tol = g_kda_tc == 1 ? 1e-2 : g_kda_tc == 2 ? 3e-2 : 1e-4;
    snprintf(what, sizeof what, "kda raw inputs, %d seqs mode %d: out vs cpu", n_seq, g_kda_tc);
    report(what, rel_err(o2, oref, 1, n, n), tol);
    snprintf(what, sizeof what, "kda raw inputs, %d seqs mode %d: states vs cpu", n_seq, g_kda_tc);
    report(what, rel_err(s2, S0, 1, ns * n_seq, ns * n_seq), tol);
    ds_cu_dealloc(dq), ds_cu_dealloc(dk), ds_cu_dealloc(dv), ds_cu_dealloc(df), ds_cu_dealloc(dA);
    ds_cu_dealloc(dbias), ds_cu_dealloc(dbi), ds_cu_dealloc(dg), ds_cu_dealloc(dbeta);
    ds_cu_dealloc(dqn), ds_cu_dealloc(dkn), ds_cu_dealloc(dS), ds_cu_dealloc(dS2);
    ds_cu_dealloc(dout), ds_cu_dealloc(dout2), ds_cu_dealloc(dsp), ds_cu_dealloc(dsp2);
    free(q), free(k), free(v), free(f), free(A), free(bias), free(bi), free(S0);
    free(o1), free(o2), free(s1), free(s2), free(g), free(beta), free(oref);
}

static void check_short_conv(ds_cu *c, int T, int C, int W) {
    float *in = rand_f32((size_t)T * C, -2, 2), *w = rand_f32((size_t)C * W, -1, 1);
    float *tail = rand_f32((size_t)(W - 1) * C, -2, 2), *tail_ref = malloc((size_t)(W - 1) * C * 4);
    memcpy(tail_ref, tail, (size_t)(W - 1) * C * 4);
    float *ref = malloc((size_t)T * C * 4), *got = malloc((size_t)T * C * 4);
    float *tail_got = malloc((size_t)(W - 1) * C * 4);
    ds_short_conv_silu(ref, in, T, C, w, W, tail_ref);
    float *din = dev(c, in, (size_t)T * C * 4), *dw = dev(c, w, (size_t)C * W * 4);
    float *dtail = dev(c, tail, (size_t)(W - 1) * C * 4), *dout = dev(c, NULL, (size_t)T * C * 4);
    poison(c, dout, (size_t)T * C * 4);
    ds_err err = {{0}};
    if (ds_cu_short_conv_silu(c, dout, din, T, C, dw, W, dtail, &err)) DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * C * 4);
    fetch(c, tail_got, dtail, (size_t)(W - 1) * C * 4);
    char what[96];
    snprintf(what, sizeof what, "short conv T=%d C=%d W=%d: out", T, C, W);
    report(what, rel_err(got, ref, 1, (size_t)T * C, (size_t)T * C), 1e-5);
    snprintf(what, sizeof what, "short conv T=%d C=%d W=%d: tail", T, C, W);
    report(what, rel_err(tail_got, tail_ref, 1, (size_t)(W - 1) * C, (size_t)(W - 1) * C), 0.0);
    ds_cu_dealloc(din), ds_cu_dealloc(dw), ds_cu_dealloc(dtail), ds_cu_dealloc(dout);
    free(in), free(w), free(tail), free(tail_ref), free(ref), free(got), free(tail_got);
}

static void check_kda_gate(ds_cu *c, int T, int H, int dk, int lb_form) {
    size_t n = (size_t)T * H * dk;
    float *f = rand_f32(n, -8, 8), *A = rand_f32((size_t)H, -2, 1),
          *b = rand_f32((size_t)H * dk, -1, 1);
    float *ref = malloc(n * 4), *got = malloc(n * 4);
    ds_kda_gate(ref, f, T, H, dk, A, b, lb_form, -5.0f);
    float *df = dev(c, f, n * 4), *dA = dev(c, A, (size_t)H * 4),
          *db = dev(c, b, (size_t)H * dk * 4);
    float *dg = dev(c, NULL, n * 4);
    /* beta from strided raw values in the same launch: bi [T][H + 3], columns [1, 1 + H) */
    const int ldb = H + 3;
    float *bi = rand_f32((size_t)T * ldb, -6, 6), *bref = malloc((size_t)T * H * 4),
          *bgot = malloc((size_t)T * H * 4);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) bref[t * H + h] = 1.0f / (1.0f + expf(-bi[t * ldb + 1 + h]));
    float *dbi = dev(c, bi, (size_t)T * ldb * 4), *dbeta = dev(c, NULL, (size_t)T * H * 4);
    poison(c, dg, n * 4);
    poison(c, dbeta, (size_t)T * H * 4);
    ds_cu_kda_gate(c, dg, df, T, H, dk, dA, db, lb_form, -5.0f, dbeta, dbi + 1, ldb);
    fetch(c, got, dg, n * 4);
    fetch(c, bgot, dbeta, (size_t)T * H * 4);
    char what[96];
    snprintf(what, sizeof what, "kda gate T=%d H=%d dk=%d (%s)", T, H, dk,
             lb_form ? "lower bound" : "softplus");
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    snprintf(what, sizeof what, "kda gate T=%d H=%d: beta", T, H);
    report(what, rel_err(bgot, bref, 1, (size_t)T * H, (size_t)T * H), 1e-6);
    ds_cu_dealloc(df), ds_cu_dealloc(dA), ds_cu_dealloc(db), ds_cu_dealloc(dg);
    ds_cu_dealloc(dbi), ds_cu_dealloc(dbeta);
    free(f), free(A), free(b), free(ref), free(got), free(bi), free(bref), free(bgot);
}

/* Every segment of a step in one launch, each on its own tail; the segments with rollback rows get
 * the tail after each token (the CPU reference runs token by token and copies its tail). */
static void check_short_conv_batch(ds_cu *c, const int *lens, const int *want_rows, int n_seq,
                                   int C, int W) {
    int T = 0, off[17];
    for (int z = 0; z < n_seq; z++) off[z] = T, T += lens[z];
    off[n_seq] = T;
    size_t tn = (size_t)(W - 1) * C;
    float *in = rand_f32((size_t)T * C, -2, 2), *w = rand_f32((size_t)C * W, -1, 1);
    float *tails = rand_f32((size_t)n_seq * tn, -2, 2), *tails_ref = malloc((size_t)n_seq * tn * 4);
    memcpy(tails_ref, tails, (size_t)n_seq * tn * 4);
    float *ref = malloc((size_t)T * C * 4), *got = malloc((size_t)T * C * 4);
    float *rows_ref = calloc((size_t)T * tn, 4), *rows_got = malloc((size_t)T * tn * 4);
    for (int z = 0; z < n_seq; z++)
        for (int t = off[z]; t < off[z + 1]; t++) {
            ds_short_conv_silu(ref + (size_t)t * C, in + (size_t)t * C, 1, C, w, W,
                               tails_ref + (size_t)z * tn);
            memcpy(rows_ref + (size_t)t * tn, tails_ref + (size_t)z * tn, tn * 4);
        }
    float *din = dev(c, in, (size_t)T * C * 4), *dw = dev(c, w, (size_t)C * W * 4);
    float *dtails = dev(c, tails, (size_t)n_seq * tn * 4), *dout = dev(c, NULL, (size_t)T * C * 4);
    float *drows = dev(c, NULL, (size_t)T * tn * 4);
    poison(c, dout, (size_t)T * C * 4);
    poison(c, drows, (size_t)T * tn * 4);
    float *tp[16], *rp[16];
    for (int z = 0; z < n_seq; z++) {
        tp[z] = dtails + (size_t)z * tn;
        rp[z] = want_rows[z] ? drows + (size_t)off[z] * tn : NULL;
    }
    float **dtp = dev(c, tp, sizeof(float *) * n_seq), **drp = dev(c, rp, sizeof(float *) * n_seq);
    int32_t *doff = dev(c, off, sizeof(int32_t) * (n_seq + 1));
    ds_err err = {{0}};
    ds_cu_conv_batch cb = {1, C, W, din, C, dout, 0, dw, dtp, drp, tn, doff, n_seq, T};
    if (ds_cu_short_conv_silu_batch(c, &cb, &err)) DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * C * 4);
    fetch(c, tails, dtails, (size_t)n_seq * tn * 4);
    fetch(c, rows_got, drows, (size_t)T * tn * 4);
    char what[96];
    snprintf(what, sizeof what, "short conv batch %d seqs C=%d: out", n_seq, C);
    report(what, rel_err(got, ref, 1, (size_t)T * C, (size_t)T * C), 1e-5);
    snprintf(what, sizeof what, "short conv batch %d seqs C=%d: tails", n_seq, C);
    report(what, rel_err(tails, tails_ref, 1, (size_t)n_seq * tn, (size_t)n_seq * tn), 1e-6);
    report_seq_rows("short conv batch", rows_got, rows_ref, off, lens, want_rows, n_seq, tn, 1e-6);
    ds_cu_dealloc(din), ds_cu_dealloc(dw), ds_cu_dealloc(dtails), ds_cu_dealloc(dout);
    ds_cu_dealloc(drows), ds_cu_dealloc(dtp), ds_cu_dealloc(drp), ds_cu_dealloc(doff);
    free(in), free(w), free(tails), free(tails_ref), free(ref), free(got), free(rows_ref);
    free(rows_got);
}

/* The fused KDA decode (ds_cu_kda_decode_fused) against the seven launches it stands in for —
 * convs, head norms, f_b's and g_b's matmuls (streamed, as at one token or in the
 * batch-invariant mode), gate and beta, recurrence, gated output norm — on the same inputs:
 * outputs, states and tails bit for bit (the seven are each checked against the CPU above).
 * f8: f_b and g_b ptpc FP8 (quantized from the BF16 ones), both forms reading the codes. */
static void check_kda_decode_fused(ds_cu *c, int n_seq, int H, int Kf, int Kg, int lb_form,
                                   int f8) {
    const int dk = 128, W = 4, P = H * dk, nf = Kf + Kg, ld = 3 * P + nf + H;
    const size_t npre = (size_t)n_seq * ld, ns = (size_t)H * dk * dk, tn = (size_t)(W - 1) * P;
    const size_t nt = (size_t)n_seq * 3 * tn, nS = ns * n_seq, no = (size_t)n_seq * P;
    if (n_seq > 64) DIE("check_kda_decode_fused: at most 64 sequences");
    float *pre = rand_f32(npre, -2, 2), *cw = rand_f32((size_t)3 * P * W, -1, 1);
    float *tails = rand_f32(nt, -2, 2), *S0 = rand_f32(nS, -0.5f, 0.5f);
    uint16_t *fb = rand_bf16((size_t)P * Kf, -0.3f, 0.3f);
    uint16_t *gb = rand_bf16((size_t)P * Kg, -0.3f, 0.3f);
    float *A = rand_f32((size_t)H, -1, 1), *bias = rand_f32((size_t)P, -1, 1);
    float *nw = rand_f32((size_t)dk, 0.5f, 1.5f);
    float *dpre = dev(c, pre, npre * 4), *dcw = dev(c, cw, (size_t)3 * P * W * 4);
    uint16_t *dfb = dev(c, fb, (size_t)P * Kf * 2), *dgb = dev(c, gb, (size_t)P * Kg * 2);
    float *dA = dev(c, A, (size_t)H * 4), *dbias = dev(c, bias, (size_t)P * 4);
    float *dnw = dev(c, nw, (size_t)dk * 4);
    float *dqkv = dev(c, NULL, 3 * no * 4), *df = dev(c, NULL, no * 4), *dg = dev(c, NULL, no * 4);
    float *dgt = dev(c, NULL, no * 4), *dbeta = dev(c, NULL, (size_t)n_seq * H * 4);
    /* [2]: the seven launches' run, the fused one's; each from the same tails and states */
    float *dt[2], *dS[2], *dy[2], *got_y[2], *got_S[2], *got_t[2];
    float **dtp[2], **dsp[2];
    int32_t off[65];
    for (int z = 0; z <= n_seq; z++) off[z] = z;
    int32_t *doff = dev(c, off, (size_t)(n_seq + 1) * 4);
    for (int r = 0; r < 2; r++) {
        dt[r] = dev(c, tails, nt * 4), dS[r] = dev(c, S0, nS * 4), dy[r] = dev(c, NULL, no * 4);
        poison(c, dy[r], no * 4);
        float *tp[64], *sp[64];
        for (int z = 0; z < n_seq; z++) tp[z] = dt[r] + (size_t)z * 3 * tn, sp[z] = dS[r] + z * ns;
        dtp[r] = dev(c, tp, (size_t)n_seq * sizeof *tp);
        dsp[r] = dev(c, sp, (size_t)n_seq * sizeof *sp);
        got_y[r] = malloc(no * 4), got_S[r] = malloc(nS * 4), got_t[r] = malloc(nt * 4);
    }
    ds_err err = {{0}};
    const float qs = 1.0f / sqrtf((float)dk), lb = -5.0f, neps = 1e-5f;
    ds_cu_set_batch_invariant(c, 1); /* matmuls streamed at every batch, as the fused kernel sums */
    ds_cu_conv_batch cb = {3, P, W, dpre, ld, dqkv, no, dcw, dtp[0], NULL, 0, doff, n_seq, n_seq};
    /* f8: codes [P][Kf] and [P][Kg] bytes, row scales [P] */
    uint8_t *qf = f8 ? ds_cu_alloc(c, (size_t)P * Kf, &err) : NULL;
    uint8_t *qg = f8 ? ds_cu_alloc(c, (size_t)P * Kg, &err) : NULL;
    float *sf = f8 ? ds_cu_alloc(c, (size_t)P * 4, &err) : NULL;
    float *sg = f8 ? ds_cu_alloc(c, (size_t)P * 4, &err) : NULL;
    if (f8 &&
        (!qf || !qg || !sf || !sg || ds_cu_ptpc_quantize_bf16(c, qf, sf, dfb, P, Kf, 0, Kf, &err) ||
         ds_cu_ptpc_quantize_bf16(c, qg, sg, dgb, P, Kg, 0, Kg, &err)))
        DIE("%s", err.msg);
    const ds_cu_mat mf = f8 ? (ds_cu_mat){(const uint16_t *)qf, P, Kf, DS_CU_FP8, sf, NULL, 0}
                            : (ds_cu_mat){dfb, P, Kf, DS_CU_BF16, NULL, NULL, 0};
    const ds_cu_mat mg = f8 ? (ds_cu_mat){(const uint16_t *)qg, P, Kg, DS_CU_FP8, sg, NULL, 0}
                            : (ds_cu_mat){dgb, P, Kg, DS_CU_BF16, NULL, NULL, 0};
    if (ds_cu_short_conv_silu_batch(c, &cb, &err)) DIE("%s", err.msg);
    ds_cu_l2norm_heads2(c, dqkv, qs, dqkv + no, 1.0f, n_seq, H, dk, 1e-6f);
    if (ds_cu_matmul(c, df, P, dpre + 3 * P, ld, n_seq, &mf, &err) ||
        ds_cu_matmul(c, dgt, P, dpre + 3 * P + Kf, ld, n_seq, &mg, &err))
        DIE("%s", err.msg);
    ds_cu_kda_gate(c, dg, df, n_seq, H, dk, dA, dbias, lb_form, lb, dbeta, dpre + 3 * P + nf, ld);
    if (ds_cu_kda_recurrent_batch(c, df, dqkv, dqkv + no, dqkv + 2 * no, dg, dbeta, doff, dsp[0],
                                  NULL, 0, n_seq, H, dk, dk, 0, &err))
        DIE("%s", err.msg);
    ds_cu_gated_rmsnorm_heads(c, dy[0], df, dgt, dnw, n_seq, H, dk, neps);
    ds_cu_set_batch_invariant(c, 0);
    const ds_cu_kda_decode kd = {.pre = dpre,
                                 .ld = ld,
                                 .fa_off = 3 * P,
                                 .ga_off = 3 * P + Kf,
                                 .b_off = 3 * P + nf,
                                 .conv_w = dcw,
                                 .tails = dtp[1],
                                 .f_b = mf.data,
                                 .g_b = mg.data,
                                 .f_bs = f8 ? sf : NULL,
                                 .g_bs = f8 ? sg : NULL,
                                 .Kf = Kf,
                                 .Kg = Kg,
                                 .A_log = dA,
                                 .dt_bias = dbias,
                                 .o_norm = dnw,
                                 .lower_bound_form = lb_form,
                                 .lb = lb,
                                 .q_scale = qs,
                                 .eps = 1e-6f,
                                 .norm_eps = neps,
                                 .S = dsp[1],
                                 .y = dy[1],
                                 .n_seq = n_seq,
                                 .H = H,
                                 .dk = dk,
                                 .W = W};
    if (ds_cu_kda_decode_fused(c, &kd, &err)) DIE("%s", err.msg);
    for (int r = 0; r < 2; r++) {
        fetch(c, got_y[r], dy[r], no * 4);
        fetch(c, got_S[r], dS[r], nS * 4);
        fetch(c, got_t[r], dt[r], nt * 4);
    }
    const size_t by = words_differ(got_y[1], got_y[0], no);
    const size_t bS = words_differ(got_S[1], got_S[0], nS),
                 bt = words_differ(got_t[1], got_t[0], nt);
    char what[128];
    snprintf(what, sizeof what,
             "kda decode fused%s %d seqs H=%d Kf=%d Kg=%d lb=%d (%zu/%zu/%zu differ)",
             f8 ? " fp8" : "", n_seq, H, Kf, Kg, lb_form, by, bS, bt);
    report(what, by || bS || bt ? INFINITY : 0.0, 0.0);
    /* both runs written (poisoned outputs would agree too), the states and tails moved */
    size_t nan = 0;
    for (size_t i = 0; i < no; i++) nan += isnan(got_y[1][i]) || isnan(got_y[0][i]);
    const size_t still = nS - words_differ(got_S[1], S0, nS);
    const size_t tstill = nt - words_differ(got_t[1], tails, nt);
    snprintf(what, sizeof what, "kda decode fused: %zu NaN, %zu states, %zu tails unmoved", nan,
             still, tstill);
    report(what, nan || still > nS / 2 || tstill > nt / 2 ? INFINITY : 0.0, 0.0);
    for (int r = 0; r < 2; r++) {
        ds_cu_dealloc(dt[r]), ds_cu_dealloc(dS[r]), ds_cu_dealloc(dy[r]);
        ds_cu_dealloc(dtp[r]), ds_cu_dealloc(dsp[r]);
        free(got_y[r]), free(got_S[r]), free(got_t[r]);
    }
    ds_cu_dealloc(dpre), ds_cu_dealloc(dcw), ds_cu_dealloc(dfb), ds_cu_dealloc(dgb);
    ds_cu_dealloc(dA), ds_cu_dealloc(dbias), ds_cu_dealloc(dnw), ds_cu_dealloc(dqkv);
    ds_cu_dealloc(df), ds_cu_dealloc(dg), ds_cu_dealloc(dgt), ds_cu_dealloc(dbeta);
    ds_cu_dealloc(doff), ds_cu_dealloc(qf), ds_cu_dealloc(qg), ds_cu_dealloc(sf);
    ds_cu_dealloc(sg);
    free(pre), free(cw), free(tails), free(S0), free(fb), free(gb), free(A), free(bias), free(nw);
}

typedef struct kda_ctx {
    float *o, *q, *k, *v, *g, *beta, *S;
    float **Sp; /* [n_seq] device pointers into S */
    int32_t *off;
    int T, H, dk, dv, n_seq, batched, chunked;
    const ds_cu_kda_raw *raw; /* chunked on raw inputs (g then holds f_b's outputs) */
} kda_ctx;
static void run_kda(ds_cu *c, void *p) {
    kda_ctx *x = p;
    ds_err err;
    size_t ns = (size_t)x->H * x->dk * x->dv;
    if (x->chunked) { /* n_seq sequences of T / n_seq tokens each, one call (varlen) */
        int start[64], len[64];
        if (x->n_seq > 64) DIE("run_kda: at most 64 chunked sequences");
        for (int z = 0; z < x->n_seq; z++) len[z] = x->T / x->n_seq, start[z] = z * len[z];
        if (x->raw ? ds_cu_kda_chunked_raw(c, x->o, x->q, x->k, x->v, x->g, x->raw, start, len,
                                           x->Sp, x->n_seq, x->H, x->dk, x->dv, &err)
                   : ds_cu_kda_chunked(c, x->o, x->q, x->k, x->v, x->g, x->beta, start, len, x->Sp,
                                       x->n_seq, x->H, x->dk, x->dv, &err))
            DIE("%s", err.msg);
        return;
    }
    if (x->batched) {
        if (ds_cu_kda_recurrent_batch(c, x->o, x->q, x->k, x->v, x->g, x->beta, x->off, x->Sp, NULL,
                                      0, x->n_seq, x->H, x->dk, x->dv, 0, &err))
            DIE("%s", err.msg);
        return;
    }
    for (int s = 0; s < x->n_seq; s++) /* one launch per sequence */
        if (ds_cu_kda_recurrent(c, x->o, x->q, x->k, x->v, x->g, x->beta, x->S + s * ns, NULL, x->T,
                                x->H, x->dk, x->dv, &err))
            DIE("%s", err.msg);
}

/* the recurrence, one sequence and a step's sequences (recurrent and chunked) */
void checks_kda(ds_cu *c) {
    check_kda(c, 1, 4, 128, 128, 1);
    check_kda(c, 9, 3, 64, 96, 1);
    check_kda(c, 33, 2, 32, 40, 0);
    check_kda(c, 5, 32, 128, 128, 0);
    static const int lens_a[] = {1, 3, 1, 5, 2}, lens_b[] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int all_rows[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    check_kda_step(c, lens_a, all_rows, 5, 4, 128, 128, -0.7f, 0);
    check_kda_step(c, lens_b, all_rows, 8, 3, 64, 72, -0.7f, 0);
    {
        int lens[7] = {1, 63, 64, 65, 300, 20, 130}, rows[7] = {0, 0, 0, 0, 0, 1, 0};
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16); /* strong decay */
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
        int one[1] = {1000}, none[1] = {0};
        check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16); /* weak decay, long memory */
        /* the scan and output passes on TF32 tensor cores */
        ds_cu_set_kda_tc(c, g_kda_tc = 1);
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16);
        /* ... split into two TF32 parts each: held to f32's tolerance */
        ds_cu_set_kda_tc(c, g_kda_tc = 3);
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -3.0f, 16);
        /* decays that empty the state within a few tokens: pass 1's exponents through a block's
         * first row must neither overflow nor lose what they keep */
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
        check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16);
        /* ... split into two BF16 parts each (3xBF16): held to f32's tolerance, pass 1 in f32
         * (the model's default, DS_CUDA_KDA_PREP_TC=0) and its block products and solve in
         * 3xBF16 on tensor cores too */
        ds_cu_set_kda_tc(c, g_kda_tc = 4);
        for (int prep_tc = 0; prep_tc <= 1; prep_tc++) {
            ds_cu_set_kda_prep_tc(c, g_kda_prep_tc = prep_tc);
            check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
            check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
            check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
            check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16);
        }
        ds_cu_set_kda_tc(c, g_kda_tc = 3);
        /* pass 1 on CUDA cores in f32 beside the tensor-core scan (DS_CUDA_KDA_PREP_TC=0) */
        ds_cu_set_kda_prep_tc(c, g_kda_prep_tc = 0);
        check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
        check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
        ds_cu_set_kda_tc(c, g_kda_tc = 1);
        check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
        ds_cu_set_kda_prep_tc(c, g_kda_prep_tc = 1);
        /* the scan and outputs on BF16 tensor cores, pass 1's products between 16-row blocks
         * on BF16 tensor cores too, then pass 1 in f32 (both hand the scan BF16 operands) */
        ds_cu_set_kda_tc(c, g_kda_tc = 2);
        for (int prep_tc = 1; prep_tc >= 0; prep_tc--) {
            ds_cu_set_kda_prep_tc(c, prep_tc);
            check_kda_step(c, lens, rows, 7, 4, 128, 128, -0.7f, 16);
            check_kda_step(c, lens, rows, 7, 3, 64, 64, -0.7f, 16);
            check_kda_step(c, lens, rows, 7, 2, 128, 128, -12.0f, 16);
            check_kda_step(c, one, none, 1, 8, 128, 128, -0.1f, 16);
        }
        ds_cu_set_kda_prep_tc(c, 1);
        ds_cu_set_kda_tc(c, g_kda_tc = 0);
        /* raw inputs (the gate, beta and norms inside pass 1) in every mode and form of pass 1:
         * f32, TF32, 3xTF32, BF16, 3xBF16 */
        static const int modes[5] = {0, 1, 3, 2, 4};
        const int rlens[3] = {300, 64, 130}, rlens2[2] = {33, 200};
        for (int m = 0; m < 5; m++)
            for (int prep_tc = 1; prep_tc >= (modes[m] ? 0 : 1); prep_tc--) {
                ds_cu_set_kda_tc(c, g_kda_tc = modes[m]);
                ds_cu_set_kda_prep_tc(c, g_kda_prep_tc = prep_tc);
                check_kda_raw(c, rlens, 3, 4, 128, 0);
                check_kda_raw(c, rlens2, 2, 3, 64, 1);
            }
        ds_cu_set_kda_prep_tc(c, g_kda_prep_tc = 1);
        ds_cu_set_kda_tc(c, g_kda_tc = 0);
    }
}

/* the short conv and the gates */
void checks_kda_inputs(ds_cu *c) {
    check_short_conv(c, 7, 300, 4);
    check_short_conv(c, 1, 4096, 4);
    check_kda_gate(c, 5, 4, 128, 0);
    check_kda_gate(c, 3, 4, 64, 1);
    check_kda_gate(c, 66000, 2, 32, 0); /* more rows than a grid's y: the row loop */
}

/* the batched short convs and the fused decode */
void checks_kda_batch(ds_cu *c) {
    int lens[5] = {1, 4, 1, 9, 2}, rows[5] = {0, 1, 0, 1, 0};
    check_short_conv_batch(c, lens, rows, 5, 4096, 4);
    /* prefill lengths: time chunks (long segments split, short ones in chunk 0 alone) */
    int plens[5] = {2, 130, 1, 900, 3}, prows[5] = {1, 1, 0, 0, 1};
    check_short_conv_batch(c, plens, prows, 5, 512, 4);
    check_short_conv_batch(c, plens, prows, 5, 512, 3); /* a width the fixed form lacks */
    check_kda_decode_fused(c, 1, 32, 128, 128, 0, 0);   /* the 48B shape at batch 1 */
    check_kda_decode_fused(c, 5, 4, 128, 128, 1, 0);    /* the gate's lower bound */
    check_kda_decode_fused(c, 3, 8, 64, 32, 0, 0);      /* narrower f_a and g_a */
    check_kda_decode_fused(c, 1, 32, 128, 128, 0, 1);   /* ptpc FP8 f_b and g_b */
    check_kda_decode_fused(c, 5, 4, 128, 128, 1, 1);
    check_kda_decode_fused(c, 3, 8, 64, 32, 0, 1);
    ds_cu_set_conv_fixed(c, 1); /* the width-4 form: registers, inputs loaded ahead */
    check_short_conv_batch(c, lens, rows, 5, 4096, 4);
    check_short_conv_batch(c, plens, prows, 5, 512, 4);
    ds_cu_set_conv_fixed(c, 0);
}

/* The timing build (pack_devbin.sh's DS_DEVBIN_CLOCKS): where pass 1's cycles went since the
 * last call, by phase (thread 0's of every block summed; the bench makes 12 calls a form); nothing
 * in other builds. */
static void kda_prep_phases(const char *form) {
    double clk[6];
    if (ds_cu_kda_prep_clocks(clk)) return;
    static const char *phase[6] = {"stage", "sums", "A,P", "P,Qp,Kc", "A store", "solve"};
    double tot = 0;
    for (int i = 0; i < 6; i++) tot += clk[i];
    printf("bench kda pass 1 phases, %s (shares of its blocks' cycles, %.3g a call):", form,
           tot / 12.0);
    for (int i = 0; i < 6; i++) printf(" %s %.1f%%", phase[i], 100.0 * clk[i] / tot);
    printf("\n");
}

/* KDA decode (a launch a sequence, or one) and prefill (recurrent, chunked) */
void bench_kda(ds_cu *c, const cuda_ceilings *ceil) {
    double ms;
    const double copy_gbs = ceil->copy_gbs;
    /* 4. KDA decode: Kimi-Linear's 32 heads of 128 x 128, one token per sequence, 1 to 256
     *    sequences, one launch per sequence or one for the batch; bytes = each state read and
     *    written once (q, k, v, g are small beside it) */
    static const int seqs[] = {1, 64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(seqs); i++)
        for (int batched = 0; batched < 2; batched++) {
            kda_ctx kc = {0};
            kc.T = 1, kc.H = 32, kc.dk = 128, kc.dv = 128, kc.n_seq = seqs[i];
            kc.batched = batched;
            if (!batched && kc.n_seq > 64) continue;
            size_t nq = (size_t)kc.H * kc.dk * kc.n_seq, ns = (size_t)kc.H * kc.dk * kc.dv;
            float *h = rand_f32(ns * (size_t)kc.n_seq, -0.5f, 0.5f);
            kc.S = dev(c, h, ns * (size_t)kc.n_seq * 4);
            free(h);
            h = rand_f32(nq, -0.1f, 0.1f);
            kc.q = dev(c, h, nq * 4), kc.k = dev(c, h, nq * 4), kc.v = dev(c, h, nq * 4);
            kc.g = dev(c, h, nq * 4), kc.beta = dev(c, h, (size_t)kc.H * kc.n_seq * 4);
            kc.o = dev(c, NULL, nq * 4);
            free(h);
            float **sp = malloc((size_t)kc.n_seq * sizeof *sp);
            int32_t *off = malloc((size_t)(kc.n_seq + 1) * 4);
            for (int z = 0; z <= kc.n_seq; z++) off[z] = z;
            for (int z = 0; z < kc.n_seq; z++) sp[z] = kc.S + (size_t)z * ns;
            kc.Sp = dev(c, sp, (size_t)kc.n_seq * sizeof *sp);
            kc.off = dev(c, off, (size_t)(kc.n_seq + 1) * 4);
            free(sp), free(off);
            ms = median_ms(c, run_kda, &kc, 3, 30);
            double bytes = 2.0 * (double)ns * 4 * kc.n_seq;
            printf("bench kda decode H=32 dk=dv=128, %d sequence(s), %s: %.4f ms, %.0f GB/s "
                   "(%.0f%% of copy)\n",
                   kc.n_seq, batched ? "one launch" : "a launch each", ms,
                   bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
            ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v);
            ds_cu_dealloc(kc.g), ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.o);
            ds_cu_dealloc(kc.Sp), ds_cu_dealloc(kc.off);
        }

    /* 4b. KDA over a prompt with the recurrent kernel: 8192 tokens, 32 heads of 128 x 128 (the
     *     baseline a chunked kernel has to beat; it walks the tokens in order) */
    {
        kda_ctx kc = {0};
        kc.T = 8192, kc.H = 32, kc.dk = 128, kc.dv = 128, kc.n_seq = 1;
        size_t nq = (size_t)kc.T * kc.H * kc.dk, ns = (size_t)kc.H * kc.dk * kc.dv;
        float *h = rand_f32(nq, -0.1f, 0.1f);
        kc.q = dev(c, h, nq * 4), kc.k = dev(c, h, nq * 4), kc.v = dev(c, h, nq * 4);
        kc.g = dev(c, h, nq * 4), kc.beta = dev(c, h, (size_t)kc.T * kc.H * 4);
        kc.o = dev(c, NULL, nq * 4);
        free(h);
        h = rand_f32(ns, -0.5f, 0.5f);
        kc.S = dev(c, h, ns * 4);
        free(h);
        ms = median_ms(c, run_kda, &kc, 1, 5);
        printf("bench kda recurrent prefill T=8192 H=32 dk=dv=128: %.3f ms, %.0f tokens/s\n", ms,
               kc.T / (ms * 1e-3));
        kc.chunked = 1; /* the same in chunks of 64 (the forward's prefill path) */
        kc.Sp = dev(c, &kc.S, sizeof kc.S);
        double clk[6];
        ds_cu_kda_prep_clocks(clk); /* (zeroes them) */
        ms = median_ms(c, run_kda, &kc, 2, 10);
        printf("bench kda chunked prefill T=8192 H=32 dk=dv=128: %.3f ms, %.0f tokens/s\n", ms,
               kc.T / (ms * 1e-3));
        kda_prep_phases("f32");
        /* the scan and outputs on tensor cores: TF32, then 3xTF32; pass 1 in f32 on CUDA cores,
         * then its products between 16-row blocks on tensor cores too (the default) */
        /* ... each with the outputs made by the scan (the default) and in a third pass */
        for (int prep_tc = 0; prep_tc < 2; prep_tc++)
            for (int mode = 1; mode <= 3; mode++)
                for (int apart = 0; apart < 2; apart++) {
                    ds_cu_set_kda_tc(c, mode);
                    ds_cu_set_kda_prep_tc(c, prep_tc);
                    ds_cu_set_kda_out_fused(c, !apart);
                    ms = median_ms(c, run_kda, &kc, 2, 10);
                    printf(
                        "bench kda chunked prefill T=8192 H=32 dk=dv=128 (%s scan and outputs%s, "
                        "pass 1 %s): %.3f ms, %.0f tokens/s\n",
                        mode == 1   ? "tf32"
                        : mode == 2 ? "bf16"
                                    : "3xtf32",
                        apart ? " apart" : "", prep_tc ? "tensor cores" : "f32", ms,
                        kc.T / (ms * 1e-3));
                    kda_prep_phases(mode == 1   ? (prep_tc ? "tf32" : "f32 (tf32 scan)")
                                    : mode == 2 ? (prep_tc ? "bf16" : "f32 (bf16 scan)")
                                                : (prep_tc ? "3xtf32" : "f32 (3xtf32 scan)"));
                }
        ds_cu_set_kda_out_fused(c, 1);
        /* 3xBF16 (mode 4), pass 1 in f32 (the model's default: "default", the line
         * tools/bench_latest.py takes), then on tensor cores in 3xBF16 too */
        ds_cu_set_kda_tc(c, 4);
        for (int prep_tc = 0; prep_tc < 2; prep_tc++) {
            ds_cu_set_kda_prep_tc(c, prep_tc);
            ms = median_ms(c, run_kda, &kc, 2, 10);
            printf("bench kda chunked prefill T=8192 H=32 dk=dv=128 (3xbf16 scan and outputs, pass "
                   "1 %s): %.3f ms, %.0f tokens/s\n",
                   prep_tc ? "tensor cores" : "f32, default", ms, kc.T / (ms * 1e-3));
            kda_prep_phases(prep_tc ? "3xbf16" : "f32 (3xbf16 scan)");
        }
        ds_cu_set_kda_prep_tc(c, 0);
        /* where a call's time goes: pass 1 alone, then the scan with its outputs alone (the other
         * left out through the what-if's labels; the scan then reads stale products, which only
         * the timing may), BF16 and the default 3xTF32 */
        for (int mode = 2; mode <= 3; mode++) {
            static const char *const part[2][2] = {
                {"pass 1 alone", "kda chunks: scan;kda chunks: outputs"},
                {"scan and outputs alone", "kda chunks: prepare"}};
            ds_cu_set_kda_tc(c, mode);
            for (int i = 0; i < 2; i++) {
                ds_err err;
                if (ds_cu_set_skip(c, part[i][1], &err)) DIE("%s", err.msg);
                ds_cu_kda_prep_clocks(clk); /* (zeroes them) */
                ms = median_ms(c, run_kda, &kc, 2, 10);
                if (ds_cu_set_skip(c, NULL, &err)) DIE("%s", err.msg);
                printf(
                    "bench kda chunked prefill T=8192 H=32 dk=dv=128 (%s scan and outputs, pass 1 "
                    "f32), %s: %.3f ms\n",
                    mode == 2 ? "bf16" : "3xtf32", part[i][0], ms);
                if (i == 0) kda_prep_phases(mode == 2 ? "f32 (bf16 scan)" : "f32 (3xtf32 scan)");
            }
        }
        /* the same on raw inputs (the gate, beta and head norms inside pass 1: a prompt's
         * layers since session 44), whole and pass 1 alone */
        {
            const int H = kc.H, D = kc.dk, ld = H + 8;
            float *h = rand_f32((size_t)H, -2, 0.5f);
            float *dA = dev(c, h, (size_t)H * 4);
            free(h);
            h = rand_f32((size_t)H * D, -1, 1);
            float *dbias = dev(c, h, (size_t)H * D * 4);
            free(h);
            h = rand_f32((size_t)kc.T * ld, -4, 4);
            float *dbi = dev(c, h, (size_t)kc.T * ld * 4);
            free(h);
            const ds_cu_kda_raw raw = {dA, dbias, 0, 0.0f, dbi, ld, 1.0f / sqrtf((float)D), 1e-6f};
            kda_ctx kr = kc;
            kr.raw = &raw;
            for (int mode = 3; mode >= 2; mode--) {
                ds_cu_set_kda_tc(c, mode);
                for (int i = 0; i < 2; i++) {
                    ds_err err;
                    if (ds_cu_set_skip(c, i ? "kda chunks: scan;kda chunks: outputs" : NULL, &err))
                        DIE("%s", err.msg);
                    ds_cu_kda_prep_clocks(clk); /* (zeroes them) */
                    ms = median_ms(c, run_kda, &kr, 2, 10);
                    if (ds_cu_set_skip(c, NULL, &err)) DIE("%s", err.msg);
                    printf("bench kda chunked prefill T=8192 H=32 dk=dv=128 (%s scan and outputs, "
                           "pass 1 f32), raw inputs%s: %.3f ms\n",
                           mode == 2 ? "bf16" : "3xtf32", i ? ", pass 1 alone" : "", ms);
                    if (i)
                        kda_prep_phases(mode == 2 ? "f32 (bf16 scan), raw inputs"
                                                  : "f32 (3xtf32 scan), raw inputs");
                }
            }
            ds_cu_dealloc(dA), ds_cu_dealloc(dbias), ds_cu_dealloc(dbi);
        }
        /* varlen: the same 8192 tokens as 8 sequences of 1024 and 32 of 256 in one call, each on
         * its own state (a step of several prompts; the engine cuts a prompt's steps at the rung
         * spacing, 256 tokens by default: docs/prefix-cache.md), the default mode and BF16 */
        for (int nv = 8; nv <= 32; nv *= 4) {
            float *Sv = dev(c, NULL, ns * (size_t)nv * 4);
            float **sp = malloc((size_t)nv * sizeof *sp);
            for (int z = 0; z < nv; z++) sp[z] = Sv + (size_t)z * ns;
            kda_ctx kv = kc;
            kv.n_seq = nv, kv.S = Sv, kv.Sp = dev(c, sp, (size_t)nv * sizeof *sp);
            free(sp);
            for (int mode = 4; mode >= 2; mode -= 2) { /* the default (3xBF16), then BF16 */
                ds_cu_set_kda_tc(c, mode);
                ms = median_ms(c, run_kda, &kv, 2, 10);
                printf(
                    "bench kda chunked varlen %d x %d H=32 dk=dv=128 (%s scan and outputs, pass 1 "
                    "f32): %.3f ms, %.0f tokens/s\n",
                    nv, kc.T / nv, mode == 4 ? "3xbf16" : "bf16", ms, kc.T / (ms * 1e-3));
            }
            ds_cu_dealloc(kv.Sp), ds_cu_dealloc(Sv);
        }
        ds_cu_set_kda_tc(c, 0);
        ds_cu_set_kda_prep_tc(c, 1);
        ds_cu_dealloc(kc.Sp);
        ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v);
        ds_cu_dealloc(kc.g), ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.o);
    }
}

/* Reads n floats from dir/name into a new buffer. */
static float *read_f32(const char *dir, const char *name, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) DIE("%s: cannot open", path);
    float *p = malloc(n * sizeof *p);
    if (!p) DIE("out of memory");
    const size_t got = fread(p, sizeof *p, n, f);
    const int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != n || extra) DIE("%s: want exactly %zu floats", path, n);
    return p;
}

static void write_f32(const char *dir, const char *name, const float *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, sizeof *p, n, f) != n || fclose(f)) DIE("%s: cannot write", path);
}

/* --kda-io DIR T H D: the chunked KDA on inputs a peer wrote (tools/device/fla_kda_bench.py, so
 * that both are scored against one float64 reference): DIR/{q,k,v,g}.f32 [T][H][D],
 * beta.f32 [T][H], s0.f32 [H][D][D]; writes out_M.f32 [T][H][D] and state_M.f32 [H][D][D] for
 * the scan modes M = 0 (f32), 1 (TF32), 3 (3xTF32), 2 (BF16). */
void kda_io(ds_cu *c, const char *dir, int T, int H, int D) {
    if (T < 1 || H < 1 || !ds_cu_kda_chunked_supports(D, D)) DIE("--kda-io: bad shape");
    const size_t nq = (size_t)T * H * D, ns = (size_t)H * D * D;
    kda_ctx kc = {0};
    kc.T = T, kc.H = H, kc.dk = kc.dv = D, kc.n_seq = 1, kc.chunked = 1;
    static const char *in[4] = {"q.f32", "k.f32", "v.f32", "g.f32"};
    float **dst[4] = {&kc.q, &kc.k, &kc.v, &kc.g};
    for (int i = 0; i < 4; i++) {
        float *h = read_f32(dir, in[i], nq);
        *dst[i] = dev(c, h, nq * 4);
        free(h);
    }
    float *h = read_f32(dir, "beta.f32", (size_t)T * H);
    kc.beta = dev(c, h, (size_t)T * H * 4);
    free(h);
    float *s0 = read_f32(dir, "s0.f32", ns), *o = malloc(nq * 4), *st = malloc(ns * 4);
    if (!o || !st) DIE("out of memory");
    kc.S = dev(c, NULL, ns * 4), kc.o = dev(c, NULL, nq * 4);
    kc.Sp = dev(c, &kc.S, sizeof kc.S);
    /* modes 0, 1, 3 and 2 (BF16) with pass 1 on tensor cores (in 1, 3 and 2), then 1, 3 and 2
     * with pass 1 in f32 ("p") */
    static const int modes[7] = {0, 1, 3, 2, 1, 3, 2}, prep_tc[7] = {1, 1, 1, 1, 0, 0, 0};
    for (int i = 0; i < 7; i++) {
        ds_err err = {{0}};
        if (ds_cu_upload(c, kc.S, s0, ns * 4, &err)) DIE("%s", err.msg);
        ds_cu_set_kda_tc(c, modes[i]);
        ds_cu_set_kda_prep_tc(c, prep_tc[i]);
        run_kda(c, &kc);
        fetch(c, o, kc.o, nq * 4);
        fetch(c, st, kc.S, ns * 4);
        char name[32];
        snprintf(name, sizeof name, "out_%d%s.f32", modes[i], prep_tc[i] ? "" : "p");
        write_f32(dir, name, o, nq);
        snprintf(name, sizeof name, "state_%d%s.f32", modes[i], prep_tc[i] ? "" : "p");
        write_f32(dir, name, st, ns);
    }
    ds_cu_set_kda_prep_tc(c, 1);
    printf("kda-io: %d tokens x %d heads of %d, modes 0 1 3 2 1p 3p 2p written to %s\n", T, H, D,
           dir);
    free(s0), free(o), free(st);
    ds_cu_dealloc(kc.q), ds_cu_dealloc(kc.k), ds_cu_dealloc(kc.v), ds_cu_dealloc(kc.g);
    ds_cu_dealloc(kc.beta), ds_cu_dealloc(kc.S), ds_cu_dealloc(kc.o), ds_cu_dealloc(kc.Sp);
}
