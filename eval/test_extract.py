"""Unit tests of the GSM eval: answer extraction, the prompt format, the committed data files, and
run_eval's plumbing against a small fake OpenAI-style server (no model, no deltaserve build).

Run: python3 -m pytest -q eval/test_extract.py
"""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gsm_eval  # noqa: E402
from gsm_eval import extract_flexible, extract_strict, is_correct  # noqa: E402

gsm = gsm_eval.gsm


@pytest.mark.parametrize("text,want", [
    (" The bags hold 3 * 12 = 36 apples. She has 59 - 15 = 44 apples.\n#### 44", 44),
    ("#### 1,234", 1234),
    ("#### -7", -7),
    ("#### 12.", 12),
    ("x = 5.\n#### 5\n#### 6", 5),       # the first #### line counts
    ("no marker here: 44", None),
    ("####44", None),                    # needs the space, as lm-eval's strict regex
    ("", None),
])
def test_strict(text, want):
    assert extract_strict(text) == want


@pytest.mark.parametrize("text,want", [
    (" The bags hold 3 * 12 = 36 apples.\n#### 44", 44),
    ("so the answer is 17.", 17),
    ("It costs $1,250 in total", 1250),
    ("3.5 then 2.25", 2.25),
    ("the change is -3", -3),
    ("no digits ... $ , .", None),
    ("", None),
])
def test_flexible(text, want):
    assert extract_flexible(text) == want


def test_is_correct():
    assert is_correct(44.0, 44)
    assert not is_correct(None, 44)
    assert not is_correct(43.0, 44)


def test_prompt_format():
    p = {"question": "Q1?", "solution": "A 1 + 2 = 3.", "answer": 3}
    assert gsm.format_example(p) == "Question: Q1?\nAnswer: A 1 + 2 = 3.\n#### 3"
    assert gsm.few_shot_prompt("Q2?", []) == "Question: Q2?\nAnswer:"
    assert gsm.few_shot_prompt("Q2?", [p, p]) == (
        "Question: Q1?\nAnswer: A 1 + 2 = 3.\n#### 3\n\n"
        "Question: Q1?\nAnswer: A 1 + 2 = 3.\n#### 3\n\nQuestion: Q2?\nAnswer:")


def test_committed_files_match_generator():
    """The jsonl files the evals read are what the generator makes, and they are sound."""
    test = gsm_eval.load_jsonl(gsm_eval.DEFAULT_DATASET)
    assert test == gsm.make_problems("test", gsm.TEST_SIZE, 0)
    assert len({gsm.normalize(p["question"]) for p in test}) == gsm.TEST_SIZE
    for p in test:
        gsm.check_problem(p)
    assert gsm_eval.load_jsonl(gsm_eval.DEFAULT_FEWSHOT) == gsm.fewshot_examples()


def test_train_never_sees_test():
    tq = gsm.test_questions()
    train = gsm.make_problems("train", 3000, 1)
    assert not any(gsm.normalize(p["question"]) in tq for p in train)
    assert train == gsm.make_problems("train", 3000, 1)  # deterministic in the seed
    for p in train:
        gsm.check_problem(p)
        assert "\n\n" not in gsm.format_example(p)  # "\n\n" is the stop string


# ------------------------------------------------------------------------------------------------
# run_eval against a fake server: answers right for even indices, wrong for odd ones, fails every
# fifth request with HTTP 500, and reports spec-decode counters that grow by a known amount.

class _Fake(BaseHTTPRequestHandler):
    answers = {}
    calls = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-gsm", "object": "model"}]})
        elif self.path == "/metrics":
            k = _Fake.calls
            text = ("# HELP x\n"
                    f'deltaserve:spec_decode_num_verifies_total{{model_name="m"}} {10 * k}\n'
                    f'deltaserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {30 * k}\n'
                    f'deltaserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {15 * k}\n'
                    f'deltaserve:spec_decode_num_emitted_tokens_total{{model_name="m"}} {25 * k}\n')
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, {"error": "no"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stop"] == ["\n\n"] and body["temperature"] == 0
        prompt = body["prompt"]
        assert prompt.endswith("\nAnswer:") and prompt.count("Question: ") == 5
        q = prompt.rsplit("Question: ", 1)[1][: -len("\nAnswer:")]
        idx, sol, ans = _Fake.answers[q]
        with _Fake.lock:
            _Fake.calls += 1
        if idx % 5 == 4:
            self._send(500, {"error": {"message": "boom"}})
            return
        text = f" {sol}\n#### {ans if idx % 2 == 0 else ans + 1}"
        self._send(200, {"id": "c", "object": "text_completion", "created": 0, "model": "fake-gsm",
                         "choices": [{"index": 0, "text": text, "finish_reason": "stop",
                                      "logprobs": None}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 7,
                                   "total_tokens": 17}})


def test_run_eval_plumbing():
    probs = gsm.make_problems("test", 20, 0)
    _Fake.answers = {p["question"]: (i, p["solution"], p["answer"]) for i, p in enumerate(probs)}
    _Fake.calls = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        r = gsm_eval.run_eval(url, probs, num_concurrent=4, shots=4, limit=None, max_tokens=32)
    finally:
        srv.shutdown()
    ok = [i for i in range(20) if i % 5 != 4]
    assert r["model"] == "fake-gsm" and r["n"] == 20
    assert r["errors"] == 4  # indices 4, 9, 14, 19 (after one retry each)
    assert r["strict_correct"] == sum(1 for i in ok if i % 2 == 0) == 8
    # flexible takes the last number, which is the "#### N" value here too
    assert r["flexible_correct"] == 8
    assert abs(r["strict_match"] - 0.4) < 1e-12
    assert abs(r["strict_match_stderr"] - (0.4 * 0.6 / 20) ** 0.5) < 1e-12
    s = r["spec_decode"]
    assert s["acceptance_rate"] == 0.5 and abs(s["tokens_per_forward"] - 2.5) < 1e-12


def test_tiers_load_and_table():
    """The held-out tiers of issue 37: four files of >= 500 problems with numeric answers, an
    unknown tier is a clear error, and the table prints one row per tier with its stderr."""
    import io

    tiers = gsm_eval.load_tiers("all")
    assert [t for t, _ in tiers] == gsm_eval.TIERS
    for t, probs in tiers:
        assert len(probs) >= 500 and all(p["tier"] == t for p in probs)
        float(probs[0]["answer"])
    assert [t for t, _ in gsm_eval.load_tiers("bignum,indist")] == ["bignum", "indist"]
    with pytest.raises(SystemExit, match="no tier 'nope'"):
        gsm_eval.load_tiers("nope")
    r = {"n": 400, "flexible_extract": 0.25, "flexible_extract_stderr": gsm_eval._stderr(0.25, 400),
         "strict_match": 0.5, "strict_match_stderr": 0.025, "spec_decode": None, "mean_prompt_tokens": 300}
    buf = io.StringIO()
    gsm_eval.print_tier_table({"paraphrase": r}, out=buf)
    assert "| paraphrase | 400 | 300 | 0.2500 ± 0.0217 | 0.5000 ± 0.0250 | - | - |" in buf.getvalue()
