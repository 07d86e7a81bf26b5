"""Prefill/decode disaggregation (docs/pd.md): a producer and a consumer of the model on this
machine, driven first the way vllm-router drives vLLM's NIXL connector (this test plays the
router), then through vllm-router itself. Greedy text and logprobs through the pair must equal one
plain server's, for prompts from 1 token to nearly the context limit, with prefix caching on both
and DSpark on the consumer; a block corrupted in flight, a transfer that expired and a producer
that is not there must each end in a recompute with the same output, counted in /metrics.

The last tests pair servers of different layouts (TP 1 -> TP 2, PP 2 -> TP 1, TP 1 -> PP 2 x
TP 2): each producer rank files its own slice and each consumer rank cuts its own out.

These servers have their own configuration, so the module is marked `once`: it runs in make
test's plain pass, not again under DS_SERVE_ARGS."""

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import DS_BIN, DS_MODEL, MODEL_NAME, Server

pytestmark = pytest.mark.once  # its servers have their own configuration (conftest.py)

SPEC = ("--speculative-method", "dspark", "--num-speculative-tokens", "4")
HOLD_S = 4  # the producer frees an unpulled transfer after this


def kv_config(role, **extra):
    return ("--kv-transfer-config", json.dumps({"kv_role": role, **extra}))


def pool_use(srv, timeout=20):
    """(running, waiting, page use, KDA slot use) once all are zero, or when timeout passes:
    cached blocks are evictable and do not count, so (0, 0, 0, 0) says the faults the tests
    inject leaked no pool."""
    deadline = time.time() + timeout
    while True:
        x = srv.metrics()
        busy = tuple(x["deltaserve:" + k] for k in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "state_slot_usage_perc"))
        if busy == (0, 0, 0, 0) or time.time() > deadline:
            return busy
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ref():
    srv = Server("--seed", "1", env_args=False)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def prod():
    # the producer loads the draft too (its pages carry the draft's rows, as the consumer's do)
    # but never proposes
    srv = Server("--seed", "1", *SPEC, *kv_config(
        "kv_producer", kv_connector="DeltaServeConnector",
        kv_connector_extra_config={"hold_timeout_s": HOLD_S}), env_args=False)
    yield srv
    assert srv.metrics()["vllm:kv_transfer_held"] == 0  # nothing left pinned
    assert pool_use(srv) == (0, 0, 0, 0)
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def cons():
    srv = Server("--seed", "1", *SPEC, *kv_config("kv_consumer"), env_args=False)
    yield srv
    assert pool_use(srv) == (0, 0, 0, 0)  # after every fault of the module's tests
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def text_ids(ref):
    """A long run of real token ids (the model's own text) to cut prompts from."""
    status, r = post(ref, "/tokenize", {"prompt": " ".join(
        f"Q{i}: Tom has {i % 17 + 2} apples and buys {i % 5 + 3} more; how many now?"
        for i in range(600))})
    assert status == 200
    return r["tokens"], r["max_model_len"]


def post(srv, path, body):
    """(status, JSON): a long prompt's prefill on a shared CPU can outlast post_json's minute."""
    status, _, data = srv.request("POST", path, body, timeout=600)
    return status, json.loads(data) if data else None


def m(srv, name):
    return srv.metrics().get("vllm:" + name, 0.0)


def why(srv, reason):
    """Failed pulls of srv for one reason (unavailable, damaged, mismatch, local)."""
    return m(srv, f'kv_transfer_pull_failure_reasons_total{{reason="{reason}"}}')


# what vllm-router sends to the prefill server in its NIXL mode
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill(prod, path, body):
    status, p = post(prod, path, dict(body, max_tokens=1, stream=False,
                                          kv_transfer_params=PREFILL_KV))
    assert status == 200, p
    kv = p["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_port"] > 0 and len(kv["remote_request_id"]) == 16
    return kv


def same(a, b):
    """Greedy text, chosen tokens' logprobs and the top alternatives, exactly."""
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["text"] == cb["text"]
    assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
    assert ca["logprobs"]["token_logprobs"] == cb["logprobs"]["token_logprobs"]
    assert ca["logprobs"]["top_logprobs"] == cb["logprobs"]["top_logprobs"]
    assert ca["finish_reason"] == cb["finish_reason"]


def completion(ids, max_tokens=12):
    return {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 2, "ignore_eos": True}


