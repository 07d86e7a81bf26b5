#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets into tests/fuzz/corpus/<target>/.

Run from anywhere: python3 tests/fuzz/make_seeds.py. Seeds are small, readable and deterministic;
they are committed, and crashing inputs the fuzzers find are added next to them (crash-*), so
every later run replays them first. Needs only the committed golden tokenizer files and the
model configs that `make` writes (models/tiny-k3); the tiny-linear config is embedded below.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- safetensors ------------------------------------------------------------------------------
DT = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "F64": 8}


def st_file(tensors, meta=None, pad=True):
    """tensors: [(name, dtype, shape)] -> bytes of a valid file (data = a byte counter)."""
    hdr, off, data = {}, 0, b""
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dt, shape in tensors:
        n = DT[dt]
        for s in shape:
            n *= s
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes((off + i) & 0xFF for i in range(n))
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def st_raw(header, data=b""):
    h = header.encode()
    return struct.pack("<Q", len(h)) + h + data


SINGLE = [("w", "F32", [2, 3]), ("b", "BF16", [3]), ("h", "F16", [2, 2]), ("d", "F64", [1]),
          ("i", "I32", [2]), ("l", "I64", []), ("u", "U8", [4]), ("e", "F32", [0, 5])]


def seeds_safetensors():
    t = "fuzz_io_safetensors"
    put(t, "single", b"\0" + st_file(SINGLE, {"format": "pt"}))
    put(t, "single_unpadded", b"\0" + st_file(SINGLE[:3], None, pad=False))
    put(t, "empty_header", b"\0" + st_raw("{}"))
    put(t, "meta_only", b"\0" + st_raw('{"__metadata__":{"format":"pt","k":"v"}}'))
    put(t, "bad_len", b"\0" + struct.pack("<Q", 1 << 40) + b"{}")
    put(t, "short", b"\0\x02\0\0")
    put(t, "overlap", b"\0" + st_raw(
        '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
        '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', bytes(8)))
    put(t, "dup", b"\0" + st_raw(
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', bytes(2)))
    put(t, "lies", b"\0" + st_raw(
        '{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8)))
    put(t, "huge_shape", b"\0" + st_raw(
        '{"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}'))
    put(t, "neg", b"\0" + st_raw('{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,-1]}}'))
    put(t, "truncated", b"\0" + st_raw('{"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}}',
                                       bytes(10)))
    put(t, "not_object", b"\0" + st_raw('[1,2,3]'))
    put(t, "bad_json", b"\0" + st_raw('{"a":{"dtype":'))
    # sharded: index | a | b
    a = st_file([("x.w", "F32", [2, 2]), ("x.b", "BF16", [2])])
    b = st_file([("y.w", "I8", [3]), ("y.z", "F16", [0])])
    idx = json.dumps({"metadata": {"total_size": 28}, "weight_map": {
        "x.w": "a.safetensors", "x.b": "a.safetensors", "y.w": "b.safetensors",
        "y.z": "b.safetensors"}}).encode()
    put(t, "sharded", b"\x01" + idx + b"\n--8<-- a\n" + a + b"\n--8<-- b\n" + b)
    idx2 = json.dumps({"weight_map": {"x.w": "b.safetensors", "q": "../etc/passwd",
                                      "r": "/abs"}}).encode()
    put(t, "sharded_lies", b"\x01" + idx2 + b"\n--8<-- a\n" + a + b"\n--8<-- b\n" + b)
    put(t, "sharded_twice", b"\x01" + json.dumps({"weight_map": {"x.w": "a.safetensors"}}).encode()
        + b"\n--8<-- a\n" + a + b"\n--8<-- b\n" + a)


# ---- config.json ------------------------------------------------------------------------------
TINY_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 768, "eos_token_id": 770,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 128, "kv_lora_rank": 32,
    "linear_attn_config": {"full_attn_layers": [4, 8], "head_dim": 16,
                           "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 4,
                           "short_conv_kernel_size": 4},
    "max_position_embeddings": 4096, "mla_use_nope": True, "model_type": "kimi_linear",
    "moe_intermediate_size": 32, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 4, "num_expert_group": 2,
    "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 8,
    "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "pad_token_id": 1023, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_grouped_topk": True, "v_head_dim": 16, "vocab_size": 1024}


def seeds_config():
    t = "fuzz_io_config"
    put(t, "tiny_linear", json.dumps(TINY_LINEAR, separators=(",", ":")))
    for name, rel in [("tiny_k3", "models/tiny-k3/config.json"),
                      ("tiny_k3_draft", "models/tiny-k3/draft/config.json")]:
        p = os.path.join(REPO, rel)
        if os.path.exists(p):
            with open(p) as f:
                put(t, name, json.dumps(json.load(f), separators=(",", ":")))
    bad = dict(TINY_LINEAR, num_hidden_layers=300)
    put(t, "too_many_layers", json.dumps(bad, separators=(",", ":")))
    lac = dict(TINY_LINEAR["linear_attn_config"], kda_layers=[0, 1, 99], full_attn_layers=[1])
    put(t, "bad_layers", json.dumps(dict(TINY_LINEAR, linear_attn_config=lac)))
    put(t, "wrong_types", json.dumps(dict(TINY_LINEAR, hidden_size="64", rms_norm_eps=[1])))
    put(t, "real_ints", json.dumps(dict(TINY_LINEAR, hidden_size=64.0, vocab_size=1e30)))
    put(t, "empty", "{}")
    put(t, "not_object", "[]")


# ---- tokenizer --------------------------------------------------------------------------------
def read(rel):
    with open(os.path.join(REPO, rel), "rb") as f:
        return f.read()


def seeds_tok():
    t = "fuzz_text_load"
    sep = b"\n--8<-- tiktoken.model\n"
    for v in ["vocab768_kimi_linear", "vocab2048_k3"]:
        d = "tests/golden/tok/" + v
        put(t, v, read(d + "/tokenizer_config.json") + sep + read(d + "/tiktoken.model"))
    import base64
    bytes256 = b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256))
    put(t, "bytes_only", b'{"bos_token": null}' + sep + bytes256)
    cfg = json.dumps({"added_tokens_decoder": {
        "257": {"content": "<|a|>", "special": True},
        "258": {"content": "<|b|>", "special": False}},
        "bos_token": "<|a|>", "eos_token": {"content": "<|b|>"}}).encode()
    put(t, "bytes_named", cfg + sep + bytes256 + base64.b64encode(b"ab") + b" 256\n")
    put(t, "bad_rank", b"{}" + sep + b"YQ== 5\nYg== 0\n")
    put(t, "bad_b64", b"{}" + sep + b"Y=Q= 0\n")
    put(t, "dup_special", json.dumps({"added_tokens_decoder": {
        "1": {"content": "x"}, "2": {"content": "x"}}}).encode() + sep + b"YQ== 0\n")

    t = "fuzz_text_encode"
    texts = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "你好，世界。日本語のテキスト、한국어 텍스트",
        "<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>[BOS][EOS]",
        "  leading   and trailing spaces  \n\n\t\r\n  ",
        "numbers 1234567890 3.14159 -42 1e10",
        "I'm you're they'LL we've isn't",
        "emoji 😀👍🏽 and math ∑∫√ and combining é",
        "code: def f(x):\n    return x ** 2  # comment\n",
        " " * 300 + "x" * 300,
        "",
    ]
    for i, s in enumerate(texts):
        put(t, "text%02d" % i, bytes([i & 1]) + s.encode())
    put(t, "invalid_utf8", b"\x00abc\xff\xfe\xc0\xaf\xed\xa0\x80\xf4\x90\x80\x80")
    put(t, "truncated_utf8", b"\x01abc\xe4\xbd")
    put(t, "ids", b"\x02" + bytes(range(0, 256, 3)))
    put(t, "ids_skip", b"\x07" + bytes(range(255, 0, -5)))


