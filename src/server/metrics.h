/* metrics.h — the server's Prometheus metrics, under vLLM's names: each series as `vllm:<name>`
 * (what vLLM's Grafana dashboard queries, with its older aliases gpu_cache_usage_perc and
 * time_per_output_token_seconds) and again as `deltaserve:<name>`, the names of earlier releases.
 *
 * Gauges and token/preemption/finish counters are read from the engine (ds_engine_get_stats) when
 * /metrics is scraped. Latency histograms are measured here, in the server, from the times the
 * engine's events reach it: time to first token, inter-token latency and end-to-end latency, each
 * from the moment the request's body was received. The grammar cache's counters and compile-time
 * histogram (grammar_*) come from the engine's llguidance wrapper (text/grammar.h). Observations
 * come from the engine thread (the event callback), so an observation is a few additions under a
 * mutex. */
#ifndef DS_METRICS_H
#define DS_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"
#include "engine/engine.h"

typedef struct ds_metrics ds_metrics;

typedef enum { DS_HIST_TTFT = 0, DS_HIST_ITL, DS_HIST_E2E, DS_HIST_COUNT } ds_hist_id;

ds_metrics *ds_metrics_new(ds_err *err);
void ds_metrics_free(ds_metrics *m);

/* Records one observation in seconds. Thread-safe. */
void ds_metrics_observe(ds_metrics *m, ds_hist_id h, double seconds);

/* The Prometheus text exposition (version 0.0.4) of the histograms and of the engine numbers in
 * st, every series labelled model_name="<model_name>". malloc'd, NUL-terminated, *len without the
 * NUL; NULL with err when out of memory. */
char *ds_metrics_render(ds_metrics *m, const ds_engine_stats *st, const char *model_name,
                        size_t *len, ds_err *err);

#endif
