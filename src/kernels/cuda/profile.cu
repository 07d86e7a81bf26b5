/* profile.cu — measurement: the device's ceilings (copy and GEMM rates), event timers, and the
 * per-op profile (labels, the what-if skip list, the cuBLAS GEMMs' own interval). */
#include "kernels/cuda/common.cuh"

/* The two ceilings every GPU figure is reported against, measured now: the device-to-device copy
 * rate (bytes read + written, 1 GiB buffers, median of 10) and cuBLAS's BF16 GEMM rate (8192^3,
 * median of 5). */
extern "C" int ds_cu_measure_limits(ds_cu *c, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    const size_t cb = (size_t)1 << 30;
    const int n = 8192;
    void *a = NULL, *b = NULL;
    float times[10];
    CU_TRY(cudaMalloc(&a, cb), "limits");
    if (cudaMalloc(&b, cb) != cudaSuccess) {
        cudaFree(a);
        return ds_errf(err, "cuda: limits: cannot allocate 2 GiB");
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemsetAsync(a, 0x3c, cb, c->stream);
    cudaMemsetAsync(b, 0, cb, c->stream);
    for (int i = 0; i < 12; i++) {
        cudaEventRecord(e0, c->stream);
        cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, c->stream);
        cudaEventRecord(e1, c->stream);
        cudaEventSynchronize(e1);
        if (i >= 2) cudaEventElapsedTime(&times[i - 2], e0, e1);
    }
    qsort(times, 10, sizeof(float), [](const void *x, const void *y) {
        float u = *(const float *)x, v = *(const float *)y;
        return (u > v) - (u < v);
    });
    *copy_gbs = 2.0 * (double)cb / (times[5] * 1e-3) / 1e9;
    /* the GEMM reuses the two buffers: A, B [n][n] BF16 (128 MiB each), C in the rest of b.
     * Random operands, as a model's are: on a constant fill (the copy's) the tensor cores draw
     * less power and run faster than they do on a model (bench/RESULTS.md session 17). */
    uint16_t *A = (uint16_t *)a, *B = (uint16_t *)a + (size_t)n * n, *C = (uint16_t *)b;
    int rc = ds_cu_fill_random_bf16(c, A, 2 * (size_t)n, n, 0x6c696d697473ull, 0, 0, n, 1.0f, err);
    for (int i = 0; i < 7 && rc == DS_OK; i++) {
        cudaEventRecord(e0, c->stream);
        rc = ds_cu_gemm_bf16(c, C, A, B, n, n, n, err);
        cudaEventRecord(e1, c->stream);
        cudaEventSynchronize(e1);
        if (i >= 2) cudaEventElapsedTime(&times[i - 2], e0, e1);
    }
    if (rc == DS_OK) {
        qsort(times, 5, sizeof(float), [](const void *x, const void *y) {
            float u = *(const float *)x, v = *(const float *)y;
            return (u > v) - (u < v);
        });
        *gemm_tflops = 2.0 * n * (double)n * n / (times[2] * 1e-3) / 1e12;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    if (rc) return rc;
    CU_TRY(cudaGetLastError(), "limits");
    return DS_OK;
}

/* ---- timing ------------------------------------------------------------------------------------
 */

struct ds_cu_timer {
    cudaEvent_t a, b;
};

extern "C" ds_cu_timer *ds_cu_timer_start(ds_cu *c) {
    ds_cu_timer *t = (ds_cu_timer *)calloc(1, sizeof *t);
    if (!t) return NULL;
    cudaEventCreate(&t->a);
    cudaEventCreate(&t->b);
    cudaEventRecord(t->a, c->stream);
    return t;
}

extern "C" double ds_cu_timer_stop(ds_cu *c, ds_cu_timer *t) {
    if (!t) return -1.0;
    cudaEventRecord(t->b, c->stream);
    cudaEventSynchronize(t->b);
    float ms = -1.0f;
    cudaEventElapsedTime(&ms, t->a, t->b);
    cudaEventDestroy(t->a);
    cudaEventDestroy(t->b);
    free(t);
    return ms;
}

/* ---- per-op profile ------------------------------------------------------------------------- */
enum { PROF_EVENTS = 8192, PROF_LABELS = 96 };
struct cu_prof {
    cudaEvent_t ev[PROF_EVENTS + 1]; /* a step's marks, then the step's end */
    const char *at[PROF_EVENTS];     /* [n] the label each mark opened */
    int n;
    const char *label[PROF_LABELS]; /* [n_labels] distinct labels, first-seen order */
    double ms[PROF_LABELS];         /* [n_labels] device time summed over steps */
    long count[PROF_LABELS];        /* [n_labels] intervals summed */
    int n_labels, steps, dropped;
    const char *cur;   /* the label of the interval open now (NULL before a step's first mark) */
    double step_flops; /* the FLOPs of this step's weight GEMMs so far (prof_gemm_close) */
    double gemm_flops; /* ... summed over the steps since the last report */
    /* each weight GEMM by the op that ran it: a GEMM mark's caller and FLOPs [n] (other marks:
     * NULL), then the sums since the last report by caller [n_gemm], first-seen order */
    const char *gcaller[PROF_EVENTS];
    double gflops[PROF_EVENTS];
    const char *glabel[PROF_LABELS];
    double gms[PROF_LABELS], gfl[PROF_LABELS];
    long gcount[PROF_LABELS];
    int n_gemm;
};

/* Every weight GEMM that cuBLAS runs is timed under this label of its own (the caller's label
 * resumes after it), so that a profile can say how fast the GEMMs themselves ran. */
static const char PROF_GEMM[] = "cuBLAS weight GEMMs";

static void prof_clear(cu_prof *p) { /* the sums start over; a step's pending marks stay */
    memset(p->ms, 0, sizeof p->ms);
    memset(p->count, 0, sizeof p->count);
    p->n_labels = p->steps = p->dropped = 0;
    p->gemm_flops = 0;
    memset(p->gms, 0, sizeof p->gms);
    memset(p->gfl, 0, sizeof p->gfl);
    memset(p->gcount, 0, sizeof p->gcount);
    p->n_gemm = 0;
}

extern "C" void ds_cu_prof_enable(ds_cu *c, int on) {
    if (on && !c->prof) {
        cu_prof *p = (cu_prof *)calloc(1, sizeof *p);
        if (!p) return; /* a profile is best effort: no memory, no profile */
        for (int i = 0; i <= PROF_EVENTS; i++)
            if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
                for (int j = 0; j < i; j++) cudaEventDestroy(p->ev[j]);
                cudaGetLastError();
                free(p);
                return;
            }
        c->prof = p;
    } else if (!on && c->prof) {
        for (int i = 0; i <= PROF_EVENTS; i++) cudaEventDestroy(c->prof->ev[i]);
        free(c->prof);
        c->prof = NULL;
    }
}