# ---- HTTP bodies -------------------------------------------------------------------------------
def seeds_openai():
    t = "fuzz_server_openai"
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello <|im_end|> there"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "thinking..."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                          "text": "b"}]}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    tool_msgs = [{"role": "user", "content": "weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [{
                     "id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    bodies = [
        (0, {"model": "tiny", "prompt": "Hello world", "max_tokens": 16}),
        (0, {"prompt": [1, 2, 3, 700], "n": 3, "logprobs": 5, "stream": True,
             "stream_options": {"include_usage": True}, "stop": ["\n", "x"], "seed": 7}),
        (0, {"prompt": "abc", "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
             "presence_penalty": 1, "frequency_penalty": -1, "min_tokens": 2, "max_tokens": 8,
             "ignore_eos": True, "skip_special_tokens": False, "stop_token_ids": [5, 6]}),
        (0, {"prompt": ["one string in a list"], "stop": "single", "best_of": 1, "echo": False,
             "suffix": "", "logit_bias": {}}),
        (0, {"prompt": "", "max_tokens": 0}),
        (0, {"prompt": "x", "model": "other"}),
        (1, {"model": "tiny", "messages": msgs, "max_tokens": 8}),
        (3, {"messages": msgs, "logprobs": True, "top_logprobs": 3, "n": 2, "stream": True,
             "stream_options": {"include_usage": True}, "max_completion_tokens": 5}),
        (3, {"messages": tool_msgs, "tools": tools, "tool_choice": "required",
             "response_format": {"type": "json_object"}, "reasoning_effort": "high",
             "chat_template_kwargs": {"thinking": False}, "add_generation_prompt": True}),
        (1, {"messages": tool_msgs, "tools": tools, "tool_choice":
             {"type": "function", "function": {"name": "get_weather"}}}),
        (1, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
        (1, {"messages": []}),
        (0, {"model": "tiny\u0000x", "prompt": "x"}),  # issue 35: cut at the NUL, accepted
        (1, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto\u0000"}),
    ]
    for i, (flags, b) in enumerate(bodies):
        put(t, "body%02d" % i, bytes([flags | 0x0C]) + json.dumps(b).encode())
    put(t, "truncated", b"\x01" + json.dumps(bodies[6][1]).encode()[:40])
    put(t, "not_object", b"\x00[1,2]")


# ---- generated text: reasoning / content / tool calls --------------------------------------------
def seeds_toolparse():
    t = "fuzz_text_toolparse"  # byte 0: bit 0 tools, bit 1 reasoning, bit 2 xtml; byte 1: cut seed
    k2 = ("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
          "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
          "<|tool_calls_section_end|>")
    k3 = ("why<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>"
          "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>"
          "<|open|>argument key=\"x\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
          "<|close|>call<|sep|><|close|>tools<|sep|>")
    put(t, "seed-k2-call", b"\x01\x07" + k2.encode())
    put(t, "seed-k3-call", b"\x07\x03" + k3.encode())
    put(t, "seed-think", b"\x02\x05thought</think>answer")



# ---- request heads (the server's gate) ---------------------------------------------------------
def seeds_reqhead():
    t = "fuzz_server_reqhead"  # byte 0 odd: a 256-byte limit; the bytes are the whole input
    heads = {
        "get": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "post_body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                     b"Authorization: Bearer k\r\n\r\n{}",
        "pipelined": b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "http10_lf": b"\nGET /v1/models HTTP/1.0\nX-A:\t\xc3\xa9\n\n",
        "no_colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        "version": b"GET /health HTTP/2.7\r\nHost: x\r\n\r\n",
        "fold": b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\r\n  c\r\n\r\n",
        "nul": b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\x00c\r\n\r\n",
        "two_hosts": b"GET / HTTP/1.1\r\nHost: a\r\nHOST: b\r\n\r\n",
        "half": b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Len",
        "long": b"\x01GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "chunked": b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                   b"Expect: 100-continue\r\n\r\n5;e=1\r\nhello\r\nA\r\n0123456789\r\n0\r\n"
                   b"X-T: 1\r\n\r\n",
        "chunked_bad": b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"3\r\nabcdef\r\n0\r\n\r\n",
    }
    for name, data in heads.items():
        put(t, "seed-" + name, data)


if __name__ == "__main__":
    seeds_reqhead()
    seeds_toolparse()
    seeds_openai()
    seeds_safetensors()
    seeds_config()
    seeds_tok()
    for d in sorted(os.listdir(CORPUS)):
        print(d, len(os.listdir(os.path.join(CORPUS, d))), "seeds")
