"""Invariant 5 under pipeline x tensor parallelism (PP 2 x TP 2, four MPI ranks): prefix hits,
forks from KDA checkpoints and offload loads give exactly the greedy tokens of a one-process
server that caches nothing. The parallel server's pools are made small so that prompts evict
each other's pages into the RAM offload tier and come back from it; each rank stores and loads
its own layers, and the ranks agree on every hit."""

import pytest

from conftest import MODEL_NAME, Server

pytestmark = pytest.mark.once  # its own servers: DS_SERVE_ARGS changes nothing

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
        # no stage waits for another to file a checkpoint (issue 5)
        assert after["deltaserve:prefix_cache_checkpoint_holds_total"] == 0
        if spec:
            assert delta(after, before, "deltaserve:spec_decode_num_verifies_total") >= 1
            # A fork on a verify step (issue 6): a repeat of a prompt of 64 m + 1 tokens resumes
            # one token short of its end (rungs, like prompt cuts, fall on multiples of the 64-token
            # interval: docs/prefix-cache.md), so its first step — the one that forks the
            # checkpoint on every stage — is already a verify, n-gram drafts riding on the last
            # prompt token.
            ids = [11 + 13 * (j % 7) for j in range(64 + 1)]
            want_ids = greedy_ids(reference, ids, 8)
            assert greedy_ids(srv, ids, 8) == want_ids
            before = srv.metrics()
            assert greedy_ids(srv, ids, 8) == want_ids
            after = srv.metrics()
            assert delta(after, before, "deltaserve:prefix_cache_hits_total") == 64
            assert delta(after, before, "deltaserve:spec_decode_num_fork_verifies_total") == 1
    finally:
        log = "".join(srv.log[-30:])
        assert srv.stop() == 0, log


# ---- speculative decoding under PP x TP (issue 6) ------------------------------------------------

def greedy_ids(server, prompt_ids, max_tokens):
    status, r = server.post_json("/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, r
    return r["choices"][0]["token_ids"]


PROMPTS = [[(37 * i + 11 * j) % 700 for j in range(40 + 9 * i)] for i in range(3)]


def test_invariant6_pp2_tp4_every_accepted_count(reference, tmp_path):
    """Greedy with speculation equals greedy without, under PP 2 x TP 4 (eight ranks), with an
    oracle draft that is right for 0, 1, ..., k positions in turn."""
    k, n_out = 4, 30
    want = [greedy_ids(reference, p, n_out) for p in PROMPTS]
    assert all(len(w) == n_out for w in want)
    orc = tmp_path / "oracle.jsonl"
    import json
    orc.write_text("".join(json.dumps({"prompt": p, "output": w}) + "\n"
                           for p, w in zip(PROMPTS, want)))
    srv = Server("-tp", "4", "-pp", "2", "--speculative-method", "dspark",
                 "--num-speculative-tokens", str(k), "--speculative-test-oracle", str(orc),
                 "--seed", "1", env_args=False)
    try:
        for p, w in zip(PROMPTS, want):
            assert greedy_ids(srv, p, n_out) == w
        m = srv.metrics()
        verifies = m["deltaserve:spec_decode_num_verifies_total"]
        per_pos = [m[f'deltaserve:spec_decode_num_accepted_tokens_per_pos{{position="{i}"}}']
                   for i in range(k)]
        assert verifies > 0
        assert per_pos[k - 1] > 0          # a = k happened
        assert verifies > per_pos[0]        # a = 0 happened
        for i in range(k - 1):              # and every count between: a >= i+1 more often
            assert per_pos[i] > per_pos[i + 1]
    finally:
        assert srv.stop() == 0


def draft_variant(tmp_path, taps):
    """models/<m>/draft with other target_layer_ids (same number of taps, so the same weights)."""
    import json
    import os
    from conftest import DS_MODEL
    d = tmp_path / ("draft_" + "_".join(str(t) for t in taps).replace("-", "m"))
    d.mkdir()
    cfg = json.load(open(os.path.join(DS_MODEL, "draft", "config.json")))
    assert len(cfg["target_layer_ids"]) == len(taps)
    cfg["target_layer_ids"] = taps
    (d / "config.json").write_text(json.dumps(cfg))
    for f in os.listdir(os.path.join(DS_MODEL, "draft")):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(DS_MODEL, "draft", f), d / f)
    return str(d)


