"""Tests of the {{ cookiecutter.handler_name }} handler.

The fixtures come from model-support's pytest plugin: ``model_support_stage`` is one test per
validation stage (every stage the installed plugins register), ``model_support_check`` runs a
check and fails with the stage report. `pytest --model-support-stage architecture` runs only
that stage and its prerequisites.
"""

import json
from pathlib import Path

import pytest
from model_support.core.registry import load_registry

from {{ cookiecutter.package_name }}.handler import HANDLER, REFERENCE_CONFIG

TINY_CONFIG = Path(__file__).parent / "fixtures" / "tiny-config.json"


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.get("{{ cookiecutter.handler_name }}")
    assert entry.spec == HANDLER
    assert entry.plugin.distribution == "{{ cookiecutter.project_slug }}"
    assert registry.for_architecture("{{ cookiecutter.architecture }}").spec.name == HANDLER.name


@pytest.mark.parametrize("config", [REFERENCE_CONFIG, TINY_CONFIG], ids=["reference", "tiny"])
def test_configs_name_the_claimed_architecture(config: Path):
    raw = json.loads(config.read_text())
    assert raw["architectures"][0] in HANDLER.architectures
    assert raw["model_type"] in HANDLER.model_types


@pytest.mark.model_support("{{ cookiecutter.handler_name }}", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()


def test_tiny_config_fixture_passes_the_architecture_stage(model_support_check):
    report = model_support_check(TINY_CONFIG, tiny=True, stages=["architecture"])
    assert report.handler == HANDLER.name
    assert [r.stage for r in report.results][-1] == "architecture"
