"""The cu_seqlens memo: one computation per tensor object, kept exactly as long as the tensor lives."""

from __future__ import annotations

import gc
import weakref

import torch

from model_support.kernels._memo import while_alive


def test_computed_once_per_tensor_and_arguments() -> None:
    calls: list[tuple[int, bool]] = []

    @while_alive
    def index(cu: torch.Tensor, shared: bool) -> torch.Tensor:
        calls.append((id(cu), shared))
        return cu * 2

    cu = torch.tensor([0, 3, 5])
    first = index(cu, False)
    assert index(cu, False) is first and len(calls) == 1
    assert index(cu, True) is not first and len(calls) == 2
    equal = cu.clone()  # equal values, another object: computed anew (identity, not content)
    assert torch.equal(index(equal, False), first) and len(calls) == 3


def test_results_live_with_the_tensor_and_no_longer() -> None:
    @while_alive
    def index(cu: torch.Tensor) -> torch.Tensor:
        return cu + 1

    kept = torch.tensor([0, 4, 9])
    result = index(kept)
    alive = weakref.ref(result)
    del result
    for n in range(16):  # many other rows in between (fla's cache would have forgotten `kept` after four)
        index(torch.tensor([0, n]))
    gc.collect()
    assert alive() is not None and index(kept) is alive()
    del kept
    gc.collect()
    assert alive() is None


def test_a_result_holding_its_tensor_is_freed_with_it() -> None:
    """``cu.long()`` of an int64 ``cu`` is ``cu`` itself: the memo must not keep it alive through its result."""

    @while_alive
    def as_int64(cu: torch.Tensor) -> torch.Tensor:
        return cu.long()

    cu = torch.tensor([0, 2, 7])
    assert as_int64(cu) is cu
    alive = weakref.ref(cu)
    del cu
    gc.collect()
    assert alive() is None
