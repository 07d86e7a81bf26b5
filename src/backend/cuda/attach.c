/* attach.c — the CUDA backend's table (cuda.h) and a model's life on the GPU: the process's
 * device, found or made at attach, whose memory a model gives out as base/devmem.h's handle
 * (ds_model_dmem); the checks of what the
 * kernels support; the switches (tuning.h); the upload (upload.c); NCCL for a tensor-parallel
 * group; and the device's facts (memory, name, limits, profile). */
#include "backend/cuda/internal.h"
#include "base/devmem.h"
#ifdef DS_HAVE_NCCL
#include "transport/comm_nccl.h"
#endif

#include <unistd.h>

/* ---- the process's device (internal.h's cuda_device) ----------------------------------------
 * Its memory operations, with the device as their context: state copies and fills on
 * the device's stream; a failure is kept in the device and reported by the next step. */
static void *dm_alloc(void *ctx, size_t bytes, ds_err *err) {
    cuda_device *dv = ctx;
    return ds_cu_bind(dv->c, err) ? NULL : ds_cu_alloc(dv->c, bytes, err);
}
static void dm_release(void *ctx, void *p) {
    cuda_device *dv = ctx;
    ds_err e;
    ds_cu_bind(dv->c, &e); /* (a failure here also fails the free, which has nothing to report) */
    ds_cu_dealloc(p);
}
static void dm_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    cuda_device *dv = ctx;
    ds_err e;
    if ((ds_cu_bind(dv->c, &e) || ds_cu_copy_any(dv->c, dst, src, bytes, &e)) && !dv->copy_err[0])
        snprintf(dv->copy_err, sizeof dv->copy_err, "%s", e.msg);
}
static void dm_zero(void *ctx, void *p, size_t bytes) {
    cuda_device *dv = ctx;
    ds_err e;
    if ((ds_cu_bind(dv->c, &e) || ds_cu_fill_bytes(dv->c, p, 0, bytes, &e)) && !dv->copy_err[0])
        snprintf(dv->copy_err, sizeof dv->copy_err, "%s", e.msg);
}
static const ds_dmem_ops dm_ops = {dm_alloc, dm_release,       dm_copy,
                                   dm_zero,  ds_cu_host_alloc, ds_cu_host_free};

/* The backend's registry of devices: the one this process drives, or NULL before the first
 * attach and after the last detach. One process drives one GPU because a job runs one rank per
 * GPU (--device is the local rank), and because every model of the process (a second engine's,
 * the DSpark draft's target, a stage's) must share that device's stream: a state copy the engine
 * makes through one model's handle is then ordered with the steps of all of them. Its reference
 * count (refs) is the models attached; it lives in the backend, not in base, so that nothing
 * outside the CUDA backend holds a device. (Unlocked, as the operations base/devmem.h installed
 * before it were.) */
static struct { cuda_device *dev; } g_devices;

/* The device of GPU index: the registry's (shared), or a new one registered now. */
static cuda_device *device_acquire(int index, ds_err *err) {
    cuda_device *dv = g_devices.dev;
    if (dv && dv->index != index) {
        ds_errf(err, "device cuda: this process already uses GPU %d, asked for %d", dv->index,
                index);
        return NULL;
    }
    if (!dv) {
        if (!(dv = calloc(1, sizeof *dv))) {
            ds_errf(err, "cuda: out of host memory");
            return NULL;
        }
        if (ds_cu_create(index, &dv->c, err)) {
            free(dv);
            ds_err_prefix(err, "device cuda");
            return NULL;
        }
        dv->index = index;
        dv->dmem = (ds_dmem){&dm_ops, dv};
        g_devices.dev = dv;
    }
    dv->refs++;
    return dv;
}

/* A model lets go of the device; the last one frees it (and takes it out of the registry). */
static void device_release(cuda_device *dv) {
    if (--dv->refs == 0) {
        if (g_devices.dev == dv) g_devices.dev = NULL;
        ds_cu_timeline_close(); /* (if one was opened: its last records, before the context) */
        ds_cu_free(dv->c);
        free(dv);
    }
}

static int cuda_available(void) {
    if (g_devices.dev) return 1;
    ds_cu *c = NULL;
    ds_err e;
    if (ds_cu_create(0, &c, &e)) return 0;
    ds_cu_free(c);
    return 1;
}

/* ---- attach and detach ---------------------------------------------------------------------- */

