"""A memo of a function of a tensor, kept exactly as long as that tensor lives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

MEMO_ATTRIBUTE = "_model_support_memo"
"""The tensor attribute that holds its memoised results (a result may reference the tensor itself, as
``cu.long()`` of an int64 ``cu`` does: stored on the tensor, that cycle is collected with it)."""


def while_alive[R](fn: Callable[..., R]) -> Callable[..., R]:
    """Return ``fn(tensor, ...)`` remembering its result for as long as ``tensor`` (the same object, ``is``)
    is alive, one result per set of further arguments (which must be hashable).

    Meant for index tensors derived from ``cu_seqlens``: every GDN layer of a model gets the same
    ``cu_seqlens`` tensor in a step, so the work, and any host sync in it, happens once per step. A CUDA graph
    captured from a call reads the results at every replay, and it reads ``cu_seqlens`` too, so whoever keeps
    the graph keeps ``cu_seqlens`` and with it the results (fla's ``tensor_cache`` instead keeps its last four
    calls, and a graph whose ``cu_seqlens`` falls out of them reads freed memory). A new ``cu_seqlens`` each
    step frees the last step's results with it. Changing the tensor in place between calls is not supported
    (nor in fla).
    """

    @functools.wraps(fn)
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> R:
        memo = tensor.__dict__.setdefault(MEMO_ATTRIBUTE, {}).setdefault(wrapper, {})
        key = (args, tuple(kwargs.items()))
        if key not in memo:
            memo[key] = fn(tensor, *args, **kwargs)
        return memo[key]

    return wrapper
