"""The peer for issue 9's KDA prefill target, timed on the GPU machine: flash-linear-attention's
chunk_kda (carried as wheels in .whl/) on the shape of bench/RESULTS.md's recurrent baseline
(one sequence of 8192 tokens, 32 heads, dk = dv = 128), f32 and bf16 inputs, initial and final
state, median of triton's do_bench. Run by tools/device/fla_kda_bench.sh."""
import torch
import triton
from fla.ops.kda import chunk_kda

T, H, D = 8192, 32, 128
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    q = torch.nn.functional.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1) * D ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1)
    v = torch.randn(1, T, H, D, device="cuda")
    g = -torch.rand(1, T, H, D, device="cuda") * 0.7
    beta = torch.rand(1, T, H, device="cuda")
    s0 = torch.randn(1, H, D, D, device="cuda") * 0.5
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))

    def run():
        return chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                         output_final_state=True)

    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
    print(f"fla chunk_kda T={T} H={H} dk=dv={D} {str(dtype).split('.')[-1]}: {ms:.3f} ms, "
          f"{T / (ms * 1e-3) / 1e6:.2f} M tokens/s")
