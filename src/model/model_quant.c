/* model_quant.c — the loader's part of quantization (docs/quantization.md): which weights
 * ptpc_fp8 quantizes and doing it at load, and binding a checkpoint's MXFP4 routed experts as they
 * are published (packed, never widened). The products themselves are the kernels'. */
#include "model/model_impl.h"
#include "model/backend.h"
#include "kernels/shared/quant.h"
#include "kernels/shared/rand_hash.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *const ds_quant_names[] = {"none", "ptpc_fp8", NULL};
const char *const ds_kv_dtype_names[] = {"auto", "fp8", "bf16", NULL};

static int name_index(const char *const *names, const char *name) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}
int ds_quant_from_name(const char *name) {
    return name_index(ds_quant_names, name);
}
int ds_kv_dtype_from_name(const char *name) {
    return name_index(ds_kv_dtype_names, name);
}
const char ds_quant_default_exclude[] =
    "embed_tokens,lm_head,conv1d,block_sparse_moe.gate.weight,self_attn.b_proj,kv_b_proj";

/* Never quantized, whatever the list says: the embedding is a row lookup; the lm_head is shared
 * with the DSpark draft, which reads it as the checkpoint has it; kv_b_proj is also used as
 * per-head matrices by the absorbed attention (y = x W as well as x W^T). */
static const char *const never[] = {"embed_tokens", "lm_head", "kv_b_proj"};

int ds_quant_wants(const ds_model *m, const char *name, ds_dtype dt) {
    if (m->opts.quantization != DS_QUANT_PTPC_FP8) return 0;
    if (dt != DS_DT_BF16 && dt != DS_DT_F16 && dt != DS_DT_F32) return 0;
    for (size_t i = 0; i < DS_ARRAY_LEN(never); i++)
        if (strstr(name, never[i])) return 0;
    const char *list =
        m->opts.quantization_exclude ? m->opts.quantization_exclude : ds_quant_default_exclude;
    for (const char *p = list; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char frag[256]; /* a fragment longer than any tensor name matches nothing */
        if (len && len < sizeof frag) {
            memcpy(frag, p, len);
            frag[len] = 0;
            if (strstr(name, frag)) return 0;
        }
        p += len + (comma ? 1 : 0);
    }
    return 1;
}

int ds_quant_check_opts(const ds_model_opts *o, ds_err *err) {
    if (o->quantization != DS_QUANT_NONE && o->quantization != DS_QUANT_PTPC_FP8)
        return ds_errf(err, "quantization %d: expected none or ptpc_fp8", o->quantization);
    if (o->quantization_exclude && o->quantization != DS_QUANT_PTPC_FP8)
        return ds_errf(err, "--quantization-exclude needs --quantization ptpc_fp8");
    if (o->kv_dtype < 0 || o->kv_dtype > 2) /* (ds_kv_dtype_names: auto, fp8, bf16) */
        return ds_errf(err, "kv cache dtype %d: expected auto, fp8 or bf16", o->kv_dtype);
    return DS_OK;
}

int ds_quant_ptpc(ds_model *m, const ds_mat *w, int c0, int nc, ds_mat *out, ds_err *err) {
    uint8_t *codes = ds_aligned_alloc((size_t)w->rows * (size_t)nc + 64, err);
    float *scales = ds_malloc((size_t)(w->rows ? w->rows : 1) * sizeof(float), err);
    if (!codes || !scales || ds_model_own(m, codes, err) || ds_model_own(m, scales, err)) {
        free(codes);
        free(scales);
        return DS_ERR;
    }
    ds_ptpc_quantize(codes, scales, w, c0, nc);
    *out = (ds_mat){codes, DS_DT_F8_E4M3, w->rows, nc, scales};
    return DS_OK;
}

/* Checks an E8M0 scale tensor: 255 is NaN in the format, and no weight of a real checkpoint. */
static int check_scales(const ds_tensor *t, ds_err *err) {
    const uint8_t *s = t->data;
    for (size_t i = 0; i < t->nbytes; i++)
        if (s[i] == 255)
            return ds_errf(err, "%s: tensor '%s': E8M0 scale byte 255 (NaN) at element %zu",
                           t->file, t->name, i);
    return DS_OK;
}

int ds_quant_bind_mxfp4(ds_model *m, const char *base, int rows, int cols, ds_mat *out,
                        ds_err *err) {
    char pn[512], sn[512];
    snprintf(pn, sizeof pn, "%s.weight_packed", base);
    snprintf(sn, sizeof sn, "%s.weight_scale", base);
    memset(out, 0, sizeof *out);
    if (!ds_st_find(m->st, pn)) return DS_OK; /* not packed: the caller binds .weight */
    if (cols % DS_MXFP4_GROUP)
        return ds_errf(err, "tensor '%s': MXFP4 rows of %d values are not whole groups of %d", pn,
                       cols, DS_MXFP4_GROUP);
    const ds_tensor *tp, *ts;
    int64_t ps[2] = {rows, cols / 2}, ss[2] = {rows, cols / DS_MXFP4_GROUP};
    if (ds_st_get(m->st, pn, 1u << DS_DT_U8, 2, ps, &tp, err) ||
        ds_st_get(m->st, sn, 1u << DS_DT_U8, 2, ss, &ts, err) || check_scales(ts, err))
        return DS_ERR;
    *out = (ds_mat){tp->data, DS_DT_MXFP4, rows, cols, ts->data};
    m->weight_bytes += tp->nbytes + ts->nbytes;
    return DS_OK;
}

/* The binary exponent of the BF16 draw's scale for `cols` columns (model.c's rand_mat). */
static int rand_e2(int cols) {
    int e;
    frexpf(sqrtf(3.0f / (float)(cols > 0 ? cols : 1)), &e);
    return e - 1;
}

int ds_quant_rand_mxfp4(ds_model *m, uint64_t key, int rows, int cols, ds_mat *out, ds_err *err) {
    const size_t nc = (size_t)rows * (size_t)(cols / 2),
                 ns = (size_t)rows * (cols / DS_MXFP4_GROUP);
    const int e2 = rand_e2(cols);
    m->weight_bytes += nc + ns;
    if (m->be->device_memory) { /* drawn on the device from the descriptor */
        ds_rand_mat *d = ds_malloc(sizeof *d, err);
        if (!d || ds_model_own(m, d, err)) {
            free(d);
            return DS_ERR;
        }
        *d = (ds_rand_mat){DS_RAND_MAGIC, m, key, 0, 0, cols, 0.0f, e2};
        *out = (ds_mat){d, DS_DT_MXFP4, rows, cols, NULL};
        return DS_OK;
    }
    uint8_t *codes = ds_aligned_alloc(nc + 64, err), *scales = ds_malloc(ns + 1, err);
    if (!codes || !scales || ds_model_own(m, codes, err) || ds_model_own(m, scales, err)) {
        free(codes);
        free(scales);
        return DS_ERR;
    }
    for (size_t i = 0; i < nc; i++) codes[i] = ds_rand_mxfp4_code(key, i);
    for (size_t j = 0; j < ns; j++) scales[j] = ds_rand_mxfp4_scale(key, j, e2);
    *out = (ds_mat){codes, DS_DT_MXFP4, rows, cols, scales};
    return DS_OK;
}