def test_pair_equals_one_server(ref, prod, cons, text_ids):
    ids, max_len = text_ids
    rung = 256  # the default --state-checkpoint-interval-tokens: where a resume can start
    lengths = [1, 15, 16, 17, 255, 256, 257, 600, 1500, min(4000, max_len - 16)]
    assert len(ids) >= lengths[-1] + 60
    for i, n in enumerate(lengths):
        body = completion(ids[7 * i: 7 * i + n])  # a new first token each: no shared prefixes
        want = post(ref, "/v1/completions", body)[1]
        pulls, fails, hits = m(cons, "kv_transfer_pulls_total"), \
            m(cons, "kv_transfer_pull_failures_total"), m(cons, "prefix_cache_hits_total")
        wire_bytes, wire_s = m(cons, "kv_transfer_pull_bytes_total"), \
            m(cons, "kv_transfer_pull_seconds_total")
        exp_bytes, exp_s = m(prod, "kv_transfer_export_bytes_total"), \
            m(prod, "kv_transfer_export_seconds_total")
        kv = prefill(prod, "/v1/completions", body)
        status, got = post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert status == 200, got
        same(got, want)
        assert m(cons, "kv_transfer_pulls_total") == pulls + 1, "".join(cons.log[-8:])
        assert m(cons, "kv_transfer_pull_failures_total") == fails
        # the pull's bytes and its time on the wire are counted (their ratio is its rate)
        assert m(cons, "kv_transfer_pull_bytes_total") > wire_bytes
        assert 0 < m(cons, "kv_transfer_pull_seconds_total") - wire_s < 30
        # one part each side: the bytes the producer filed are the bytes the consumer pulled,
        # and the export's time (the gather from the pools) is counted
        assert m(prod, "kv_transfer_export_bytes_total") - exp_bytes == \
            m(cons, "kv_transfer_pull_bytes_total") - wire_bytes
        assert 0 < m(prod, "kv_transfer_export_seconds_total") - exp_s < 30
        # the consumer resumed from the deepest rung before the last token: the pulled blocks
        assert m(cons, "prefix_cache_hits_total") - hits == (n - 1) // rung * rung, n
    assert m(prod, "kv_transfer_exports_total") >= len(lengths)
    assert m(prod, "kv_transfer_held") == 0  # every transfer pulled and freed
    # one connection to the producer, opened by the first pull and kept for the others
    assert m(cons, "kv_transfer_connections_total") == 1
    assert m(cons, "kv_transfer_connection_reuses_total") == len(lengths) - 1
    # the producer never speculated; the consumer did
    assert m(prod, "spec_decode_num_verifies_total") == 0
    assert m(cons, "spec_decode_num_verifies_total") > 0


