"""The run state (validation/state.py): resources built on first use, declarations held, who built what."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from model_support.core.layout import ModelLayout
from model_support.core.registry import load_registry
from model_support.validation.context import CheckContext
from model_support.validation.runner import plan, run_checks
from model_support.validation.stage import Stage, StageResult
from model_support.validation.state import MissingResourceError, Resource, UndeclaredResourceError, closure

BUILDS: list[str] = []
STOPPED: list[str] = []


def _build(name: str, value: Any = None) -> Any:
    def build(ctx: CheckContext) -> Any:
        BUILDS.append(name)
        return value if value is not None else f"{name} of {ctx.target}"

    return build


BASE: Resource[str] = Resource("base", "built from nothing", _build("base"), stop=lambda v: STOPPED.append(v))
DERIVED: Resource[str] = Resource(
    "derived", "built from base", lambda ctx: ctx.state.get(BASE) + " +1", uses=(BASE,), stop=STOPPED.append
)
GREEDY: Resource[str] = Resource("greedy", "its builder reads base, undeclared", lambda ctx: ctx.state.get(BASE))
MADE: Resource[int] = Resource("made", "only a stage provides it")
UNUSED: Resource[str] = Resource("unused", "declared, never read", _build("unused"))


@pytest.fixture(autouse=True)
def _fresh() -> None:
    BUILDS.clear()
    STOPPED.clear()


@pytest.fixture
def ctx(tmp_path: Path) -> CheckContext:
    registry = load_registry(env={})
    layout = ModelLayout(num_layers=2, layer_types=("full_attention",) * 2, moe=None, mtp_layers=0)
    return CheckContext("tiny", tmp_path, registry.get("qwen3"), None, layout, registry, tmp_path)


class Maker(Stage):
    name = "maker"
    title = "Provides made, reads derived."
    order = 1
    needs = (DERIVED, UNUSED)
    provides = (MADE,)

    def run(self, ctx: CheckContext) -> StageResult:
        ctx.state.set(MADE, len(ctx.state.get(DERIVED)))
        return self.passed("made")


class Reader(Stage):
    name = "reader"
    title = "Reads made and base."
    order = 2
    requires = ("maker",)
    needs = (MADE, BASE)

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed(f"made={ctx.state.find(MADE)} base={ctx.state.get(BASE)}")


class Sneaky(Stage):
    """Reads a resource it does not declare: the planted bug the declarations catch."""

    name = "sneaky"
    title = "Reads base without declaring it."
    order = 3
    needs = (MADE,)

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed(ctx.state.get(BASE))


class Forger(Stage):
    name = "forger"
    title = "Writes made, which it only reads."
    order = 3
    needs = (MADE,)

    def run(self, ctx: CheckContext) -> StageResult:
        ctx.state.set(MADE, 0)
        return self.passed("forged")


class Greedy(Stage):
    name = "greedy"
    title = "Needs a resource whose builder reads more than it declares."
    order = 3
    needs = (GREEDY,)

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed(ctx.state.get(GREEDY))


def test_a_resource_is_built_once_by_the_stage_that_first_reads_it(ctx: CheckContext) -> None:
    report = run_checks(ctx, plan([Maker, Reader]))
    maker, reader = report.results
    assert [maker.status.value, reader.status.value] == ["pass", "pass"]
    assert reader.summary == f"made={len('base of tiny +1')} base=base of tiny"
    assert BUILDS == ["base"]  # derived's builder read base; the reader found it built; unused never read
    assert set(maker.built) == {"base", "derived", "made"} and reader.built == {}
    assert maker.built["made"]["provided"] is True and maker.built["derived"]["provided"] is False
    assert {o["phase"] for o in maker.built.values()} == {"run"}
    # The run stopped what has a stop, the newest first.
    assert STOPPED == ["base of tiny +1", "base of tiny"]


def test_an_undeclared_read_fails_the_stage_naming_the_declaration(ctx: CheckContext) -> None:
    (result,) = run_checks(ctx, plan([Sneaky])).results
    assert result.status.value == "fail"
    assert result.summary == "stage sneaky used base, which it does not declare: add it to Sneaky.needs"
    assert BUILDS == []  # refused before anything was built


def test_a_write_of_a_resource_a_stage_only_reads_fails(ctx: CheckContext) -> None:
    (result,) = run_checks(ctx, plan([Forger])).results
    assert result.summary == "stage forger used made, which it does not declare: add it to Forger.provides"


def test_a_builder_reading_what_it_does_not_declare_fails(ctx: CheckContext) -> None:
    (result,) = run_checks(ctx, plan([Greedy])).results
    assert result.summary == "building greedy used base, which it does not declare: add it to greedy's uses"


def test_find_does_not_build_and_a_provided_only_resource_is_missing_until_provided(ctx: CheckContext) -> None:
    assert ctx.state.find(BASE) is None and BUILDS == []
    with pytest.raises(MissingResourceError, match=r"^made is not available: no stage that provides it has run"):
        ctx.state.get(MADE)
    with ctx.state.acting(Sneaky, "run"), pytest.raises(UndeclaredResourceError):
        ctx.state.find(BASE)  # finding is reading: held to the declarations too
    assert ctx.state.get(BASE) == "base of tiny" and ctx.state.origins[BASE].stage is None
    ctx.state.drop(BASE)
    assert STOPPED == ["base of tiny"] and ctx.state.find(BASE) is None
    assert ctx.state.origins[BASE].stage is None  # the record of who built it stays


def test_a_stage_run_alone_builds_what_it_reads_and_says_its_prerequisites_did_not_run(ctx: CheckContext) -> None:
    assert [s.name for s in plan([Maker, Reader], ["reader"])] == ["maker", "reader"]
    alone = plan([Maker, Reader], ["reader"], alone=True)
    assert [s.name for s in alone] == ["reader"]
    (result,) = run_checks(ctx, alone).results
    assert result.status.value == "pass" and result.summary == "made=None base=base of tiny"
    assert result.details == ["run alone: prerequisite stage(s) maker not run"]
    assert list(result.built) == ["base"] and BUILDS == ["base"]


def test_closure_lists_each_resource_after_what_its_builder_uses() -> None:
    assert closure((DERIVED, MADE, BASE)) == [BASE, DERIVED, MADE]


def test_every_builtin_stage_declares_resources_whose_builders_declare_theirs() -> None:
    """The built-in declarations are resources (a misspelt import fails at import), and each resource's ``uses`` is
    built or provided by someone: nothing a stage needs is unreachable."""
    from model_support.validation.stage_registry import load_stages

    stages = load_stages(load_registry(env={})).classes()
    declared = closure(tuple(r for s in stages for r in (*s.needs, *s.provides)))
    assert {r.name for r in declared} >= {"training_model", "lora", "server", "trained_adapter", "tokenizer"}
    provided = {r for s in stages for r in s.provides}
    unreachable = [r.name for r in declared if r.build is None and r not in provided]
    assert unreachable == []


def test_a_value_that_fails_to_stop_does_not_keep_the_others_running(ctx: CheckContext) -> None:
    def refuse(value: str) -> None:
        raise RuntimeError(f"{value} will not stop")

    stubborn: Resource[str] = Resource("stubborn", "its stop raises", _build("stubborn"), stop=refuse)
    ctx.state.get(BASE)
    ctx.state.get(stubborn)
    with pytest.raises(RuntimeError, match=r"^stubborn of tiny will not stop$"):
        ctx.state.close()
    assert STOPPED == ["base of tiny"]


class PreparesSneakily(Stage):
    """Its prepare starts what it does not declare: the stage fails where it runs, naming the declaration."""

    name = "prepares_sneakily"
    title = "Prepare reads base without declaring it."
    order = 1

    def prepare(self, ctx: CheckContext) -> None:
        ctx.state.get(BASE)

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed("ran")


def test_an_undeclared_use_in_prepare_fails_the_stage(ctx: CheckContext) -> None:
    (result,) = run_checks(ctx, plan([PreparesSneakily])).results
    assert result.status.value == "fail"
    assert result.summary == (
        "stage prepares_sneakily used base, which it does not declare: add it to PreparesSneakily.needs"
    )


def test_a_build_is_timed_without_the_builds_nested_in_it(ctx: CheckContext, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_support.validation import state

    now = [0.0]
    monkeypatch.setattr(state.time, "perf_counter", lambda: now[0])

    def slow_base(_ctx: CheckContext) -> str:
        now[0] += 2.0
        return "base"

    def slow_derived(ctx: CheckContext) -> str:
        now[0] += 1.0
        return ctx.state.get(base) + "+1"

    base: Resource[str] = Resource("base", "takes 2 s", slow_base)
    derived: Resource[str] = Resource("derived", "takes 1 s besides base", slow_derived, uses=(base,))
    assert ctx.state.get(derived) == "base+1"
    assert ctx.state.origins[base].seconds == 2.0 and ctx.state.origins[derived].seconds == 1.0