def spec_run(args):
    """Greedy outputs and the draft digest of a server started with args (one request at a time,
    so every configuration drafts in the same order)."""
    srv = Server("--speculative-method", "dspark", "--num-speculative-tokens", "4", "--seed", "1",
                 *args, env_args=False)
    try:
        outs = [greedy_ids(srv, p, 24) for p in PROMPTS]
        m = srv.metrics()
        return outs, m["deltaserve:spec_decode_draft_digest"], \
            m["deltaserve:spec_decode_num_draft_tokens_total"]
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("taps", [None, [-1, 0, 1]], ids=["model-taps", "embedding-and-stage0"])
def test_tap_relays_give_the_drafts_of_one_process(tmp_path, taps):
    """The draft under PP sees the same context as on one process: plain relay, partial-sum relay,
    PP 4 (a stage with no taps, the draft on a stage without the target embedding) and, with taps
    [-1, 0, 1], the embedding tap and every tap on stage 0 — all propose the same drafts, to the
    bit (the partial sums add the taps in the same order as one process does)."""
    extra = ["--draft-model", draft_variant(tmp_path, taps)] if taps else []
    base = spec_run(extra)
    assert base[2] > 0
    for args in (["-pp", "2", "--draft-tap-relay", "plain"],
                 ["-pp", "2", "--draft-tap-relay", "partial-sum"],
                 ["-pp", "4"]):
        got = spec_run(args + extra)
        assert got == base, args


# ---- a rank that dies ----------------------------------------------------------------------------

def rank_pids(root_pid):
    """{world rank: pid} of the MPI ranks below root_pid (read from their environment)."""
    import os
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
        except OSError:
            continue
        for k in map(int, kids):
            todo.append(k)
            try:
                env = open(f"/proc/{k}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    out[int(kv.split(b"=", 1)[1])] = k
    return out


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_rank_ends_the_job_naming_it(how, monkeypatch):
    """A rank killed outright (mpirun notices) or stopped (the others time out on it, here after
    3 s; an idle head's heartbeat makes every rank answer) ends the job non-zero, naming it."""
    import os
    import signal as sig
    import time
    monkeypatch.setenv("DS_COMM_TIMEOUT_S", "3")
    srv = Server("-pp", "2", env_args=False)
    ranks = {}
    for _ in range(50):
        ranks = rank_pids(srv.proc.pid)
        if 1 in ranks:
            break
        time.sleep(0.1)
    assert 1 in ranks, ranks
    run(srv, "hello there", max_tokens=4)  # serving first
    os.kill(ranks[1], getattr(sig, how))
    t0 = time.time()
    try:
        rc = srv.proc.wait(timeout=30)
    finally:
        if how == "SIGSTOP":
            try:
                os.kill(ranks[1], sig.SIGKILL)
            except ProcessLookupError:
                pass
    srv.pump.join(timeout=5)
    log = "".join(srv.log)
    assert rc != 0
    assert time.time() - t0 < 30
    assert ("rank 1" if how == "SIGKILL" else "from rank 1: no answer") in log, log[-2000:]


# ---- pipelined and short of pages (session 30) ---------------------------------------------------

@pytest.mark.parametrize("prefix", [[], ["--no-enable-prefix-caching"]], ids=["prefix", "plain"])
def test_pp2_short_of_pages_every_request_ends_as_one_process(reference, prefix):
    """A -pp 2 server whose pool holds about one and a half of its six concurrent sequences:
    requests preempt each other, across the two micro-batch groups in flight too, and every one
    still ends with one process's greedy tokens. (Before session 30 a sequence short of pages
    evicted only in its own group: two recomputing prompts, one per group, each waited for the
    other's pages, the server spun through empty steps and no client got an answer.)"""
    import concurrent.futures
    prompts = [[(53 * i + 7 * j) % 900 + 5 for j in range(120 + 3 * i)] for i in range(6)]
    want = [greedy_ids(reference, p, 250 - len(p)) for p in prompts]
    srv = Server("-pp", "2", "--kv-cache-memory", "200K", "--max-model-len", "256",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "96", "--seed", "1", *prefix,
                 env_args=False)
    try:
        before = srv.metrics()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: greedy_ids(srv, p, 250 - len(p)), prompts))
        after = srv.metrics()
        assert got == want
        assert delta(after, before, "vllm:num_preemptions_total") >= 2
    finally:
        log = "".join(srv.log[-30:])
        assert srv.stop() == 0, log