def test_concurrent_pulls_equal_one_server(ref, prod, cons, text_ids):
    """Six consumer requests at once, each pulling its own transfer from one producer: the
    client's kept connections are shared out among the HTTP threads (a pull holds one alone, the
    others open more), and every answer is one server's exactly (invariant 7: greedy output does
    not depend on the batch), each resumed from its own blocks."""
    ids, _ = text_ids
    lengths = [300, 420, 520, 640, 780, 900]
    bodies = [completion(ids[11 * i + 3: 11 * i + 3 + n]) for i, n in enumerate(lengths)]
    want = [post(ref, "/v1/completions", b)[1] for b in bodies]
    kvs = [prefill(prod, "/v1/completions", b) for b in bodies]
    assert m(prod, "kv_transfer_held") == len(bodies)
    pulls, fails, hits = m(cons, "kv_transfer_pulls_total"), \
        m(cons, "kv_transfer_pull_failures_total"), m(cons, "prefix_cache_hits_total")
    conns = m(cons, "kv_transfer_connections_total")
    got = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def run(i):
        start.wait()
        got[i] = post(cons, "/v1/completions", dict(bodies[i], kv_transfer_params=kvs[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i, (status, r) in enumerate(got):
        assert status == 200, (i, r)
        same(r, want[i])
    assert m(cons, "kv_transfer_pulls_total") == pulls + len(bodies)
    assert m(cons, "kv_transfer_pull_failures_total") == fails
    # each resumed from its own deepest rung (256 tokens apart)
    assert m(cons, "prefix_cache_hits_total") - hits == sum((n - 1) // 256 * 256 for n in lengths)
    assert m(cons, "kv_transfer_connections_total") - conns <= len(bodies)
    assert m(prod, "kv_transfer_held") == 0


def test_chat_and_stream_through_pair(ref, prod, cons):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tom has 3 apples "
            "and buys 5 more. How many apples does he have? " * 12}],
            "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "chat_template_kwargs": {"thinking": False}}
    want = post(ref, "/v1/chat/completions", body)[1]
    kv = prefill(prod, "/v1/chat/completions", body)
    got = post(cons, "/v1/chat/completions", dict(body, kv_transfer_params=kv))[1]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    # streamed from the consumer: the same text
    kv = prefill(prod, "/v1/chat/completions", body)
    args = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs",
                                                         "chat_template_kwargs")}
    stream = cons.client().chat.completions.create(
        **args, stream=True, extra_body={"kv_transfer_params": kv,
                                         "chat_template_kwargs": {"thinking": False}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and text == want["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mode, reason", [("1", "block checksum mismatch"),
                                          ("2", "truncated block")])
def test_damaged_transfer_recomputes(ref, prod, text_ids, mode, reason):
    """A block corrupted in flight (a flipped byte) or a transfer cut short: refused whole."""
    ids = text_ids[0]
    bad = Server("--seed", "1", *SPEC, *kv_config("kv_consumer"), "--test-kv-corrupt", mode,
                 env_args=False)
    try:
        body = completion(ids[3: 3 + 700])
        want = post(ref, "/v1/completions", body)[1]
        kv = prefill(prod, "/v1/completions", body)
        status, got = post(bad, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert status == 200, got
        same(got, want)
        assert m(bad, "kv_transfer_pull_failures_total") == 1
        assert why(bad, "damaged") == 1 and why(bad, "mismatch") == why(bad, "unavailable") == 0
        assert m(bad, "kv_transfer_pulls_total") == 0
        assert m(bad, "prefix_cache_hits_total") == 0  # nothing decoded from the bad transfer
        assert any(reason in line for line in bad.log), "".join(bad.log[-5:])
    finally:
        assert bad.stop() == 0


def refused(ref, prod, cons, a, b):
    """Prompt a prefilled on prod, request b sent to cons with a's transfer: cons must refuse it
    (one pull failure more) and answer b as one server does, resuming from none of it."""
    want = post(ref, "/v1/completions", b)[1]
    fails, hits = m(cons, "kv_transfer_pull_failures_total"), m(cons, "prefix_cache_hits_total")
    mismatched = why(cons, "mismatch")
    kv = prefill(prod, "/v1/completions", a)
    same(post(cons, "/v1/completions", dict(b, kv_transfer_params=kv))[1], want)
    assert m(cons, "kv_transfer_pull_failures_total") == fails + 1
    assert why(cons, "mismatch") == mismatched + 1  # counted as what it is
    assert m(cons, "prefix_cache_hits_total") == hits


def test_transfer_of_another_prompt_recomputes(ref, prod, cons, text_ids):
    """The router pairs a transfer with the wrong request: the consumer's own tokens decide."""
    ids = text_ids[0]
    refused(ref, prod, cons, completion(ids[20: 20 + 400]), completion(ids[21: 21 + 400]))


def test_transfer_from_another_checkpoint_recomputes(ref, cons, text_ids, tmp_path):
    """A producer serving other weights of the same config and the same size (one byte of one
    tensor changed: a fine-tune of the same shape): its transfers name another model, so the
    consumer recomputes. (The weights' digest is in both sides' identity whatever tiers either
    keeps; by config and size alone the two would have passed for one model.)"""
    other = tmp_path / os.path.basename(DS_MODEL)  # (the served name: the folder's)
    other.mkdir()
    for name in os.listdir(DS_MODEL):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(DS_MODEL, name), other / name)
            continue
        data = bytearray(open(os.path.join(DS_MODEL, name), "rb").read())
        data[-1] ^= 1  # the last byte of the last tensor's data (the header is untouched)
        (other / name).write_bytes(bytes(data))
    alt = Server("--seed", "1", *SPEC, *kv_config("kv_producer"), env_args=False,
                 model=str(other))
    try:
        body = completion(text_ids[0][30: 30 + 300])
        refused(ref, alt, cons, body, body)
        assert any("another model" in line for line in cons.log[-20:]), "".join(cons.log[-5:])
    finally:
        assert alt.stop() == 0


def test_consumer_with_a_disk_tier_pairs(ref, prod, text_ids, tmp_path):
    """A consumer that keeps a disk tier (its offload keys then name the weights by their bytes)
    pairs with a producer that keeps none: the transfer is installed, not refused (both sides of
    a transfer name the weights alike; once every such pull was refused as another model)."""
    disk = Server("--seed", "1", *SPEC, *kv_config("kv_consumer"), "--kv-offload-disk-dir",
                  str(tmp_path / "tier"), env_args=False)
    try:
        body = completion(text_ids[0][50: 50 + 600])
        want = post(ref, "/v1/completions", body)[1]
        kv = prefill(prod, "/v1/completions", body)
        same(post(disk, "/v1/completions", dict(body, kv_transfer_params=kv))[1], want)
        assert m(disk, "kv_transfer_pulls_total") == 1, "".join(disk.log[-5:])
        assert m(disk, "kv_transfer_pull_failures_total") == 0
        assert m(disk, "prefix_cache_hits_total") == (600 - 1) // 256 * 256
    finally:
        assert disk.stop() == 0


def test_expired_and_missing_transfers_recompute(ref, prod, cons, text_ids):
    ids = text_ids[0]
    body = completion(ids[11: 11 + 300])
    want = post(ref, "/v1/completions", body)[1]
    expired = m(prod, "kv_transfer_expired_total")
    kv = prefill(prod, "/v1/completions", body)
    deadline = time.time() + HOLD_S + 3
    while m(prod, "kv_transfer_expired_total") == expired and time.time() < deadline:
        time.sleep(0.2)
    assert m(prod, "kv_transfer_expired_total") == expired + 1
    assert m(prod, "kv_transfer_held") == 0
    fails, unavailable = m(cons, "kv_transfer_pull_failures_total"), why(cons, "unavailable")
    got = post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))[1]
    same(got, want)
    # a producer that is not there at all (a port nothing listens on)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    t0 = time.time()
    got = post(cons, "/v1/completions", dict(body, kv_transfer_params=dict(
        kv, remote_port=dead_port)))[1]
    assert time.time() - t0 < 30
    same(got, want)
    assert m(cons, "kv_transfer_pull_failures_total") == fails + 2
    assert why(cons, "unavailable") == unavailable + 2