extern "C" int ds_cu_set_skip(ds_cu *c, const char *labels, ds_err *err) {
    free(c->skip);
    c->skip = NULL;
    c->skipping = 0;
    if (!labels || !*labels) return DS_OK;
    if (!(c->skip = strdup(labels))) return ds_errf(err, "cuda: out of host memory");
    return DS_OK;
}

/* Is label one of the ';'-separated names in list? */
static int label_listed(const char *list, const char *label) {
    const size_t n = strlen(label);
    for (const char *at = list; at && *at;) {
        const char *end = strchr(at, ';');
        const size_t len = end ? (size_t)(end - at) : strlen(at);
        if (len == n && !strncmp(at, label, n)) return 1;
        at = end ? end + 1 : NULL;
    }
    return 0;
}

/* Opens an interval under label (no what-if bookkeeping: see ds_cu_prof_mark). */
static void prof_open(ds_cu *c, const char *label) {
    cu_prof *p = c->prof;
    if (!p || capturing(c)) return;
    if (p->n == PROF_EVENTS) { /* the step's remaining time goes to its last label */
        p->dropped++;
        return;
    }
    if (cudaEventRecord(p->ev[p->n], c->stream) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    p->gcaller[p->n] = NULL;
    p->at[p->n++] = p->cur = label;
}

extern "C" void ds_cu_prof_mark(ds_cu *c, const char *label) {
    if (c->skip) c->skipping = label_listed(c->skip, label);
    prof_open(c, label);
}

/* A weight GEMM's interval: prof_gemm_open before the cuBLAS call returns the caller's label,
 * prof_gemm_close after it reopens that label and counts the call's FLOPs. The what-if's skip
 * state is the caller's throughout (cuBLAS calls are never left out anyway). */
const char *prof_gemm_open(ds_cu *c) {
    cu_prof *p = c->prof;
    if (!p || capturing(c)) return NULL;
    const char *prev = p->cur ? p->cur : "(before the first label)";
    const int at = p->n;
    prof_open(c, PROF_GEMM);
    if (p->n == at + 1) p->gcaller[at] = prev, p->gflops[at] = 0;
    return prev;
}

void prof_gemm_close(ds_cu *c, const char *prev, double flops) {
    if (!prev) return;
    cu_prof *p = c->prof;
    p->step_flops += flops;
    if (p->n > 0 && p->at[p->n - 1] == PROF_GEMM && p->gcaller[p->n - 1])
        p->gflops[p->n - 1] += flops;
    prof_open(c, prev);
}

/* label's index in labels [*n] (first-seen order), added when new; -1 when the table is full */
static int label_slot(const char **labels, int *n, const char *label) {
    int l = 0;
    while (l < *n && labels[l] != label && strcmp(labels[l], label)) l++;
    if (l == *n) {
        if (l == PROF_LABELS) return -1;
        labels[(*n)++] = label;
    }
    return l;
}

/* order [n]: the indices of ms [n], largest first */
static void by_time(int *order, const double *ms, int n) {
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && ms[order[j]] > ms[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
}

extern "C" void ds_cu_prof_step_end(ds_cu *c) {
    c->skipping = 0; /* what follows a step (sampling, copies) is never left out */
    cu_prof *p = c->prof;
    if (!p || !p->n || capturing(c)) return;
    const double flops = p->step_flops;
    p->step_flops = 0, p->cur = NULL;
    if (cudaEventRecord(p->ev[p->n], c->stream) != cudaSuccess ||
        cudaEventSynchronize(p->ev[p->n]) != cudaSuccess) {
        cudaGetLastError();
        p->n = 0;
        return;
    }
    p->gemm_flops += flops;
    for (int i = 0; i < p->n; i++) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        const int l = label_slot(p->label, &p->n_labels, p->at[i]);
        if (l < 0) continue;
        p->ms[l] += ms;
        p->count[l]++;
        const int g = p->at[i] == PROF_GEMM && p->gcaller[i]
                          ? label_slot(p->glabel, &p->n_gemm, p->gcaller[i])
                          : -1;
        if (g >= 0) p->gms[g] += ms, p->gfl[g] += p->gflops[i], p->gcount[g]++;
    }
    p->n = 0;
    p->steps++;
}

extern "C" void ds_cu_prof_report(ds_cu *c, FILE *f, const char *title) {
    cu_prof *p = c->prof;
    if (!p || !p->steps || !f) {
        if (p) prof_clear(p);
        return;
    }
    int order[PROF_LABELS];
    double total = 0.0;
    for (int i = 0; i < p->n_labels; i++) total += p->ms[i];
    by_time(order, p->ms, p->n_labels);
    fprintf(f, "profile: %s — %d steps, %.3f ms device time per step%s\n", title, p->steps,
            total / p->steps, p->dropped ? " (marks dropped: raise PROF_EVENTS)" : "");
    fprintf(f, "  %-24s %12s %8s %10s\n", "op", "ms/step", "share", "calls/step");
    for (int i = 0; i < p->n_labels; i++) {
        int l = order[i];
        fprintf(f, "  %-24s %12.4f %7.1f%% %10.1f\n", p->label[l], p->ms[l] / p->steps,
                total > 0 ? 100.0 * p->ms[l] / total : 0.0, (double)p->count[l] / p->steps);
    }
    double gemm_ms;
    const double tf = ds_cu_prof_gemm_tflops(c, &gemm_ms);
    if (tf > 0) {
        fprintf(f, "  %s: %.3f TFLOP a step in %.3f ms, %.1f TFLOP/s\n", PROF_GEMM,
                p->gemm_flops / p->steps / 1e12, gemm_ms, tf);
        by_time(order, p->gms, p->n_gemm); /* ... by the op that ran them */
        for (int i = 0; i < p->n_gemm; i++) {
            const int g = order[i];
            fprintf(f, "    %-28s %10.4f ms/step %8.1f TFLOP/s %8.1f calls/step\n", p->glabel[g],
                    p->gms[g] / p->steps,
                    p->gms[g] > 0 ? p->gfl[g] / (p->gms[g] * 1e-3) / 1e12 : 0.0,
                    (double)p->gcount[g] / p->steps);
        }
    }
    prof_clear(p);
}

extern "C" double ds_cu_prof_gemm_tflops(ds_cu *c, double *ms_per_step) {
    cu_prof *p = c->prof;
    *ms_per_step = 0;
    if (!p || !p->steps || p->gemm_flops <= 0) return 0;
    for (int l = 0; l < p->n_labels; l++)
        if (p->label[l] == PROF_GEMM) *ms_per_step = p->ms[l] / p->steps;
    return *ms_per_step > 0 ? p->gemm_flops / p->steps / (*ms_per_step * 1e-3) / 1e12 : 0;
}
