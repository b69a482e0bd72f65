"""GPU benchmark of the packed and shared-prefix Gated DeltaNet paths (issue 5).

Run on a CUDA machine with the project importable (``pip install -e .[gdn]``) and
transformers' qwen3_next torch reference available::

    python benchmarks/gdn_benchmark.py --out results.json

It first checks correctness on the GPU (fla-hybrid, chunked-triton and torch-chunked forward
and gradients, fla's forward) against the float64 token recurrence (``--correctness-only``
stops there), then times, in one process:

* packed: 16 sequences x 2048 tokens, 16 heads x 128, bf16 — our fwd+bwd vs fla fwd-only
  and vs transformers' ``torch_chunk_gated_delta_rule`` (batched: all lengths are equal,
  which is the reference's most favourable case). Newer transformers route that function to
  fla when fla is importable, so the reference is timed in a child process that cannot
  import fla (``--reference-only``);
* shared prefix: G=8 completions of C=512 tokens over a P=2048 prompt (``--shared-sizes``), fwd+bwd, shared vs
  naive packing (G rows of P + C), against the ideal ratio (P + G*C) / (G*(P + C)).

Each time is the median of ``triton.testing.do_bench``; ratios come from this one run. The
shared-prefix steps are timed as issued from Python, as CUDA-graph replays (fla-hybrid: its
kernels only, without Python's launch overhead) and as the GPU kernel time summed by the
profiler (``--kernel-table`` prints the kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from model_support.kernels import (
    GDNInputs,
    chunk_gated_delta_rule,
    packed_shared_prefix_gated_delta_rule,
    select_backend,
    shared_prefix_gated_delta_rule,
)
from model_support.kernels.reference import recurrent_gated_delta_rule

DEVICE = torch.device("cuda")


def make_inputs(total: int, heads: int, dim: int, dtype: torch.dtype, seed: int, grad: bool) -> GDNInputs:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32)

    q, k, v = randn(1, total, heads, dim), randn(1, total, heads, dim), randn(1, total, heads, dim)
    g = F.logsigmoid(randn(1, total, heads) + 4.0)
    beta = torch.rand(1, total, heads, generator=gen, device=DEVICE)
    return GDNInputs(*(x.to(dtype).requires_grad_(grad) for x in (q, k, v, g, beta)))


def cu_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def note(errors: dict[str, float], key: str, value: float) -> None:
    """Keep one error and print it at once."""
    errors[key] = value
    print(f"  {key:50s} {value:.2e}", flush=True)


def correctness(backends: list[str]) -> dict[str, float]:
    """Relative errors on the GPU against the float64 recurrence (ragged lengths, l2norm on); every
    float32 check first (shared prefix included), then bfloat16."""
    lengths = [1, 64, 300, 700]
    cu = cu_from_lengths(lengths)
    x64 = make_inputs(sum(lengths), 4, 128, torch.float64, seed=0, grad=True)
    ref_o, ref_s = recurrent_gated_delta_rule(*x64, cu_seqlens=cu, use_qk_l2norm=True)
    weight = torch.randn_like(ref_o)
    ref_grads = torch.autograd.grad((ref_o * weight).sum() + ref_s.sum(), x64)
    errors: dict[str, float] = {}

    def packed(backend: str, dtype: torch.dtype) -> None:
        start = time.perf_counter()
        tag = f"{backend} {'fp32' if dtype == torch.float32 else 'bf16'}"
        xd = GDNInputs(*(x.detach().to(dtype).requires_grad_() for x in x64))
        o, s = chunk_gated_delta_rule(*xd, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True, backend=backend)
        grads = torch.autograd.grad((o.float() * weight.float()).sum() + s.sum(), xd)
        note(errors, f"{tag} output", rel(o, ref_o))
        note(errors, f"{tag} final state", rel(s, ref_s))
        for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, ref_grads, strict=True):
            note(errors, f"{tag} grad {name}", rel(a, b))
        print(f"  ({tag}: {time.perf_counter() - start:.0f} s, compilation included)", flush=True)

    for backend in backends:
        packed(backend, torch.float32)
    for backend in backends:
        shared_prefix_gradients(errors, backend)
    for backend in backends:
        if backend != "torch-chunked":
            packed(backend, torch.bfloat16)
    with torch.no_grad():
        xb = GDNInputs(*(x.detach().bfloat16() for x in x64))
        o_fla, _ = chunk_gated_delta_rule(*xb, cu_seqlens=cu, use_qk_l2norm=True, backend="fla")
    note(errors, "fla bf16 forward output", rel(o_fla, ref_o))

    if "chunked-triton" not in backends:
        return errors
    # Shared prefix: our one-pass path against fla's two calls (bf16, forward).
    with torch.no_grad():
        prefix = make_inputs(300, 4, 128, torch.bfloat16, seed=4, grad=False)
        completions = make_inputs(200, 4, 128, torch.bfloat16, seed=5, grad=False)
        comp_cu = cu_from_lengths([1, 64, 135])
        ours = shared_prefix_gated_delta_rule(
            prefix, completions, comp_cu, use_qk_l2norm=True, backend="chunked-triton"
        )
        theirs = shared_prefix_gated_delta_rule(prefix, completions, comp_cu, use_qk_l2norm=True, backend="fla")
    note(errors, "shared prefix: chunked-triton vs fla (bf16)", rel(torch.cat(ours[:2], 1), torch.cat(theirs[:2], 1)))
    return errors


def shared_prefix_gradients(errors: dict[str, float], backend: str) -> None:
    """Shared prefix (fp32 inputs) against the float64 recurrence of the unshared rows, gradients included."""
    prompt, lengths = 300, [1, 64, 135]
    prefix = make_inputs(prompt, 4, 128, torch.float64, seed=6, grad=True)
    completions = make_inputs(sum(lengths), 4, 128, torch.float64, seed=7, grad=True)
    ends = cu_from_lengths(lengths).tolist()
    bounds = list(itertools.pairwise(ends))
    # Row i = prompt + completion i, built from the same leaves so autograd sums the prompt's gradients.
    rows = [
        torch.cat([part for a, b in bounds for part in (p, c[:, a:b])], dim=1)
        for p, c in zip(prefix, completions, strict=True)
    ]
    row_cu = cu_from_lengths([prompt + n for n in lengths])
    ref, _ = recurrent_gated_delta_rule(*rows, cu_seqlens=row_cu, use_qk_l2norm=True)
    ref_prefix = ref[:, :prompt]  # every row starts with the same prompt outputs: weight row 0's
    ref_completions = torch.cat([ref[:, start + prompt : end] for start, end in itertools.pairwise(row_cu.tolist())], 1)
    w_prefix, w_completions = torch.randn_like(ref_prefix), torch.randn_like(ref_completions)
    leaves = [*prefix, *completions]
    ref_loss = (ref_prefix * w_prefix).sum() + (ref_completions * w_completions).sum()
    ref_grads = torch.autograd.grad(ref_loss, leaves)

    ours = [x.detach().float().requires_grad_() for x in leaves]
    out = shared_prefix_gated_delta_rule(
        GDNInputs(*ours[:5]), GDNInputs(*ours[5:]), cu_from_lengths(lengths), use_qk_l2norm=True, backend=backend
    )
    loss = (out.prefix * w_prefix.float()).sum() + (out.completions * w_completions.float()).sum()
    grads = torch.autograd.grad(loss, ours)
    tag = f"{backend} fp32 shared prefix"
    note(errors, f"{tag} prompt output", rel(out.prefix, ref_prefix))
    note(errors, f"{tag} completion outputs", rel(out.completions, ref_completions))
    for part, offset in (("prompt", 0), ("completions", 5)):
        for i, name in enumerate(("q", "k", "v", "g", "beta")):
            note(errors, f"{tag} {part} grad {name}", rel(grads[offset + i], ref_grads[offset + i]))


Step = Callable[[], tuple[torch.Tensor, ...] | None]


def fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Step:
    """One forward and backward of ``fn``; returns the gradients of ``leaves`` (upstream gradient 1)."""

    def run() -> tuple[torch.Tensor, ...]:
        out = fn()
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    return run


def bench(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=100, rep=500, return_mode="median"))


def record(times: dict[str, float], key: str, ms: float) -> None:
    """Keep one time and print it at once (a run cut short still shows what it measured)."""
    times[key] = ms
    print(f"  {key:50s} {ms:9.3f} ms", flush=True)


def kernel_ms(fn: Callable[[], object], repeats: int = 5, print_table: bool = False) -> float:
    """Summed GPU kernel time of one call (profiler), without the host's share of the wall time;
    ``print_table``: also print the kernels, most time first (totals over ``repeats`` calls)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    if print_table:
        print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70), flush=True)
    return sum(e.self_device_time_total for e in events) / 1000.0 / repeats


