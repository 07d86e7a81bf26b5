/* kvparams.c — see kvparams.h. */
#include "server/kvparams.h"

#include <stdio.h>
#include <sys/random.h>

static void prepare(ds_engine *e, ds_oai_request *q, ds_request_spec *spec) {
    int role = ds_engine_kv_role(e);
    if (q->kv_do_remote_decode && (role & DS_KV_PRODUCER)) {
        uint64_t id = 0;
        while (!id)
            if (getrandom(&id, sizeof id, 0) != sizeof id) id = (uint64_t)(ds_now() * 1e9);
        q->kv_export_id = spec->kv_export_id = id;
    }
    if (!q->kv_do_remote_prefill) return;
    ds_err err = {{0}};
    ds_kv_pull *p = NULL;
    if (ds_engine_kv_pull(e, q->kv_remote_host, q->kv_remote_port, q->kv_remote_id, spec->prompt,
                          spec->n_prompt, &p, &err))
        fprintf(stderr, "[deltaserve] %s; recomputing the prompt\n", err.msg);
    spec->kv_import = p;
}

ds_request_spec ds_kv_spec(ds_engine *e, ds_oai_request *q, const int32_t *ids, int n,
                           ds_event_fn fn, void *user) {
    ds_request_spec spec = {ids, n, q->params, fn, user, 0, NULL};
    prepare(e, q, &spec);
    return spec;
}

json_t *ds_kv_annotate(ds_engine *e, const ds_oai_request *q, json_t *r) {
    if (!r || !q->kv_export_id) return r;
    char id[24];
    snprintf(id, sizeof id, "%016llx", (unsigned long long)q->kv_export_id);
    json_t *kv =
        json_pack("{s:b, s:b, s:s, s:i, s:s, s:s, s:[], s:i}", "do_remote_prefill", 1,
                  "do_remote_decode", 0, "remote_host", ds_engine_kv_host(e), "remote_port",
                  ds_engine_kv_port(e), "remote_request_id", id, "remote_engine_id", "deltaserve",
                  "remote_block_ids", "tp_size", ds_engine_kv_tp_size(e));
    if (kv) json_object_set_new(r, "kv_transfer_params", kv);
    return r;
}
