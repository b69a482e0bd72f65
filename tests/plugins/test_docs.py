"""The docs: generated reference pages are current, and the guide quotes the handler it walks through."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from model_support.core.cli import app
from model_support.validation.reference_docs import (
    _parameters,
    _tolerances,
    cli_page,
    handlers_page,
    pages,
    stages_page,
)
from model_support.validation.stage import Stage

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
EXTRA_STAGE = Path(__file__).parent / "fixtures" / "ms-extra-stage"


@pytest.mark.parametrize("page", sorted(pages(app)))
def test_generated_reference_is_current(page: str):
    on_disk = (DOCS / page).read_text().splitlines()
    current = pages(app)[page]().splitlines()
    if on_disk != current:
        line = next((i for i, (a, b) in enumerate(zip(on_disk, current, strict=False)) if a != b), len(on_disk))
        pytest.fail(f"docs/{page} is stale from line {line + 1}: run `model-support docs` from the repository root")


def test_pages_cover_every_registered_stage_handler_and_command():
    from model_support.core.registry import load_registry
    from model_support.validation.stage_registry import load_stages

    registry = load_registry(env={"MODEL_SUPPORT_PLUGINS": "builtin"})
    stages = stages_page()
    for entry in load_stages(registry).stages:
        assert f"## {entry.stage.name}\n\n**Proves:** {entry.stage.title}" in stages
    handlers = handlers_page()
    for name, entry in registry.handlers.items():
        assert f"### `{name}`\n\n{entry.spec.description}" in handlers
    commands = re.findall(r"^## `model-support ([\w-]+)`$", cli_page(app), flags=re.M)
    assert commands[:5] == ["list", "show", "stages", "tiny", "check"]
    assert {"new-handler", "docs"} <= set(commands)


def test_third_party_plugins_do_not_change_the_pages(install_copy, monkeypatch: pytest.MonkeyPatch):
    before = stages_page()
    monkeypatch.syspath_prepend(str(install_copy(EXTRA_STAGE)[1]))
    assert stages_page() == before and "chat_turn" not in before


def test_declared_tolerances_are_rendered():
    class Parity(Stage):
        name = "parity"
        title = "Logits agree."
        order = 1
        thresholds: ClassVar[dict[str, float]] = {"max_abs_logit_diff": 1e-4, "mean_kl": 1e-6}
        COSINE_TOLERANCE = 0.999
        steps = 8

        def run(self, ctx):
            raise NotImplementedError

    rendered = _tolerances(Parity)
    assert "`Parity.thresholds`: max_abs_logit_diff <= 0.0001, mean_kl <= 1e-06" in rendered
    assert "`Parity.COSINE_TOLERANCE` = 0.999" in rendered
    assert _parameters(Parity) == ["`steps` = 8"]


def test_docs_check_names_a_stale_page(tmp_path: Path):
    runner = CliRunner()
    written = runner.invoke(app, ["docs", "--out", str(tmp_path)])
    assert written.exit_code == 0, written.output
    assert runner.invoke(app, ["docs", "--out", str(tmp_path), "--check"]).exit_code == 0
    (tmp_path / "stages.md").write_text("hand edited\n")
    stale = runner.invoke(app, ["docs", "--out", str(tmp_path), "--check"])
    assert stale.exit_code == 1
    assert stale.stderr.strip() == f"stale: {tmp_path / 'stages.md'}; run `model-support docs --out {tmp_path}`"


def test_the_guide_quotes_the_code_it_names_verbatim():
    """Every Python block of the guide headed by a file's path (``# handlers/qwen3_5.py``, a plugin's module) quotes
    lines that file has."""
    guide = (DOCS / "adding-a-model.md").read_text()
    blocks = re.findall(r"```python\n# ((?:handlers|plugins)/\S+\.py)\n(.*?)```", guide, flags=re.S)
    assert sum(path == "handlers/qwen3_5.py" for path, _ in blocks) >= 8
    missing = []
    for path, block in blocks:
        source = {line.strip() for line in (ROOT / path).read_text().splitlines()}
        quoted = [line.strip() for line in block.splitlines() if line.strip()]
        missing += [f"{path}: {line}" for line in quoted if line not in source]
    assert not missing, f"docs/adding-a-model.md quotes lines its files no longer have: {missing}"