N_SEQ, SEQ_LEN, HEADS, DIM = 16, 2048, 16, 128


def reference_times() -> dict[str, float]:
    """Time transformers' torch reference; only in a process where fla cannot be imported."""
    if importlib.util.find_spec("fla") is not None:
        raise RuntimeError("fla is importable: transformers would route its torch reference to fla")
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    x = make_inputs(N_SEQ * SEQ_LEN, HEADS, DIM, torch.bfloat16, seed=1, grad=True)
    batched = [t.detach().reshape(N_SEQ, SEQ_LEN, *t.shape[2:]).requires_grad_() for t in x]

    def reference() -> torch.Tensor:
        return torch_chunk_gated_delta_rule(*batched, use_qk_l2norm_in_kernel=True)[0]

    with torch.no_grad():
        fwd = bench(reference)
    return {"reference fwd": fwd, "reference fwd+bwd": bench(fwd_bwd(reference, batched))}


def reference_times_in_child() -> dict[str, float]:
    """Run ``--reference-only`` with fla's install folder removed from PYTHONPATH."""
    import fla

    fla_root = str(Path(fla.__file__).resolve().parents[1])
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and str(Path(p).resolve()) != fla_root]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, __file__, "--reference-only"], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"reference child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def packed_benchmark(times: dict[str, float], notes: dict[str, str], backends: list[str]) -> None:
    n_seq, seq_len, heads, dim = N_SEQ, SEQ_LEN, HEADS, DIM
    cu = cu_from_lengths([seq_len] * n_seq)
    x = make_inputs(n_seq * seq_len, heads, dim, torch.bfloat16, seed=1, grad=True)
    leaves = list(x)

    def ours(backend: str) -> Callable[[], torch.Tensor]:
        return lambda: chunk_gated_delta_rule(*x, cu_seqlens=cu, use_qk_l2norm=True, backend=backend)[0]

    with torch.no_grad():
        record(times, "fla fwd", bench(ours("fla")))
        for backend in backends:
            record(times, f"{backend} fwd", bench(ours(backend)))
    for backend in backends:
        record(times, f"{backend} fwd+bwd", bench(fwd_bwd(ours(backend), leaves)))
        record(times, f"{backend} fwd+bwd, GPU kernels only", kernel_ms(fwd_bwd(ours(backend), leaves)))
    if "chunked-triton" in backends:
        torch.backends.cuda.matmul.allow_tf32 = True
        record(times, "chunked-triton fwd+bwd (tf32 matmuls)", bench(fwd_bwd(ours("chunked-triton"), leaves)))
        torch.backends.cuda.matmul.allow_tf32 = False
    # What fla itself does when asked for a backward here (our policy never asks it).
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    def fla_direct() -> torch.Tensor:
        return fla_chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())[0]

    try:
        fwd_bwd(fla_direct, leaves)()
        notes["fla fwd+bwd"] = "ran"
    except RuntimeError as err:
        notes["fla fwd+bwd"] = f"RuntimeError: {err}"


