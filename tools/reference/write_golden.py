#!/usr/bin/env python3
"""Writes a golden file (format: tools/reference/README.md, reader: tests/unit/golden_io.[ch]) from the
float64 reference model.

usage: write_golden.py --model DIR --out FILE [--num-tokens T --seed S | --token-ids 1,2,3]
                       [--quantization ptpc_fp8 [--quantization-exclude a,b]] [--kv-cache-dtype fp8]

Entries: meta.checkpoint_fnv1a64 (u64 [1]), input_ids (i32 [T]), logits (f32 [T][V]),
hidden.{i} (f32 [T][D], residual stream / AttnRes block-local P after layer i), final_hidden (f32 [T][D]).
With --quantization or --kv-cache-dtype also: meta.quantization (u64 [1]: 0 none, 1 ptpc_fp8),
meta.quantization_exclude (i32 [n]: the UTF-8 bytes of the comma-joined exclusion list in force; only
with ptpc_fp8) and meta.kv_cache_dtype (u64 [1]: 0 the default f32 rows, 1 fp8).
Token ids are drawn uniformly from [0, vocab_size) with numpy.random.default_rng(seed).integers.
With --min-margin M they are drawn one at a time from the same generator, and a draw is rejected (the
next one tried) when the token, after the accepted ones, puts a value within a relative M of a rounding
boundary: an E4M3 code of a ptpc_fp8 activation or an FP8 latent, a BF16 kR, or a router top-k choice
(quant.py, "Rounding margins"); the golden then records meta.min_margin (f64 [1]).
"""
import argparse
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MAGIC = b"DSGOLDEN"
VERSION = 1
DTYPES = {np.dtype("<f4"): 0, np.dtype("<i4"): 1, np.dtype("<f8"): 2, np.dtype("<u8"): 3}