def test_producer_killed_mid_transfer(ref, cons, text_ids):
    """The producer dies after a pull's header, before its bytes: the consumer's pull breaks off
    and the prompt is recomputed (the same output, counted), well within the pull timeout."""
    ids = text_ids[0]
    dying = Server("--seed", "1", *SPEC, *kv_config("kv_producer"), "--test-kv-stall-ms", "4000",
                   env_args=False)
    try:
        body = completion(ids[40: 40 + 600])
        want = post(ref, "/v1/completions", body)[1]
        kv = prefill(dying, "/v1/completions", body)
        fails, unavailable = m(cons, "kv_transfer_pull_failures_total"), why(cons, "unavailable")
        out = {}
        t = threading.Thread(target=lambda: out.update(
            r=post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))))
        t0 = time.time()
        t.start()
        time.sleep(1.5)  # the pull is now inside the producer's stall
        dying.proc.kill()
        t.join(120)
        status, got = out["r"]
        assert status == 200, got
        same(got, want)
        assert m(cons, "kv_transfer_pull_failures_total") == fails + 1
        assert why(cons, "unavailable") == unavailable + 1
        assert time.time() - t0 < 25  # not the 30 s pull timeout: the broken connection ends it
    finally:
        dying.stop()


@pytest.mark.parametrize("layout", [(), ("-pp", "2")], ids=["one", "pp2"])
def test_kv_both_pairs_with_itself(ref, text_ids, layout):
    """kv_both: one server prefills (and holds) and decodes (and pulls), per request; also a
    pipelined job, whose head pulls every stage's part from its own job's ports."""
    both = Server("--seed", "1", *layout, *kv_config("kv_both"), env_args=False)
    try:
        start = 30 if not layout else 190  # a first token no other test's prompt has
        body = completion(text_ids[0][start: start + 520])
        want = post(ref, "/v1/completions", body)[1]
        kv = prefill(both, "/v1/completions", body)
        status, got = post(both, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert status == 200, got
        same(got, want)
        assert m(both, "kv_transfer_pulls_total") == 1
        assert m(both, "kv_transfer_held") == 0
    finally:
        rc = both.stop()
        assert rc == 0, "".join(both.log[-40:])


def test_bad_kv_params_are_400(cons):
    body = completion([5, 6, 7])
    for kv, param in [("yes", "kv_transfer_params"),
                      ({"do_remote_prefill": "true"}, "kv_transfer_params.do_remote_prefill"),
                      ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 0,
                        "remote_request_id": "00000000000000aa"},
                       "kv_transfer_params.remote_port"),
                      ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
                        "remote_request_id": "xyz"}, "kv_transfer_params.remote_request_id")]:
        status, r = post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert status == 400, (kv, r)
        assert r["error"]["param"] == param


