"""`model-support selftest`: every injected bug is caught by its stage, and the clean runs pass."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from model_support.validation import selftest, selftest_runner
from tests.helpers import run_cli
from tests.megatron.conftest import require_megatron


@pytest.mark.slow
def test_every_injected_bug_fails_its_stage_and_the_clean_runs_pass(tmp_path):
    require_megatron()
    outcomes = selftest_runner.run_selftest(tmp_path)
    by_name = {o.name: o for o in outcomes if o.name != "clean"}
    assert len(by_name) == len(selftest.MUTATIONS) >= 10
    bad = [f"{o.name} ({o.handler}, {o.stage}): {o.status}: {o.summary}" for o in outcomes if not o.ok]
    assert not bad, bad
    for m in selftest.MUTATIONS:
        expected = {"fail", "skip"} if m.needs_server else {"fail"}
        assert by_name[m.name].status in expected, by_name[m.name]
    cleans = [o for o in outcomes if o.name == "clean"]
    assert cleans and all(o.status == "pass" for o in cleans)
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