def write_golden(path: str, entries: list):
    """entries: list of (name, numpy array); arrays are converted to little endian of their dtype."""
    names = set()
    with open(path + ".tmp", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<II", VERSION, len(entries)))
        for name, arr in entries:
            if name in names:
                raise ValueError(f"duplicate entry {name}")
            names.add(name)
            arr = np.ascontiguousarray(arr)
            dt = arr.dtype.newbyteorder("<")
            if dt not in DTYPES:
                raise TypeError(f"{name}: dtype {arr.dtype} not in f32/i32/f64/u64")
            arr = arr.astype(dt, copy=False)
            nb = name.encode("utf-8")
            f.write(struct.pack("<H", len(nb)))
            f.write(nb)
            f.write(struct.pack("<BB", DTYPES[dt], arr.ndim))
            f.write(struct.pack("<%dQ" % arr.ndim, *arr.shape))
            f.write(arr.tobytes(order="C"))
    os.replace(path + ".tmp", path)


def read_golden(path: str) -> dict:
    """Python reader (used by check_upstream.py and for spot checks)."""
    inv = {v: k for k, v in DTYPES.items()}
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != MAGIC:
        raise ValueError("bad magic")
    ver, n = struct.unpack_from("<II", data, 8)
    if ver != VERSION:
        raise ValueError(f"version {ver}")
    off = 16
    for _ in range(n):
        (ln,) = struct.unpack_from("<H", data, off)
        off += 2
        name = data[off: off + ln].decode()
        off += ln
        dt, nd = struct.unpack_from("<BB", data, off)
        off += 2
        dims = struct.unpack_from("<%dQ" % nd, data, off)
        off += 8 * nd
        cnt = int(np.prod(dims)) if nd else 1
        arr = np.frombuffer(data, dtype=inv[dt], count=cnt, offset=off).reshape(dims)
        off += cnt * inv[dt].itemsize
        out[name] = arr
    if off != len(data):
        raise ValueError("trailing bytes")
    return out


def draw_with_margin(ref, V: int, T: int, seed: int, min_margin: float, max_tries: int = 1000):
    """T token ids from default_rng(seed), one at a time, each kept only when its forward step (after the
    ids kept so far) stays min_margin away from every rounding boundary (quant.MARGIN)."""
    import quant
    rng = np.random.default_rng(seed)
    ids, state, tried = [], None, 0
    quant.MARGIN["on"] = True
    try:
        for t in range(T):
            for _ in range(max_tries):
                tok = int(rng.integers(0, V))
                tried += 1
                quant.MARGIN.update(min=float("inf"), where="")
                out = ref.forward([tok], state=state, n_past=t)
                if quant.MARGIN["min"] >= min_margin:
                    break
            else:
                sys.exit(f"position {t}: no token in {max_tries} draws keeps a margin of {min_margin:g}")
            ids.append(tok)
            state = out.state
    finally:
        quant.MARGIN["on"] = False
    print(f"--min-margin {min_margin:g}: kept {T} of {tried} draws")
    return np.array(ids, dtype=np.int64)


def meta_entries(ref, a) -> list:
    """The configuration the golden was computed in, for the C test to run the same one (none for the
    default configuration, so the goldens written before these flags stay as they are)."""
    if a.quantization == "none" and a.kv_cache_dtype == "auto":
        return []
    out = [("meta.quantization", np.array([1 if ref.quantization == "ptpc_fp8" else 0], dtype=np.uint64))]
    if ref.quantization == "ptpc_fp8":
        excl = ",".join(ref.quantization_exclude).encode("utf-8")
        out.append(("meta.quantization_exclude", np.frombuffer(excl, dtype=np.uint8).astype(np.int32)))
    out.append(("meta.kv_cache_dtype", np.array([1 if ref.kv_cache_dtype == "fp8" else 0], dtype=np.uint64)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-tokens", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--token-ids", default=None, help="comma-separated ids (overrides --num-tokens/--seed)")
    ap.add_argument("--check-incremental", action="store_true",
                    help="also run prefill-then-decode and assert it matches the full forward")
    ap.add_argument("--quantization", choices=["none", "ptpc_fp8"], default="none",
                    help="docs/quantization.md §3 (ptpc_fp8: every matrix in scope quantized at load)")
    ap.add_argument("--quantization-exclude", default=None,
                    help="comma-separated name fragments replacing the default exclusion list")
    ap.add_argument("--min-margin", type=float, default=0.0,
                    help="draw only tokens whose rounding decisions are at least this far from a boundary")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="docs/quantization.md §4 (fp8: the MLA latent rows stored as E4M3 + BF16)")
    a = ap.parse_args()

    import torch
    from model import ReferenceModel, checkpoint_fnv1a64

    if a.quantization_exclude is not None and a.quantization != "ptpc_fp8":
        sys.exit("--quantization-exclude needs --quantization ptpc_fp8")
    excl = None if a.quantization_exclude is None else a.quantization_exclude.split(",")
    ref = ReferenceModel.from_dir(a.model, quantization=a.quantization, quantization_exclude=excl,
                                  kv_cache_dtype=a.kv_cache_dtype)
    unused = ref.w.unused()
    if unused:
        sys.exit(f"checkpoint has tensors the reference does not use (misnamed?): {unused[:10]}")
    V = ref.cfg.vocab_size
    if a.token_ids:
        ids = np.array([int(x) for x in a.token_ids.split(",") if x.strip()], dtype=np.int64)
    elif a.min_margin > 0:
        with torch.no_grad():
            ids = draw_with_margin(ref, V, a.num_tokens, a.seed, a.min_margin)
    else:
        ids = np.random.default_rng(a.seed).integers(0, V, size=a.num_tokens)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= V:
        sys.exit("token ids must be non-empty and in [0, vocab_size)")
    import quant
    with torch.no_grad():
        quant.MARGIN.update(on=True, min=float("inf"), where="")
        out = ref.forward(ids)
        quant.MARGIN["on"] = False
        print(f"smallest rounding margin in the full forward: {quant.MARGIN['min']:.3g} ({quant.MARGIN['where']})")
        if a.check_incremental:
            inc = ref.forward_incremental(ids, chunks=[max(1, len(ids) // 2), 1, 3, 1])
            err = ((inc.logits - out.logits).abs().max() / out.logits.abs().max()).item()
            print(f"incremental vs full: max rel err {err:.3e}")
            if err > 1e-10:
                sys.exit("incremental != full")
    entries = [("meta.checkpoint_fnv1a64", np.array([checkpoint_fnv1a64(a.model)], dtype=np.uint64)),
               ("input_ids", ids.astype(np.int32)),
               *meta_entries(ref, a),
               *([("meta.min_margin", np.array([a.min_margin], dtype=np.float64))] if a.min_margin > 0 else []),
               ("logits", out.logits.numpy().astype(np.float32))]
    for i, h in enumerate(out.hidden):
        entries.append((f"hidden.{i}", h.numpy().astype(np.float32)))
    entries.append(("final_hidden", out.final_hidden.numpy().astype(np.float32)))
    write_golden(a.out, entries)
    if ref.quantization:
        print(f"ptpc_fp8: {len(ref.w.quantized)} matrices quantized; exclusion list {ref.quantization_exclude}")
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes): T={len(ids)} V={V} L={ref.cfg.num_hidden_layers} "
          f"fnv1a64={entries[0][1][0]:#018x}")


if __name__ == "__main__":
    main()
