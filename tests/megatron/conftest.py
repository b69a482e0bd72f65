"""Fixtures of the Megatron tests: one real ``check --tiny`` run per built-in handler, shared by the session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def require_megatron() -> None:
    """Skip unless megatron-core and megatron-bridge import (megatron-bridge through model-support's glue)."""
    from model_support.core.megatron.imports import MegatronUnavailableError, import_bridge

    try:
        import_bridge()
    except MegatronUnavailableError as exc:
        pytest.skip(str(exc))


MEGATRON_STAGES = (
    "hf_parity",
    "lora_coverage",
    "lora_gradients",
    "packed_position_ids",
    "shared_prefix",
    "trainability",
)


@pytest.fixture(scope="session")
def megatron_report(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], object]:
    """``megatron_report("qwen3.5")`` -> the Report of ``check qwen3.5 --tiny`` over the Megatron stages."""
    from model_support.validation.pytest_plugin import CheckRequest, run_check

    require_megatron()
    reports: dict[str, object] = {}

    def get(handler: str) -> object:
        if handler not in reports:
            workdir: Path = tmp_path_factory.mktemp(f"check-{handler}")
            reports[handler] = run_check(CheckRequest(target=handler, tiny=True, stages=MEGATRON_STAGES), workdir)
        return reports[handler]

    return get
