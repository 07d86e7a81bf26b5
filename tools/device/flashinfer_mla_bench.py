#!/usr/bin/env python3
"""On the GPU machine: FlashInfer's MLA decode (BatchMLAPagedAttentionWrapper) timed on the shape
deltaserve's absorbed decode runs (issue 33's peer for `test_cuda_kernels --bench-only mla`): one
query token, 32 heads, compressed KV rows of 512 plus 64 rope dims in BF16, one sequence of L rows
in pages of P rows. Prints one line per (L, P) with the time (median of CUDA-event timings) and the
cache bytes read per second beside a device-to-device copy measured in the same run, so the line
compares with our kernel's "bench mla absorbed decode 1 x L rows, Ha=32, bf16 rows" lines.

Usage: flashinfer_mla_bench.py [--lens 32768,131072,1048576] [--pages 16,64] [--backend auto]
(run by tools/device/flashinfer_mla.sh, which installs the carried wheels first).
"""
import argparse
import statistics
import sys

GRAPH_CALLS = 20


def timed(torch, fn, reps):
    """median ms of reps calls of fn, each between two CUDA events, after two warm-up calls"""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="32768,131072,1048576")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import torch

    try:
        import flashinfer
    except Exception as e:  # (a wheel or one of its needs missing: say which)
        print(f"flashinfer: import failed: {type(e).__name__}: {e}")
        return 1
    dev = torch.device("cuda")
    # the copy rate, bytes read + written (as test_cuda_kernels measures it)
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8,
                                                                          device=dev)
    copy_ms = timed(torch, lambda: dst.copy_(src), 10)
    copy_gbs = 2 * n / (copy_ms * 1e-3) / 1e9
    del src, dst
    print(f"flashinfer {flashinfer.__version__}, {torch.cuda.get_device_name()}: copy "
          f"{copy_gbs:.0f} GB/s")
    H, DC, DR = 32, 512, 64
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for L in (int(x) for x in a.lens.split(",")):
        for P in (int(x) for x in a.pages.split(",")):
            pages = L // P
            ckv = torch.randn(pages, P, DC, dtype=torch.bfloat16, device=dev) * 0.1
            kpe = torch.randn(pages, P, DR, dtype=torch.bfloat16, device=dev) * 0.1
            q_nope = torch.randn(1, H, DC, dtype=torch.bfloat16, device=dev) * 0.1
            q_pe = torch.randn(1, H, DR, dtype=torch.bfloat16, device=dev) * 0.1
            i32 = dict(dtype=torch.int32, device=dev)
            try:
                w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=a.backend)
                w.plan(torch.tensor([0, 1], **i32), torch.tensor([0, pages], **i32),
                       torch.arange(pages, **i32), torch.tensor([L], **i32), H, DC, DR, P,
                       False, 1.0 / (DC + DR) ** 0.5, torch.bfloat16, torch.bfloat16)
                ms = timed(torch, lambda: w.run(q_nope, q_pe, ckv, kpe), a.reps)
                # the same calls back to back, GRAPH_CALLS of them replayed from one CUDA graph:
                # no Python between the kernels, so short contexts time the kernels and not
                # the interpreter's launch gap (which the events around one call include)
                gms = None
                try:
                    out = w.run(q_nope, q_pe, ckv, kpe)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(GRAPH_CALLS):
                            out = w.run(q_nope, q_pe, ckv, kpe)
                    gms = timed(torch, g.replay, 5) / GRAPH_CALLS
                except Exception as e:  # (a form the graph cannot hold: the plain timing only)
                    print(f"flashinfer mla decode 1 x {L} rows: graph timing failed: "
                          f"{type(e).__name__}: {e}")
            except Exception as e:
                print(f"flashinfer mla decode 1 x {L} rows, pages of {P}: failed: "
                      f"{type(e).__name__}: {e}")
                continue
            bytes_read = L * (DC + DR) * 2
            for how, t in (("a call", ms), (f"graph of {GRAPH_CALLS}", gms)):
                if t is None:
                    continue
                gbs = bytes_read / (t * 1e-3) / 1e9
                print(f"flashinfer mla decode 1 x {L} rows, Ha=32, bf16 rows, pages of {P} "
                      f"({a.backend}, {how}): {t:.4f} ms, {gbs:.0f} GB/s of cache "
                      f"({100 * gbs / copy_gbs:.0f}% of copy)")
            del ckv, kpe
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