SHARED_G = 8


def ideal_ratio(prompt: int, comp: int) -> float:
    """Shared / naive token count, (P + G*C) / (G*(P + C)): the best time ratio sharing can give."""
    return (prompt + SHARED_G * comp) / (SHARED_G * (prompt + comp))


def shared_prefix_steps(backend: str, prompt: int = 2048, comp: int = 512) -> tuple[Step, Step]:
    """One fwd+bwd step of G completions over one prompt: (shared prefix, naive packing of G rows).

    Both take one packed row, as a model layer would: ``[prompt, completion 1, ..., completion G]``
    for the shared prefix, ``[prompt, completion 1, ..., prompt, completion G]`` for naive packing.
    """
    n_comp = SHARED_G
    shared_row = make_inputs(prompt + n_comp * comp, HEADS, DIM, torch.bfloat16, seed=2, grad=True)
    shared_cu = cu_from_lengths([prompt] + [comp] * n_comp)
    naive_row = GDNInputs(
        *(
            torch.cat([torch.cat([x[:, :prompt], x[:, prompt + i * comp :][:, :comp]], 1) for i in range(n_comp)], 1)
            .detach()
            .requires_grad_()
            for x in shared_row
        )
    )
    naive_cu = cu_from_lengths([prompt + comp] * n_comp)

    def shared() -> torch.Tensor:
        return packed_shared_prefix_gated_delta_rule(*shared_row, shared_cu, use_qk_l2norm=True, backend=backend)[0]

    def naive() -> torch.Tensor:
        return chunk_gated_delta_rule(*naive_row, cu_seqlens=naive_cu, use_qk_l2norm=True, backend=backend)[0]

    return fwd_bwd(shared, list(shared_row)), fwd_bwd(naive, list(naive_row))


