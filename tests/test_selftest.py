"""`model-support selftest`: every injected bug is caught by its stage, and the clean runs pass."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from model_support.validation import selftest, selftest_runner
from tests.helpers import run_cli
from tests.megatron.conftest import require_megatron

# One test per stage that must catch a bug: each runs that stage's mutations and its clean runs (no other stage's),
# so pytest-xdist's workers share the catalogue.
CATCHING_STAGES = sorted({m.stage for m in selftest.MUTATIONS})


@pytest.mark.slow
@pytest.mark.parametrize("stage", CATCHING_STAGES)
def test_every_injected_bug_fails_its_stage_and_the_clean_runs_pass(stage, tmp_path):
    require_megatron()
    mutations = [m for m in selftest.MUTATIONS if m.stage == stage]
    outcomes = selftest_runner.run_selftest(tmp_path, [m.name for m in mutations])
    by_name = {o.name: o for o in outcomes if o.name != "clean"}
    assert len(by_name) == len(mutations) and len(selftest.MUTATIONS) >= 10
    bad = [f"{o.name} ({o.handler}, {o.stage}): {o.status}: {o.summary}" for o in outcomes if not o.ok]
    assert not bad, bad
    for m in mutations:
        expected = {"fail", "skip"} if m.needs_server else {"fail"}
        assert by_name[m.name].status in expected, by_name[m.name]
    cleans = [o for o in outcomes if o.name == "clean"]
    # (no clean run where the stage needs a server this machine has none of: every mutation of it skipped)
    assert cleans or all(by_name[m.name].status == "skip" for m in mutations)
    assert all(o.status == "pass" and o.stage == stage for o in cleans)
    table = selftest_runner.markdown_table(outcomes)
    assert table.count("| yes |") == sum(1 for o in by_name.values() if o.status == "fail")


@pytest.mark.slow
def test_a_bug_no_stage_catches_is_reported_as_such(tmp_path, monkeypatch):
    require_megatron()
    harmless = selftest.Mutation("no-op", "nothing is wrong", "qwen3", "packed_position_ids", nullcontext)
    monkeypatch.setattr(selftest, "MUTATIONS", (harmless,))
    (clean, outcome) = selftest_runner.run_selftest(tmp_path)
    assert clean.ok and clean.status == "pass"
    assert outcome.status == "pass" and not outcome.ok
    table = selftest_runner.markdown_table([outcome])
    assert "| no-op | nothing is wrong | qwen3 | packed_position_ids | pass: " in table
    assert table.rstrip().endswith("| NO |")


def test_an_unknown_mutation_is_a_one_line_error(tmp_path):
    result = run_cli("selftest", "-m", "no-such-bug", "--workdir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown mutation(s) no-such-bug; known: ")
