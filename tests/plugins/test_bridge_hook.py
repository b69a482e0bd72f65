"""model_support_megatron_bridges: a plugin's bridge registration runs once, only when Megatron is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import pip_install_target, run_cli
from tests.megatron.conftest import require_megatron

FIXTURE = Path(__file__).parent / "fixtures" / "ms-bridge"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return pip_install_target(FIXTURE, tmp_path_factory.mktemp("site"))


@pytest.mark.slow
def test_registration_runs_once_when_megatron_is_used_and_never_for_list(site, tiny_model_dir, tmp_path):
    require_megatron()
    marker = tmp_path / "calls"
    env = {"MS_BRIDGE_MARKER": str(marker)}
    listed = run_cli("list", site=site, env=env)
    assert listed.returncode == 0, listed.stderr
    assert not marker.exists()  # `list` imports no Megatron and registers nothing
    checked = run_cli("check", str(tiny_model_dir("qwen3")), "-s", "hf_parity", site=site, env=env)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert marker.read_text() == "registered, megatron.bridge imported: True\n"


@pytest.mark.slow
def test_a_failing_registration_is_a_one_line_error_naming_the_plugin(site, tiny_model_dir, tmp_path):
    require_megatron()
    env = {"MS_BRIDGE_MARKER": str(tmp_path / "calls"), "MS_BRIDGE_FAIL": "1"}
    checked = run_cli("check", str(tiny_model_dir("qwen3")), "-s", "hf_parity", site=site, env=env)
    assert checked.returncode == 1
    (line,) = [line for line in checked.stderr.splitlines() if line.startswith("  hf_parity: fail")]
    assert line.endswith(
        "plugin 'ms-bridge' failed to register its megatron-bridge bridge (RuntimeError: no bridge for this family "
        "in this megatron-bridge); fix or uninstall the plugin"
    )
