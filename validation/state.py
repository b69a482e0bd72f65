"""The run state: what the stages of one ``check`` run build and share, as typed resources.

A :class:`Resource` names one thing a run builds (the Megatron model, a server, an adapter directory): its value's
type, what it is, how it is built on first use (``build``, reading only the resources it names in ``uses``; none
for one that only a stage produces) and how it is stopped when the run ends. A stage declares the resources it
reads (``Stage.needs``) and those it writes (``Stage.provides``). :class:`RunState` holds one run's values: it builds
a needed resource the first time a stage asks for it, refuses a stage (or a builder) the use of one it did not
declare, and records which stage built each (:class:`Origin`), which the report shows. A stage run alone therefore
builds what it reads, within its declared needs and their ``uses``, and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

from model_support.core.errors import ModelSupportError


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: two resources may never share a slot
class Resource[T]:
    """One typed field of the run state (declared once, at module level, next to its builder)."""

    name: str
    doc: str
    build: Callable[[Any], T] | None = None  # called with the run's CheckContext
    uses: tuple[Resource[Any], ...] = ()
    stop: Callable[[T], None] | None = None

    def __repr__(self) -> str:
        return f"Resource({self.name})"


class Declaring(Protocol):
    """What the state holds an access to: a stage class's name and declarations (``validation/stage.py``)."""

    name: ClassVar[str]
    needs: ClassVar[tuple[Resource[Any], ...]]
    provides: ClassVar[tuple[Resource[Any], ...]]


def stop_value(value: Any) -> None:
    """A resource's ``stop`` for a value that stops itself (a server, a child process, a job)."""
    value.stop()


class UndeclaredResourceError(ModelSupportError):
    """A stage or builder used a resource it does not declare: a bug in that stage's or resource's declaration."""


class MissingResourceError(ModelSupportError):
    """A resource without a builder was asked for before any stage provided it."""


@dataclass(frozen=True)
class Origin:
    """Who made a resource's value: the stage (``None``: outside any stage), in its ``prepare`` or ``run``, whether
    the stage set it itself (``provided``) or the state built it for the stage, and the seconds building took (not
    counting the resources built for it on the way, which have their own)."""

    stage: str | None
    phase: str
    provided: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "phase": self.phase, "provided": self.provided, "seconds": round(self.seconds, 3)}


def closure(resources: tuple[Resource[Any], ...]) -> list[Resource[Any]]:
    """``resources`` and everything their builders use, each once, dependencies first."""
    seen: dict[Resource[Any], None] = {}

    def visit(resource: Resource[Any]) -> None:
        if resource not in seen:
            for used in resource.uses:
                visit(used)
            seen[resource] = None

    for resource in resources:
        visit(resource)
    return list(seen)


class RunState:
    """The resources of one run: values, who built them, and the declarations each access is held to."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._values: dict[Resource[Any], Any] = {}
        self.origins: dict[Resource[Any], Origin] = {}
        self._stage: type[Declaring] | None = None
        self._phase = "run"
        self._building: list[Resource[Any]] = []
        self._nested_s: list[float] = []  # per build in progress: seconds its nested builds took (counted there)

    @contextmanager
    def acting(self, stage: type[Declaring], phase: str) -> Iterator[None]:
        """Hold every access within the block to ``stage``'s declarations, and credit it with what is built."""
        outer = self._stage, self._phase
        self._stage, self._phase = stage, phase
        try:
            yield
        finally:
            self._stage, self._phase = outer

    def _allow(self, resource: Resource[Any], writing: bool = False) -> None:
        if self._building:  # a builder reads what its resource declares it uses
            builder = self._building[-1]
            if resource not in builder.uses:
                raise UndeclaredResourceError(
                    f"building {builder.name} used {resource.name}, which it does not declare: add it to "
                    f"{builder.name}'s uses"
                )
            return
        if self._stage is None:  # outside a stage (a test, the runner): nothing to hold it to
            return
        declared = self._stage.provides if writing else self._stage.needs + self._stage.provides
        if resource not in declared:
            field = "provides" if writing else "needs"
            raise UndeclaredResourceError(
                f"stage {self._stage.name} used {resource.name}, which it does not declare: add it to "
                f"{self._stage.__name__}.{field}"
            )

    def get[T](self, resource: Resource[T]) -> T:
        """The value of ``resource``, built now if this is its first use."""
        self._allow(resource)
        if resource not in self._values:
            if resource.build is None:
                raise MissingResourceError(
                    f"{resource.name} is not available: no stage that provides it has run ({resource.doc})"
                )
            start = time.perf_counter()
            self._building.append(resource)
            self._nested_s.append(0.0)
            try:
                value = resource.build(self._ctx)
            finally:
                self._building.pop()
                nested = self._nested_s.pop()
            took = time.perf_counter() - start
            if self._nested_s:  # this build ran inside another: its seconds are not that one's too
                self._nested_s[-1] += took
            self._values[resource] = value
            self.origins[resource] = Origin(self._who(), self._phase, False, took - nested)
        return cast(T, self._values[resource])

    def find[T](self, resource: Resource[T]) -> T | None:
        """The value of ``resource`` if it is there, without building it (``None`` otherwise)."""
        self._allow(resource)
        return cast(T | None, self._values.get(resource))

    def set[T](self, resource: Resource[T], value: T) -> None:
        """Store a value the acting stage produced (``resource`` must be among its ``provides``)."""
        self._allow(resource, writing=True)
        self._values[resource] = value
        self.origins[resource] = Origin(self._who(), self._phase, True, 0.0)

    def drop(self, resource: Resource[Any]) -> None:
        """Stop ``resource``'s value (if it has a stop) and forget it; the next use builds it again."""
        self._allow(resource)
        if resource in self._values:  # its origin stays: the record of who built what
            value = self._values.pop(resource)
            if resource.stop is not None:
                resource.stop(value)

    def built_by(self, stage: str) -> dict[str, Origin]:
        """The resources ``stage`` built or provided, by name."""
        return {r.name: o for r, o in self.origins.items() if o.stage == stage}

    def close(self) -> None:
        """Stop every value that has a stop (servers, background jobs, child processes), the newest first; one that
        fails to stop does not keep the others running (the first error is raised after all were tried)."""
        errors: list[BaseException] = []
        for resource in reversed(list(self._values)):
            if resource.stop is not None:
                try:
                    resource.stop(self._values.pop(resource))
                except Exception as exc:  # the rest are still stopped; raised below
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _who(self) -> str | None:
        return None if self._stage is None else self._stage.name