@pytest.mark.parametrize("cfg, says", [
    ("{kv_role", "not valid JSON"),
    ('["kv_producer"]', "expected a JSON object"),
    ('{"kv_role": "kv_decoder"}', "kv_role: expected kv_producer, kv_consumer or kv_both"),
    ('{"kv_connector": "X"}', "kv_role"),
    ('{"kv_role": "kv_both", "kv_port": 70000}', "kv_port"),
    ('{"kv_role": "kv_both", "kv_rol": 1}', "unknown field 'kv_rol'"),
])
def test_bad_kv_transfer_config(cfg, says):
    p = subprocess.run([DS_BIN, "serve", "--model", DS_MODEL, "--port", "0",
                        "--kv-transfer-config", cfg], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "--kv-transfer-config" in p.stderr and says in p.stderr, p.stderr


def test_through_vllm_router(ref, prod, cons, text_ids):
    """vllm-router (PyPI) in P/D mode in front of the pair: it sends max_tokens 1 with
    do_remote_decode to the producer, then the consumer the producer's kv_transfer_params."""
    exe = shutil.which("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not installed (make deps installs it from PyPI)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    router = subprocess.Popen(
        [exe, "--vllm-pd-disaggregation", "--prefill", f"http://127.0.0.1:{prod.port}",
         "--decode", f"http://127.0.0.1:{cons.port}", "--host", "127.0.0.1", "--port",
         str(port), "--policy", "round_robin"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import openai
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert router.poll() is None and time.time() < deadline, "router did not start"
                time.sleep(0.2)
        ids = text_ids[0]
        pulls = m(cons, "kv_transfer_pulls_total")
        fails = m(cons, "kv_transfer_pull_failures_total")
        for n in (40, 900):
            body = completion(ids[5: 5 + n])
            want = post(ref, "/v1/completions", body)[1]
            r = c.completions.create(**{k: v for k, v in body.items()
                                        if k not in ("ignore_eos",)},
                                     extra_body={"ignore_eos": True})
            got = r.model_dump()
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["logprobs"]["token_logprobs"] == \
                want["choices"][0]["logprobs"]["token_logprobs"]
        msgs = [{"role": "user", "content": "How many apples are 3 and 5 apples? " * 20}]
        nothink = {"chat_template_kwargs": {"thinking": False}}
        want = post(ref, "/v1/chat/completions", {"model": MODEL_NAME, "messages": msgs,
                                                      "max_tokens": 16, "temperature": 0,
                                                      **nothink})[1]
        stream = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16,
                                           temperature=0, stream=True, extra_body=nothink)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text and text == want["choices"][0]["message"]["content"]
        assert m(cons, "kv_transfer_pulls_total") == pulls + 3  # every request went through P/D
        assert m(cons, "kv_transfer_pull_failures_total") == fails
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()


def test_streamed_producer_answer_carries_kv_params(ref, prod, cons, text_ids):
    """A producer asked with stream true answers kv_transfer_params in the chunk that ends the
    choice (vLLM's place), in no other chunk; the consumer pulls from them as from a JSON answer."""
    ids = text_ids[0]
    body = completion(ids[50: 50 + 500])
    want = post(ref, "/v1/completions", body)[1]
    status, _, data = prod.request("POST", "/v1/completions", dict(
        body, max_tokens=1, stream=True, stream_options={"include_usage": True},
        kv_transfer_params=PREFILL_KV), timeout=600)
    assert status == 200, data
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: {")]
    with_kv = [c for c in chunks if "kv_transfer_params" in c]
    assert len(with_kv) == 1, chunks
    assert with_kv[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1].get("usage") and "kv_transfer_params" not in chunks[-1]
    kv = with_kv[0]["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_port"] > 0 and len(kv["remote_request_id"]) == 16
    pulls = m(cons, "kv_transfer_pulls_total")
    status, got = post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))
    assert status == 200, got
    same(got, want)
    assert m(cons, "kv_transfer_pulls_total") == pulls + 1
    # a streamed answer without do_remote_decode carries none
    status, _, data = prod.request("POST", "/v1/completions", dict(body, max_tokens=1,
                                                                   stream=True), timeout=600)
    assert status == 200 and b"kv_transfer_params" not in data


def test_consumer_restarted(ref, text_ids):
    """The consumer dies and comes back: (1) killed after the producer's prefill, before the pull,
    the restarted consumer pulls the still-held transfer and answers the same; (2) killed during
    the pull (the producer stalls between header and bytes), the producer's send fails and frees
    the transfer at once, and the request resent to the restarted consumer is recomputed (the same
    answer, one pull failure); (3) a transfer nobody asks for again expires. The producer ends
    holding nothing, and only (3) counts as expired."""
    ids = text_ids[0]
    # b must stay held through (1) and (2) (about 9 s on the 2-core VM) and expire in (3)
    prod = Server("--seed", "1", *kv_config("kv_producer", kv_connector_extra_config={
        "hold_timeout_s": 24}), "--test-kv-stall-ms", "3000", env_args=False)
    cons = None
    try:
        a, b, c = (completion(ids[60 + k: 60 + k + 600]) for k in range(3))
        want_a, want_c = (post(ref, "/v1/completions", x)[1] for x in (a, c))
        cons = Server("--seed", "1", *kv_config("kv_consumer"), env_args=False)
        kv_a, kv_b = prefill(prod, "/v1/completions", a), prefill(prod, "/v1/completions", b)
        assert m(prod, "kv_transfer_held") == 2
        cons.proc.kill()  # (1): between the prefill and the pull
        cons.stop()
        cons = Server("--seed", "1", *kv_config("kv_consumer"), env_args=False)
        status, got = post(cons, "/v1/completions", dict(a, kv_transfer_params=kv_a))
        assert status == 200, got
        same(got, want_a)
        assert m(cons, "kv_transfer_pulls_total") == 1
        assert m(cons, "prefix_cache_hits_total") == 512  # resumed from the pulled blocks
        assert m(prod, "kv_transfer_held") == 1  # b's

        kv_c = prefill(prod, "/v1/completions", c)  # (2): killed during c's pull
        out = {}
        t = threading.Thread(target=lambda: out.update(
            r=post(cons, "/v1/completions", dict(c, kv_transfer_params=kv_c))))
        t.start()
        time.sleep(1.5)  # the pull is inside the producer's stall
        cons.proc.kill()
        t.join(60)
        assert out["r"][0] is None  # the client saw the connection drop, no answer
        cons.stop()
        deadline = time.time() + 10  # the stall ends, the send to the dead peer fails
        while m(prod, "kv_transfer_held") != 1 and time.time() < deadline:
            time.sleep(0.2)
        assert m(prod, "kv_transfer_held") == 1  # c freed by the failed send; b still held
        assert m(prod, "kv_transfer_expired_total") == 0
        deadline = time.time() + 10  # counted when the send to the dead peer gave up
        while m(prod, "kv_transfer_send_errors_total") < 1 and time.time() < deadline:
            time.sleep(0.2)
        assert m(prod, "kv_transfer_send_errors_total") == 1
        assert m(prod, "kv_transfer_served_total") == 1  # a's
        cons = Server("--seed", "1", *kv_config("kv_consumer"), env_args=False)
        status, got = post(cons, "/v1/completions", dict(c, kv_transfer_params=kv_c))
        assert status == 200, got
        same(got, want_c)  # c's transfer is gone: recomputed
        assert m(cons, "kv_transfer_pull_failures_total") == 1
        assert m(cons, "kv_transfer_pulls_total") == 0
        assert prod.request("GET", "/health")[0] == 200  # the producer outlived both deaths

        deadline = time.time() + 60  # (3): b is never pulled
        while m(prod, "kv_transfer_held") and time.time() < deadline:
            time.sleep(0.5)
        assert m(prod, "kv_transfer_held") == 0
        assert m(prod, "kv_transfer_expired_total") == 1
        assert pool_use(prod) == (0, 0, 0, 0) and pool_use(cons) == (0, 0, 0, 0)
    finally:
        if cons:
            cons.stop()
        rc = prod.stop()
        assert rc == 0, "".join(prod.log[-60:])


# ---- different TP / PP layouts on the two sides ----------------------------------------------------
# Each rank of a producer's job files its own slice (its layers, its TP share of the KDA heads);
# each rank of the consumer's job pulls the slices it needs straight from the producer's ranks and
# cuts out its own (docs/pd.md, "TP and PP layouts"). Across TP widths the numbers are TP's (sums taken in another order, about
# 1e-5 on a logit: docs/parallelism.md), so logprobs are compared to a tolerance there; a PP
# split at TP 1 is bit-exact, so through it they are compared exactly.

def close(a, b, tol=1e-4):
    """Greedy text and tokens exactly; logprobs (chosen and top alternatives) to tol."""
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["text"] == cb["text"]
    assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
    for x, y in zip(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]):
        assert abs(x - y) <= tol, (x, y)
    for x, y in zip(ca["logprobs"]["top_logprobs"], cb["logprobs"]["top_logprobs"]):
        assert x.keys() == y.keys()
        assert all(abs(x[k] - y[k]) <= tol for k in x), (x, y)
    assert ca["finish_reason"] == cb["finish_reason"]


