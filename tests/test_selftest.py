"""`model-support selftest`: injected bugs are caught by their stages, and the clean runs pass.

The first tier runs one bug of each stage (the first the catalogue lists for it); the exhaustive tier runs the whole
catalogue, as `model-support selftest` does (docs/selftest-results.md holds its last run)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import pytest

from model_support.validation import selftest, selftest_runner
from tests.helpers import run_cli
from tests.megatron.conftest import require_megatron

# rl_trainability's planted bugs (the pushed weights sliced wrong, the weight version never set) and
# train_inference_mismatch's (the trainer's samples scored as one sequence) have their own tests with their metrics:
# tests/serving/test_rl_trainability.py, tests/serving/test_train_inference_mismatch.py.
PLANTED_ELSEWHERE = ("rl_trainability", "train_inference_mismatch")


def _first_bug_of_each_stage() -> list[selftest.Mutation]:
    first: dict[str, selftest.Mutation] = {}
    for m in selftest.MUTATIONS:
        first.setdefault(m.stage, m)
    return [m for m in first.values() if m.stage not in PLANTED_ELSEWHERE]


def _assert_caught(outcomes: Sequence[selftest_runner.Outcome], mutations: Sequence[selftest.Mutation]) -> None:
    by_name = {o.name: o for o in outcomes if o.name != "clean"}
    assert set(by_name) == {m.name for m in mutations}
    bad = [f"{o.name} ({o.handler}, {o.stage}): {o.status}: {o.summary}" for o in outcomes if not o.ok]
    assert not bad, bad
    for m in mutations:
        expected = {"fail", "skip"} if m.needs_server else {"fail"}
        assert by_name[m.name].status in expected, by_name[m.name]
    assert all(o.status == "pass" for o in outcomes if o.name == "clean")


@pytest.mark.slow
def test_a_bug_of_each_stage_fails_it_and_the_clean_runs_pass(tmp_path):
    require_megatron()
    chosen = _first_bug_of_each_stage()
    assert {m.stage for m in chosen} >= {"lora_coverage", "hf_parity", "parallel_parity", "merged_serving"}
    # A bug that needs a server runs without its stage's clean run: tests/serving/test_stages.py makes it (every
    # serving stage passes there on the same tiny qwen3), and each run here starts a server of its own.
    alone = [m for m in chosen if not m.needs_server]
    outcomes = selftest_runner.run_selftest(tmp_path / "one-process", [m.name for m in alone])
    assert sum(o.name == "clean" for o in outcomes) >= len(alone)
    _assert_caught(outcomes, alone)
    served = [m for m in chosen if m.needs_server]
    outcomes = selftest_runner.run_selftest(tmp_path / "served", [m.name for m in served], clean_runs=False)
    _assert_caught(outcomes, served)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_every_injected_bug_fails_its_stage_and_the_clean_runs_pass(tmp_path):
    require_megatron()
    outcomes = selftest_runner.run_selftest(tmp_path)
    assert len(selftest.MUTATIONS) >= 10
    _assert_caught(outcomes, selftest.MUTATIONS)
    assert any(o.name == "clean" for o in outcomes)
    table = selftest_runner.markdown_table(outcomes)
    assert table.count("| yes |") == sum(1 for o in outcomes if o.name != "clean" and o.status == "fail")


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
