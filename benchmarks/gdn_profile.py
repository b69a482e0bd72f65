"""Where the time of our GDN paths goes on the GPU.

Run like ``gdn_benchmark.py`` (CUDA, project importable), as ``python -m benchmarks.gdn_profile``.

Default (chunked-triton): first times the recurrence kernels by themselves for several settings
(dot precision, value block, warps) on the packed shape (16 sequences x 32 chunks) and the
shared-prompt shape (1 sequence x 32 chunks), each checked against the torch loop; then prints the
profiler's top CUDA kernels of one packed fwd+bwd (16 x 2048 tokens, 16 heads x 128, bf16).

``--prompt-phase`` (fla-hybrid): the shared-prefix step (G=8 completions of 512 tokens over a
2048-token prompt) with each launch setting of the prompt phase's state recurrence
(``_fla_hybrid.PROMPT_PHASE_CONFIG``), against naive packing: CUDA-graph replay time, summed GPU
kernel time, and the largest gradient difference from fla's autotuned setting.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gdn_benchmark import (
    DIM,
    HEADS,
    N_SEQ,
    SEQ_LEN,
    bench,
    cu_from_lengths,
    fwd_bwd,
    graphed,
    ideal_ratio,
    kernel_ms,
    make_inputs,
    rel,
    shared_prefix_steps,
)
from model_support.kernels import _triton_recurrence, chunk_gated_delta_rule
from model_support.kernels._recurrence import ChunkSchedule, _loop_backward, _loop_forward

CHUNKS_PER_SEQ = SEQ_LEN // 64
# (dot precision, value block, warps). tf32x3 with BV=16 and 8 warps is left out: with
# Triton 3.6 on the H100 it made an illegal memory access (twice), which poisons the process.
SETTINGS = [
    ("tf32x3", 16, 4),
    ("tf32x3", 32, 4),
    ("tf32x3", 32, 8),
    ("tf32x3", 64, 4),
    ("tf32x3", 64, 8),
    ("tf32x3", 128, 8),
    ("tf32", 32, 4),
    ("tf32", 64, 8),
    ("ieee", 32, 8),
]


def recurrence_sweep() -> None:
    for n_seq in (N_SEQ, 1):
        counts = [CHUNKS_PER_SEQ] * n_seq
        n = sum(counts)
        sched = ChunkSchedule.build(counts, torch.device("cuda"))
        shape = (n, HEADS, 64, DIM)
        u, w, kd = (torch.randn(shape, device="cuda") * s for s in (1.0, 0.05, 0.05))
        gamma = torch.rand(n, HEADS, device="cuda") * 0.5 + 0.5
        s0 = torch.randn(n_seq, HEADS, DIM, DIM, device="cuda")
        dd, dss = torch.randn_like(u), torch.randn(n, HEADS, DIM, DIM, device="cuda")
        dsf = torch.randn_like(s0)
        want_f = _loop_forward(u, w, kd, gamma, s0, sched)
        want_b = _loop_backward(w, kd, gamma, dd, dss, dsf, sched)
        print(f"--- recurrence alone, {n_seq} sequence(s) x {CHUNKS_PER_SEQ} chunks", flush=True)
        for precision, block_v, warps in SETTINGS:
            _triton_recurrence.DOT_PRECISION = precision
            _triton_recurrence.BLOCK_V = block_v
            _triton_recurrence.NUM_WARPS = warps
            got_f = _triton_recurrence.forward(u, w, kd, gamma, s0, sched.offsets)
            got_b = _triton_recurrence.backward(w, kd, gamma, dd, dss, dsf, sched.offsets)
            torch.cuda.synchronize()
            err = max(rel(a, b) for a, b in zip((*got_f, *got_b), (*want_f, *want_b), strict=True))
            t_f = bench(functools.partial(_triton_recurrence.forward, u, w, kd, gamma, s0, sched.offsets))
            t_b = bench(functools.partial(_triton_recurrence.backward, w, kd, gamma, dd, dss, dsf, sched.offsets))
            print(
                f"{precision:7s} BV={block_v:3d} warps={warps}: fwd {t_f:7.3f} bwd {t_b:7.3f} ms, "
                f"max rel err {err:.1e}",
                flush=True,
            )


# fla's autotuned setting first (the gradient reference), the default last as well (run-to-run drift).
PROMPT_PHASE_CONFIGS = [None, (16, 4, 3), (16, 4, 4), (16, 2, 3), (16, 2, 4), (32, 4, 3), (32, 2, 4), (16, 4, 3)]


def prompt_phase_sweep() -> None:
    from model_support.kernels import _fla_hybrid

    prompt, comp = 2048, 512
    ideal = ideal_ratio(prompt, comp)
    shared, naive = shared_prefix_steps("fla-hybrid", prompt, comp)
    naive_graph, naive_gpu = bench(graphed(naive)), kernel_ms(naive)
    print(f"naive packing: CUDA graph {naive_graph:.3f} ms, GPU kernels {naive_gpu:.3f} ms; ideal ratio {ideal:.3f}")
    reference, default = None, _fla_hybrid.PROMPT_PHASE_CONFIG
    for config in PROMPT_PHASE_CONFIGS:
        _fla_hybrid.PROMPT_PHASE_CONFIG = config
        grads = shared()
        reference = grads if reference is None else reference
        diff = max(rel(a, b) for a, b in zip(grads, reference, strict=True))
        t_graph, t_gpu = bench(graphed(shared)), kernel_ms(shared)
        print(
            f"prompt phase {config!s:13s}: CUDA graph {t_graph:.3f} ms ({t_graph / naive_graph:.3f} of naive), "
            f"GPU kernels {t_gpu:.3f} ms ({t_gpu / naive_gpu:.3f}), grad diff vs autotuned {diff:.1e}",
            flush=True,
        )
    _fla_hybrid.PROMPT_PHASE_CONFIG = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-phase", action="store_true", help="fla-hybrid prompt-phase launch settings")
    if parser.parse_args().prompt_phase:
        prompt_phase_sweep()
        return
    defaults = (_triton_recurrence.DOT_PRECISION, _triton_recurrence.BLOCK_V, _triton_recurrence.NUM_WARPS)
    recurrence_sweep()
    _triton_recurrence.DOT_PRECISION, _triton_recurrence.BLOCK_V, _triton_recurrence.NUM_WARPS = defaults

    cu = cu_from_lengths([SEQ_LEN] * N_SEQ)
    x = make_inputs(N_SEQ * SEQ_LEN, HEADS, DIM, torch.bfloat16, seed=1, grad=True)
    step = fwd_bwd(lambda: chunk_gated_delta_rule(*x, cu_seqlens=cu, use_qk_l2norm=True)[0], list(x))
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