def through_pair(ref, prod, cons, ids, starts, lengths, check, max_tokens=6):
    """Each prompt (a first token no other test uses, so nothing of it is cached yet) prefilled
    by prod, decoded by cons from the pulled slices: one server's output, one pull, no failure,
    and the consumer resumed from the deepest 256-token rung before the last token."""
    rung = 256
    for s, n in zip(starts, lengths):
        body = completion(ids[s: s + n], max_tokens)
        want = post(ref, "/v1/completions", body)[1]
        pulls, fails, hits, loads = (m(cons, "kv_transfer_pulls_total"),
                                     m(cons, "kv_transfer_pull_failures_total"),
                                     m(cons, "prefix_cache_hits_total"),
                                     cons.metrics().get("deltaserve:kv_offload_loads_ram_total", 0))
        kv = prefill(prod, "/v1/completions", body)
        status, got = post(cons, "/v1/completions", dict(body, kv_transfer_params=kv))
        assert status == 200, got
        check(got, want)
        assert m(cons, "kv_transfer_pulls_total") == pulls + 1, "".join(cons.log[-8:])
        assert m(cons, "kv_transfer_pull_failures_total") == fails, "".join(cons.log[-5:])
        assert m(cons, "prefix_cache_hits_total") - hits == (n - 1) // rung * rung, n
        if n > rung:  # the hit came back through the RAM tier the pulled slices went into
            assert cons.metrics()["deltaserve:kv_offload_loads_ram_total"] > loads
    assert m(prod, "kv_transfer_held") == 0  # every transfer pulled and freed
    assert m(cons, "kv_transfer_held") == 0


