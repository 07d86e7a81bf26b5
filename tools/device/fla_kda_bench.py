"""The peer for issue 9's KDA prefill target, on the GPU machine: flash-linear-attention's
chunk_kda (carried as wheels in .whl/) on the shape of bench/RESULTS.md's recurrent baseline (one
sequence of 8192 tokens, 32 heads, dk = dv = 128), f32 and bf16 inputs, initial and final state,
median of triton's do_bench. Run by tools/device/fla_kda_bench.sh.

With a directory argument it also scores accuracy on one set of inputs for both engines:
  fla_kda_bench.py gen DIR    writes the inputs (q, k, v, g [T][H][D], beta [T][H], s0 [H][D][D],
                              f32) and their float64 reference (token by token) to DIR
  (test_cuda_kernels --kda-io DIR T H D then writes deltaserve's outputs there)
  fla_kda_bench.py score DIR  times FLA on those inputs and prints each run's relative error
                              ||x - ref|| / ||ref|| of the outputs and of the final state."""
import sys

import numpy as np
import torch

T, H, D = 8192, 32, 128


def make_inputs():
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(T, H, D, device="cuda"), dim=-1) * D ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, D, device="cuda"), dim=-1)
    v = torch.randn(T, H, D, device="cuda")
    g = -torch.rand(T, H, D, device="cuda") * 0.7
    beta = torch.rand(T, H, device="cuda")
    s0 = torch.randn(H, D, D, device="cuda") * 0.5
    return q, k, v, g, beta, s0


def reference(q, k, v, g, beta, s0):
    """The recurrence token by token in float64: S <- S e^g (per key channel), then the delta
    rule S += beta k (v - k^T S)^T, and o = S^T q."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, s0))
    o = torch.empty_like(v)
    for t in range(T):
        S = S * g[t].exp()[:, :, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def rel(x, ref):
    x = torch.as_tensor(x, device=ref.device).double()
    return ((x - ref).norm() / ref.norm()).item()


def fla_run(q, k, v, g, beta, s0, dtype):
    from fla.ops.kda import chunk_kda
    args = [x.to(dtype)[None] for x in (q, k, v, g, beta)]

    def run():
        return chunk_kda(*args, scale=1.0, initial_state=s0[None], output_final_state=True)

    return run


def fla_varlen(q, k, v, g, beta, s0, n):
    """The same T tokens as n sequences of T / n (cu_seqlens), each from s0, in bf16: the varlen
    form of issue 33's benchmark (deltaserve's `bench kda chunked varlen` lines)."""
    from fla.ops.kda import chunk_kda
    args = [x.to(torch.bfloat16)[None] for x in (q, k, v, g, beta)]
    cu = torch.arange(0, T + 1, T // n, device="cuda", dtype=torch.long)
    s0n = s0[None].expand(n, H, D, D).contiguous()

    def run():
        return chunk_kda(*args, scale=1.0, initial_state=s0n, output_final_state=True,
                         cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())

    return run


def main():
    import triton
    if len(sys.argv) == 3 and sys.argv[1] == "gen":
        ins = make_inputs()
        for name, x in zip(("q", "k", "v", "g", "beta", "s0"), ins):
            x.float().cpu().numpy().tofile(f"{sys.argv[2]}/{name}.f32")
        o, S = reference(*ins)
        o.cpu().numpy().tofile(f"{sys.argv[2]}/ref_o.f64")
        S.cpu().numpy().tofile(f"{sys.argv[2]}/ref_s.f64")
        print(f"kda inputs and float64 reference written to {sys.argv[2]}")
        return
    score = sys.argv[2] if len(sys.argv) == 3 and sys.argv[1] == "score" else None
    ins = make_inputs()
    if score:
        ref_o = torch.from_numpy(np.fromfile(f"{score}/ref_o.f64")).cuda().view(T, H, D)
        ref_s = torch.from_numpy(np.fromfile(f"{score}/ref_s.f64")).cuda().view(H, D, D)
        for mode, name in ((0, "f32"), (1, "tf32"), (3, "3xtf32"), (2, "bf16"),
                           ("1p", "tf32, pass 1 f32"), ("3p", "3xtf32, pass 1 f32"),
                           ("2p", "bf16, pass 1 f32")):
            o = np.fromfile(f"{score}/out_{mode}.f32", dtype=np.float32).reshape(T, H, D)
            s = np.fromfile(f"{score}/state_{mode}.f32", dtype=np.float32).reshape(H, D, D)
            print(f"deltaserve chunked {name}: rel error out {rel(o, ref_o):.3e}, "
                  f"state {rel(s, ref_s):.3e}")
    for dtype in (torch.float32, torch.bfloat16):
        run = fla_run(*ins, dtype)
        o, s = run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        err = (f", rel error out {rel(o[0], ref_o):.3e}, state {rel(s[0], ref_s):.3e}"
               if score else "")
        print(f"fla chunk_kda T={T} H={H} dk=dv={D} {str(dtype).split('.')[-1]}: {ms:.3f} ms, "
              f"{T / (ms * 1e-3) / 1e6:.2f} M tokens/s{err}")
    for n in (8, 32):
        run = fla_varlen(*ins, n)
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        print(f"fla chunk_kda varlen {n} x {T // n} H={H} dk=dv={D} bfloat16: {ms:.3f} ms, "
              f"{T / (ms * 1e-3) / 1e6:.2f} M tokens/s")


if __name__ == "__main__":
    main()
