"""Invariant 5 under pipeline x tensor parallelism (PP 2 x TP 2, four MPI ranks): prefix hits,
forks from KDA checkpoints and offload loads give exactly the greedy tokens of a one-process
server that caches nothing. The parallel server's pools are made small so that prompts evict
each other's pages into the RAM offload tier and come back from it; each rank stores and loads
its own layers, and the ranks agree on every hit."""

import pytest

from conftest import MODEL_NAME, Server

COMMON = " ".join(f"shared{i}" for i in range(90))  # a prefix every prompt starts with


def prompt(tag, n=60):
    return COMMON + " " + " ".join(f"{tag}{i}" for i in range(n))


def run(server, text, max_tokens=8, **kw):
    status, r = server.post_json("/v1/completions", {
        "model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, **kw})
    assert status == 200, r
    return r["choices"][0]["logprobs"]["tokens"]


def delta(after, before, key):
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def reference():
    srv = Server("--no-enable-prefix-caching", "--seed", "1", env_args=False)
    yield srv
    assert srv.stop() == 0


def dist_server(*extra):
    # 1M of cache: a few hundred tokens of pages per rank, so the prompts below evict each other
    return Server("-tp", "2", "-pp", "2", "--kv-cache-memory", "1M",
                  "--max-num-batched-tokens", "256", "--state-checkpoint-interval-tokens", "64",
                  "--kv-offload-ram", "64M", "--seed", "1", *extra, env_args=False)


@pytest.mark.parametrize("spec", [[], ["--speculative-method", "ngram",
                                        "--num-speculative-tokens", "3"]],
                         ids=["plain", "ngram"])
def test_pp2_tp2_prefix_fork_offload_match_one_process(reference, spec):
    srv = dist_server(*spec)
    try:
        tags = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
        want = {t: run(reference, prompt(t)) for t in tags + ["golf"]}
        before = srv.metrics()
        for t in tags:  # cold; later ones push earlier pages out to the offload tier
            assert run(srv, prompt(t)) == want[t], t
        for t in tags[:2]:  # back from the offload tier (or the device pool where still held)
            assert run(srv, prompt(t)) == want[t], t
        assert run(srv, prompt("golf")) == want["golf"]  # new suffix: forks off the shared rung
        after = srv.metrics()
        assert delta(after, before, "deltaserve:prefix_cache_hits_total") >= 64
        assert delta(after, before, "deltaserve:prefix_cache_forks_total") >= 1
        assert delta(after, before, "deltaserve:kv_offload_loads_ram_total") >= 1
        if spec:
            assert delta(after, before, "deltaserve:spec_decode_num_verifies_total") >= 1
    finally:
        log = "".join(srv.log[-30:])
        assert srv.stop() == 0, log