def test_tp1_producer_to_tp2_consumer(ref, prod, text_ids):
    """TP 1 -> TP 2: each consumer rank takes its half of every KDA layer's heads (conv tails and
    recurrent states) and the whole latent rows; DSpark on the consumer."""
    ids = text_ids[0]
    cons2 = Server("-tp", "2", "--seed", "1", *SPEC, *kv_config("kv_consumer"), env_args=False)
    try:
        served = m(prod, "kv_transfer_served_total")
        through_pair(ref, prod, cons2, ids, [150, 151, 152], [40, 300, 1300], close)
        # each consumer rank pulled the producer's one part itself (the head's first look at it
        # and rank 1's pull), and the part was freed after the second
        assert m(prod, "kv_transfer_served_total") == served + 6
        assert m(cons2, "spec_decode_num_verifies_total") > 0
    finally:
        log = "".join(cons2.log[-20:])
        assert cons2.stop() == 0, log


def test_pp2_producer_to_tp1_consumer(ref, cons, text_ids):
    """PP 2 -> TP 1: the consumer pulls both stages' slices (the head's names the other's port)
    and joins their layers; the draft's rows come from the last stage. Bit-exact (PP at TP 1)."""
    ids = text_ids[0]
    prod2 = Server("-pp", "2", "--seed", "1", *SPEC, *kv_config("kv_producer"), env_args=False)
    try:
        through_pair(ref, prod2, cons, ids, [160, 161, 162], [40, 300, 1300], same)
        assert m(prod2, "kv_transfer_served_total") == 3  # the head's parts (stage 1 has its own)
        assert m(prod2, "spec_decode_num_verifies_total") == 0
        # stage 1's part damaged in flight (a flipped byte in its last payload): the whole
        # transfer is refused, counted, and the prompt recomputed with the same output
        bad = Server("--seed", "1", *SPEC, *kv_config("kv_consumer"), "--test-kv-corrupt", "1",
                     env_args=False)
        try:
            body = completion(ids[163: 163 + 500], 6)
            want = post(ref, "/v1/completions", body)[1]
            kv = prefill(prod2, "/v1/completions", body)
            same(post(bad, "/v1/completions", dict(body, kv_transfer_params=kv))[1], want)
            assert m(bad, "kv_transfer_pull_failures_total") == 1
            assert m(bad, "kv_transfer_pulls_total") == 0
            assert m(bad, "prefix_cache_hits_total") == 0  # nothing decoded from it
            assert any("block checksum mismatch" in line for line in bad.log)
        finally:
            assert bad.stop() == 0
        # refused at the head's part (paired with another prompt): stage 1's part, never
        # pulled, is released at once (its store confirms it held and freed it), not left to
        # wait out hold_timeout_s
        rel = m(cons, "kv_transfer_releases_total")
        refused(ref, prod2, cons, completion(ids[180: 180 + 300], 4),
                completion(ids[181: 181 + 300], 4))
        assert m(cons, "kv_transfer_releases_total") == rel + 1, "".join(cons.log[-8:])
        assert m(prod2, "kv_transfer_held") == 0
    finally:
        log = "".join(prod2.log[-20:])
        assert prod2.stop() == 0, log