static void cuda_detach(ds_model *m) {
    ds_cuda_model *cm = m->be_ctx;
    if (!cm) return;
    for (int i = 0; i < cm->n_allocs; i++) ds_cu_dealloc(cm->allocs[i]);
    cuda_drop_graphs(cm);
    ds_cu_dealloc(cm->sc);
    ds_cu_dealloc(cm->stage);
    ds_cu_dealloc(cm->iarena);
    ds_cu_dealloc(cm->parena);
    free(cm->allocs);
    free(cm->layers);
    free(cm->conv);
    if (cm->st.n)
        fprintf(stderr,
                "[deltaserve] cuda step times: %ld decode steps, host %.3f ms a step (least %.3f), "
                "device %.3f ms (least %.3f): the host's own %.3f ms\n",
                cm->st.n, 1e3 * cm->st.host_s / cm->st.n, 1e3 * cm->st.host_min_s,
                cm->st.dev_ms / cm->st.n, cm->st.dev_min_ms,
                (1e3 * cm->st.host_s - cm->st.dev_ms) / cm->st.n);
    free(cm->h_i);
    free(cm->h_p);
    free(cm->tp_host);
    free(cm->draw_d);
    free(cm->draw_out);
    free(cm->draw_cu);
    free(cm->draw_ed);
    free(cm->draw_tok);
    free(cm->h_kda);
    ds_host_draws_free(&cm->draws);
#ifdef DS_HAVE_NCCL
    ds_nccl_free(cm->nccl);
#endif
    cuda_device *dv = cm->dev;
    free(cm);
    m->be_ctx = NULL;
    device_release(dv);
}

/* Tensor parallelism across GPUs: the TP group's sums through NCCL when every rank of the group
 * has a GPU of its own (DS_NCCL=0: never). Every rank of the group decides the same way from the
 * same all-gathered facts, so either all of them join or none does; when none does (ranks that
 * share a GPU, no NCCL in the build, a failed bootstrap) the sums keep going through the host
 * and MPI, with a line saying why. Collective over the TP group, like the load. */
static void setup_nccl(ds_model *m, ds_cuda_model *cm, int device) {
#ifdef DS_HAVE_NCCL
    const int T = m->tp_size;
    if (T <= 1 || !cm->tune.nccl || !m->opts.allgather) return;
    /* me: [0] host id, [1] GPU, [2] got an id (tp rank 0), [3 ..] the id: floats carry the bits */
    enum { NW = 3 + DS_NCCL_ID_BYTES / 4 };
    float me[NW] = {0}, *all = malloc((size_t)T * NW * sizeof(float));
    if (!all) return;
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    uint32_t hh = 2166136261u; /* FNV-1a of the host name */
    for (const char *p = host; *p; p++) hh = (hh ^ (uint8_t)*p) * 16777619u;
    memcpy(&me[0], &hh, 4);
    me[1] = (float)device;
    ds_err err = {{0}};
    if (m->tp_rank == 0 && !ds_nccl_unique_id(&me[3], &err)) me[2] = 1.0f;
    if (m->opts.allgather(m->opts.allgather_ctx, me, NW, all)) {
        free(all);
        return; /* the comm layer names the failure */
    }
    const char *why = NULL; /* (tp rank 0, the one that prints, knows why it made no id) */
    if (all[2] != 1.0f) why = err.msg[0] ? err.msg : "no NCCL id from tp rank 0";
    for (int i = 0; i < T && !why; i++)
        for (int j = 0; j < i && !why; j++)
            if (!memcmp(&all[(size_t)i * NW], &all[(size_t)j * NW], 2 * sizeof(float)))
                why = "ranks of the TP group share a GPU";
    ds_nccl *nc = NULL;
    if (!why && ds_nccl_init(&nc, &all[3], T, m->tp_rank, device, &err)) why = err.msg;
    cm->nccl = nc;
    free(all);
    if (why && m->tp_rank == 0)
        fprintf(stderr, "[deltaserve] tensor-parallel sums through the host (%s)\n", why);
#else
    (void)device;
    if (m->tp_size > 1 && m->tp_rank == 0)
        fprintf(stderr,
                "[deltaserve] tensor-parallel sums through the host (built without NCCL)\n");
    (void)cm;
#endif
}

/* What the kernels support, checked at load so that a model they cannot run is refused with its
 * reason before any memory is taken, not at its first step. */
