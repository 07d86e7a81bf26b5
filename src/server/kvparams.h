/* kvparams.h — vLLM's kv_transfer_params on the HTTP side of prefill/decode disaggregation
 * (docs/pd.md): what a producer's request asks for and its answer names, and the pull a
 * consumer's request triggers before it is submitted. */
#ifndef DS_KVPARAMS_H
#define DS_KVPARAMS_H

#include <jansson.h>

#include "engine/engine.h"
#include "server/openai.h"

/* The engine request of q (prompt ids[n], events to fn(user)), on the connection thread before
 * submit, with its P/D part: a producer's request with do_remote_decode gets a fresh transfer id
 * (q->kv_export_id, spec.kv_export_id); a consumer's with do_remote_prefill pulls and verifies the
 * producer's blocks into spec.kv_import, and when that fails the reason is logged and counted and
 * the request runs without them (its prompt is recomputed). */
ds_request_spec ds_kv_spec(ds_engine *e, ds_oai_request *q, const int32_t *ids, int n,
                           ds_event_fn fn, void *user);
/* The response r (a non-streaming answer, or a streamed chunk that ends a choice) with
 * kv_transfer_params added when the request was a producer's prefill (where the consumer pulls
 * from), as vLLM's NIXL connector names them. Returns r. */
json_t *ds_kv_annotate(ds_engine *e, const ds_oai_request *q, json_t *r);

#endif
