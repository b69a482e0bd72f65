"""Where the time of our chunked GDN goes on the GPU: recurrence variants and a kernel profile.

Run like ``gdn_benchmark.py`` (CUDA, project importable). Times fwd+bwd of the packed
16 x 2048 tokens, 16 heads x 128, bf16 case for the torch loop and for Triton recurrence
settings (dot precision, value block, warps), each checked against the float32 torch loop,
then prints the profiler's top CUDA kernels for the chosen setting.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gdn_benchmark import DIM, HEADS, N_SEQ, SEQ_LEN, bench, cu_from_lengths, fwd_bwd, make_inputs, rel
from model_support.kernels import _triton_recurrence, chunk_gated_delta_rule

# (dot precision, value block, warps, pipeline stages) tried in order; the last one is profiled.
SETTINGS = [("tf32x3", 32, 4, 1)]


def main() -> None:
    cu = cu_from_lengths([SEQ_LEN] * N_SEQ)
    x = make_inputs(N_SEQ * SEQ_LEN, HEADS, DIM, torch.bfloat16, seed=1, grad=True)

    def run(backend: str) -> torch.Tensor:
        return chunk_gated_delta_rule(*x, cu_seqlens=cu, use_qk_l2norm=True, backend=backend)[0]

    with torch.no_grad():
        want = run("torch-chunked").float()
    print(f"torch-chunked fwd+bwd {bench(fwd_bwd(lambda: run('torch-chunked'), list(x))):8.3f} ms", flush=True)
    for precision, block_v, warps, stages in SETTINGS:
        _triton_recurrence.DOT_PRECISION = precision
        _triton_recurrence.BLOCK_V = block_v
        _triton_recurrence.NUM_WARPS = warps
        _triton_recurrence.NUM_STAGES = stages
        with torch.no_grad():
            got = run("chunked-triton")
            torch.cuda.synchronize()
            err = rel(got, want)
            fwd = bench(lambda: run("chunked-triton"))
        both = bench(fwd_bwd(lambda: run("chunked-triton"), list(x)))
        print(
            f"{precision:7s} BV={block_v:3d} warps={warps} stages={stages}: "
            f"fwd {fwd:8.3f} fwd+bwd {both:8.3f} ms, rel err {err:.1e}"
        )

    for backend in ("torch-chunked", "chunked-triton"):
        step = fwd_bwd(lambda backend=backend: run(backend), list(x))
        step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"--- {backend} (triton setting: last above)")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