static int check_shapes(const ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int dk = c->kda_head_dim, W = c->short_conv_kernel_size;
    if (m->n_kda && dk != 16 && dk != 32 && dk != 64 && dk != 128)
        return ds_errf(err, "device cuda: KDA head dim %d (the kernels take 16, 32, 64 or 128)",
                       dk);
    if (m->n_kda && (W < 1 || W > 8))
        return ds_errf(err, "device cuda: short conv kernel size %d (1..8)", W);
    if (c->num_experts &&
        (c->num_experts_per_token > 64 || (c->use_grouped_topk && c->num_expert_group > 64)))
        return ds_errf(err, "device cuda: %d experts per token, %d groups (at most 64 each)",
                       c->num_experts_per_token, c->num_expert_group);
    if (c->attn_res_block_size > 0 && ds_model_max_banks(m) + 1 > 32)
        return ds_errf(err, "device cuda: %d AttnRes blocks (the mix takes at most 31)",
                       ds_model_max_banks(m));
    return DS_OK;
}

/* DS_CUDA_KDA_FUSED asked for: a line saying whether it applies to this model. */
static void say_kda_fused(const ds_model *m, const ds_cuda_model *cm) {
    const char *kf = cm->tune.kda_fused_set;
    for (int i = m->l0; kf && i < m->l1; i++)
        if (m->layers[i].kind == DS_LAYER_KDA) {
            fprintf(stderr, "[deltaserve] DS_CUDA_KDA_FUSED=%s: %s\n", kf,
                    !cuda_kda_fuse_fits(m, cm, &cm->layers[i].kda)
                        ? "this model's KDA shape does not fit the fused decode kernel"
                    : cm->tune.kda_fused > 0
                        ? "decode steps of that many sequences or fewer take the fused KDA kernel"
                        : "the fused KDA decode kernel is off");
            break;
        }
}

static int cuda_attach(ds_model *m, int device_index, ds_err *err) {
    if (check_shapes(m, err)) return DS_ERR;
    int n_dev = ds_cu_device_count();
    if (n_dev < 1) return ds_errf(err, "device cuda: no GPU found");
    device_index %= n_dev; /* more ranks than GPUs share them */
    cuda_device *dv = device_acquire(device_index, err);
    if (!dv) return DS_ERR;
    ds_cuda_model *cm = calloc(1, sizeof *cm);
    if (!cm) {
        device_release(dv);
        return ds_errf(err, "cuda: out of host memory");
    }
    cm->m = m;
    cm->dev = dv;
    m->be_ctx = cm;
    cm->c = dv->c;
    ds_cu_set_batch_invariant(cm->c, m->opts.batch_invariant);
    ds_cuda_tuning_read(&cm->tune);
    if (ds_cuda_tuning_apply(&cm->tune, cm->c, err) || cuda_upload_weights(cm, m, err)) goto fail;
    say_kda_fused(m, cm);
    setup_nccl(m, cm, device_index);
    return ds_cu_sync(cm->c, err);
fail:
    ds_err_prefix(err, "device cuda: uploading the weights");
    cuda_detach(m);
    return DS_ERR;
}

/* ---- the device's facts ----------------------------------------------------------------------
 */

static ds_cu *cu_of(const ds_model *m) {
    const ds_cuda_model *cm = m->be_ctx;
    return cm->c;
}

static const ds_dmem *cuda_dmem(const ds_model *m) {
    const ds_cuda_model *cm = m->be_ctx;
    return cm ? &cm->dev->dmem : NULL;
}

static size_t cuda_mem_free(const ds_model *m) {
    return ds_cu_mem_free(cu_of(m));
}

static void cuda_profile_report(const ds_model *m, FILE *f, const char *title) {
    ds_cu_prof_report(cu_of(m), f, title);
}

static double cuda_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    return ds_cu_prof_gemm_tflops(cu_of(m), ms_per_step);
}

static int cuda_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    return ds_cu_measure_limits(cu_of(m), copy_gbs, gemm_tflops, err);
}

static const char *cuda_device_name(const ds_model *m) {
    return ds_cu_device_name(cu_of(m));
}

const ds_backend_ops ds_cuda_backend = {
    .name = "cuda",
    .device_memory = 1,
    .available = cuda_available,
    .attach = cuda_attach,
    .detach = cuda_detach,
    .forward = cuda_forward,
    .mem_free = cuda_mem_free,
    .dmem = cuda_dmem,
    .device_name = cuda_device_name,
    .limits = cuda_limits,
    .profile_report = cuda_profile_report,
    .profile_gemm_tflops = cuda_profile_gemm_tflops,
    .draft_create = cuda_draft_create,
    .draft_free = cuda_draft_free,
    .draft_write_context = cuda_draft_write_context,
    .draft_propose = cuda_draft_propose,
};