def graphed(step: Step) -> Step:
    """``step`` captured in a CUDA graph (after warm-up on a side stream): its replay issues every
    kernel at once, so timing it measures the GPU's work without the host's launch overhead."""
    stream = torch.cuda.Stream(DEVICE)
    stream.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream(DEVICE).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def shared_prefix_benchmark(
    times: dict[str, float], backend: str, prompt: int, comp: int, kernel_table: bool
) -> dict[str, float]:
    """Shared-prefix / naive-packing fwd+bwd time ratios for G completions over one prompt: on the
    wall clock, in summed GPU kernel time and (fla-hybrid, which never syncs with the host inside a
    step) as CUDA-graph replays."""
    shared, naive = shared_prefix_steps(backend, prompt, comp)
    ratios: dict[str, float] = {}
    cases = {"": (shared, naive)}
    if backend == "fla-hybrid":
        cases[", CUDA graph"] = (graphed(shared), graphed(naive))
    for suffix, (shared_step, naive_step) in cases.items():
        shared_key = f"{backend} shared-prefix fwd+bwd{suffix}"
        naive_key = f"{backend} naive packing fwd+bwd{suffix}"
        record(times, shared_key, bench(shared_step))
        record(times, naive_key, bench(naive_step))
        ratios[f"{backend} shared / naive fwd+bwd time{suffix}"] = times[shared_key] / times[naive_key]
    for key, step in (("shared-prefix", shared), ("naive packing", naive)):
        record(times, f"{backend} {key} fwd+bwd, GPU kernels only", kernel_ms(step, print_table=kernel_table))
    ratios[f"{backend} shared / naive GPU kernel time"] = (
        times[f"{backend} shared-prefix fwd+bwd, GPU kernels only"]
        / times[f"{backend} naive packing fwd+bwd, GPU kernels only"]
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write all numbers as JSON here")
    parser.add_argument("--reference-only", action="store_true", help="time the torch reference, print JSON")
    parser.add_argument(
        "--correctness-only", action="store_true", help="check every path against float64, time nothing"
    )
    parser.add_argument(
        "--timings-only", action="store_true", help="skip the correctness checks (their compilation takes minutes)"
    )
    parser.add_argument(
        "--shared-sizes", default="2048,512", help="prompt and completion lengths P,C of the shared-prefix case"
    )
    parser.add_argument(
        "--kernel-table", action="store_true", help="print the GPU kernels of the shared-prefix and naive steps"
    )
    parser.add_argument(
        "--backends",
        default="fla-hybrid,chunked-triton,torch-chunked",
        help="comma-separated backends to check and time (fla's forward and the reference always run)",
    )
    args = parser.parse_args()
    if args.reference_only:
        print(json.dumps(reference_times()))
        return
    backends = args.backends.split(",")

    import fla

    choice = select_backend(DEVICE)
    info = {
        "gpu": torch.cuda.get_device_name(DEVICE),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla.__version__,
        "python": platform.python_version(),
        "selected backend": f"{choice.name}: {choice.reason}",
    }
    for key, value in info.items():
        print(f"{key}: {value}", flush=True)

    if not args.timings_only:
        print("\ncorrectness (relative L2 error vs float64 recurrence):", flush=True)
    errors = {} if args.timings_only else correctness(backends)
    if args.correctness_only:
        return

    times: dict[str, float] = {}
    notes: dict[str, str] = {}
    times.update(reference_times_in_child())
    print(f"reference timed in a child without fla: {times}", flush=True)
    packed_benchmark(times, notes, backends)
    prompt, comp = (int(n) for n in args.shared_sizes.split(","))
    shared = {}
    for backend in backends:
        if backend in ("fla-hybrid", "chunked-triton"):
            shared.update(shared_prefix_benchmark(times, backend, prompt, comp, args.kernel_table))
    ideal = ideal_ratio(prompt, comp)

    ratios = {"ideal shared / naive": ideal}
    for backend in backends:
        ratios[f"reference fwd+bwd / {backend} fwd+bwd"] = times["reference fwd+bwd"] / times[f"{backend} fwd+bwd"]
        ratios[f"{backend} fwd+bwd / fla fwd"] = times[f"{backend} fwd+bwd"] / times["fla fwd"]
        ratios[f"{backend} fwd+bwd eager / its GPU kernel time"] = (
            times[f"{backend} fwd+bwd"] / times[f"{backend} fwd+bwd, GPU kernels only"]
        )
        ratios[f"{backend} fwd / fla fwd"] = times[f"{backend} fwd"] / times["fla fwd"]
        ratios[f"reference fwd / {backend} fwd"] = times["reference fwd"] / times[f"{backend} fwd"]
    if "chunked-triton" in backends:
        ratios["reference fwd+bwd / chunked-triton fwd+bwd (tf32)"] = (
            times["reference fwd+bwd"] / times["chunked-triton fwd+bwd (tf32 matmuls)"]
        )
    for key, ratio in shared.items():
        ratios[key] = ratio
        ratios[f"{key}, over ideal"] = ratio / ideal
    print("\ntimes (ms, median):")
    for key, value in times.items():
        print(f"  {key:40s} {value:9.3f}")
    print("\nratios:")
    for key, value in ratios.items():
        print(f"  {key:50s} {value:7.3f}")
    for key, value in notes.items():
        print(f"{key}: {value}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"info": info, "errors": errors, "times_ms": times, "ratios": ratios, "notes": notes}, fh, indent=2
            )


if __name__ == "__main__":
    main()
