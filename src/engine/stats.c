/* stats.c — the engine's statistics: the queue, pool, prefix-cache and offload figures the engine
 * thread refreshes around each step, and the snapshot /metrics and the tests read. */
#include "engine/engine_impl.h"

void eng_update_queue_stats(ds_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->n_queued = ds_sched_n_waiting(e->sched);
    for (request *r = e->inbox; r; r = r->next) e->n_queued++;
    e->stats.running = ds_sched_n_running(e->sched);
    e->stats.waiting = e->n_queued;
    e->stats.pages_total = ds_page_n_total(e->pages);
    e->stats.pages_used = e->stats.pages_total - ds_page_n_free(e->pages);
    e->stats.slots_total = ds_slot_n_total(e->slots);
    e->stats.slots_used = e->stats.slots_total - ds_slot_n_free(e->slots);
    e->stats.pages_cached_idle = ds_page_n_cached_idle(e->pages);
    if (e->prefix) {
        ds_prefix_stats ps;
        ds_prefix_get_stats(e->prefix, &ps);
        e->stats.prefix_query_tokens = ps.query_tokens;
        e->stats.prefix_hit_tokens = ps.hit_tokens;
        e->stats.ckpt_kept = ps.ckpt_kept;
        e->stats.ckpt_dropped = ps.ckpt_dropped;
        e->stats.ckpt_evicted = ps.ckpt_evicted;
        e->stats.forks = ps.forks;
        e->stats.prefix_pages_evicted = ps.pages_evicted;
        e->stats.prefix_collisions = ps.collisions;
        e->stats.ckpt_slots_total = ps.ckpt_total;
        e->stats.ckpt_slots_used = ps.ckpt_used;
    }
    if (e->offload) {
        ds_offload_stats os;
        ds_offload_get_stats(e->offload, &os);
        e->stats.offload_stores = os.stores;
        e->stats.offload_loads_ram = os.loads_ram;
        e->stats.offload_loads_disk = os.loads_disk;
        e->stats.offload_loads_remote = os.loads_remote;
        e->stats.offload_misses = os.misses;
        e->stats.offload_bad = os.bad;
        e->stats.offload_remote_errors = os.remote_errors;
    }
    pthread_mutex_unlock(&e->mu);
}

void ds_engine_get_stats(ds_engine *e, ds_engine_stats *s) {
    ds_xfer_stats xs = {0};
    if (e->xfer) ds_xfer_server_stats(e->xfer, &xs);
    ds_xfer_client_stats xc = {0};
    if (e->xclient) ds_xfer_client_get_stats(e->xclient, &xc);
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    pthread_mutex_unlock(&e->mu);
    s->kv_held = xs.held;
    s->kv_expired = xs.expired;
    s->kv_served = xs.served;
    s->kv_send_errors = xs.errors;
    s->kv_connects = xc.connects;
    s->kv_conn_reuses = xc.reuses;
    pthread_mutex_lock(&e->gmu); /* the grammars are made once, under gmu, and kept */
    ds_grammars *g = e->grammars;
    pthread_mutex_unlock(&e->gmu);
    memset(&s->grammar, 0, sizeof s->grammar);
    if (g) ds_grammars_stats(g, &s->grammar);
}