def test_tp2_producer_to_tp1_consumer(ref, cons, text_ids):
    """TP 2 -> TP 1: the consumer joins the two halves of every KDA layer's heads."""
    ids = text_ids[0]
    prod2 = Server("-tp", "2", "--seed", "1", *SPEC, *kv_config("kv_producer"), env_args=False)
    try:
        through_pair(ref, prod2, cons, ids, [165, 166], [300, 900], close)
    finally:
        log = "".join(prod2.log[-20:])
        assert prod2.stop() == 0, log


def test_tp1_producer_to_pp2_tp2_consumer(ref, prod, text_ids):
    """TP 1 -> PP 2 x TP 2 (four ranks): each consumer rank cuts its stage's layers and its half
    of the heads out of the one part the producer has."""
    ids = text_ids[0]
    cons4 = Server("-tp", "2", "-pp", "2", "--seed", "1", *SPEC, *kv_config("kv_consumer"),
                   env_args=False)
    try:
        served = m(prod, "kv_transfer_served_total")
        through_pair(ref, prod, cons4, ids, [170, 171], [300, 700], close, max_tokens=4)
        assert m(prod, "kv_transfer_served_total") == served + 8  # four ranks' pulls a prompt
    finally:
        log = "".join(cons4.log[-20:])
        assert cons4.stop() == 0, log


def test_pp2_producer_to_pp2_consumer(ref, cons, text_ids):
    """PP 2 -> PP 2: each consumer stage pulls its own stage's part straight from the producer's
    rank that has it; the head never receives stage 1's (it pulls fewer bytes than a one-process
    consumer does for the same prompt) and releases part 0 once it has it, since no other rank
    needs it. Bit-exact (PP at TP 1 on both sides)."""
    ids = text_ids[0]
    prod2 = Server("-pp", "2", "--seed", "1", *SPEC, *kv_config("kv_producer"), env_args=False)
    cons2 = Server("-pp", "2", "--seed", "1", *SPEC, *kv_config("kv_consumer"), env_args=False)
    try:
        rel = m(cons2, "kv_transfer_releases_total")
        through_pair(ref, prod2, cons2, ids, [175, 176], [300, 900], same)
        assert m(cons2, "kv_transfer_releases_total") == rel + 2  # part 0 after each look
        # one prompt through both consumers: the head of the split one received less
        body = completion(ids[177: 177 + 900], 4)
        want = post(ref, "/v1/completions", body)[1]
        got = {}
        for c in (cons, cons2):
            b0 = m(c, "kv_transfer_pull_bytes_total")
            kv = prefill(prod2, "/v1/completions", body)
            same(post(c, "/v1/completions", dict(body, kv_transfer_params=kv))[1], want)
            got[c] = m(c, "kv_transfer_pull_bytes_total") - b0
        assert 0 < got[cons2] < 0.8 * got[cons], got
        assert m(prod2, "kv_transfer_held") == 0
    finally:
        log = "".join(cons2.log[-20:]) + "".join(prod2.log[-20:])
        assert cons2.stop() == 0, log
        assert prod2.stop() == 0, log


def test_hung_producer_bounds_a_ranks_pull(ref, text_ids):
    """A producer that holds every pull 6 s between its header and its bytes: the TP 2 consumer's
    head waits it out (its pull runs on the request's own thread, within pull_timeout_s), but rank
    1 pulls inside the step loop, where its whole job waits for it, and gives up after 5 s; that
    rank then misses, the job recomputes the prompt, and the answer is one server's."""
    ids = text_ids[0]
    slow = Server("--seed", "1", *SPEC, *kv_config("kv_producer"), "--test-kv-stall-ms", "6000",
                  env_args=False)
    cons2 = Server("-tp", "2", "--seed", "1", *SPEC, *kv_config("kv_consumer"), env_args=False)
    try:
        body = completion(ids[187: 187 + 300], 4)
        want = post(ref, "/v1/completions", body)[1]
        kv = prefill(slow, "/v1/completions", body)
        hits = m(cons2, "prefix_cache_hits_total")
        t0 = time.time()
        status, got = post(cons2, "/v1/completions", dict(body, kv_transfer_params=kv))
        took = time.time() - t0
        assert status == 200, got
        close(got, want)
        assert 10.5 < took < 25, took  # the head's 6 s and rank 1's 5 s, not its 30 s
        assert m(cons2, "kv_transfer_pulls_total") == 1  # the head's part came
        assert m(cons2, "prefix_cache_hits_total") == hits  # nothing resumed: recomputed
        assert any("timed out" in line for line in cons2.log), "".join(cons2.log[-10:])
        assert pool_use(cons2) == (0, 0, 0, 0)
    finally:
        log = "".join(cons2.log[-20:]) + "".join(slow.log[-20:])
        assert cons2.stop() == 0, log
        assert slow.stop() == 0, log
