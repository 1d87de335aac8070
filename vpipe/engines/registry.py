"""Which engine a target runs under: the registered adapters, asked latest first.

An engine is one adapter module (a subclass of :class:`~vpipe.engines.base.Engine` that
says which targets it ``accepts`` and how to ``read`` them) and one :func:`register_engine`
line. The latest registered is asked first, so an engine registered later may claim targets
a more general one would take (the plain stage module's adapter takes any ``nn.Module``).
"""

from __future__ import annotations

from typing import Any

from vpipe.engines.base import Engine

__all__ = ["register_engine", "unregister_engine", "engine_for", "registered_engines"]

_ENGINES: list[type[Engine]] = []


def register_engine(engine: type[Engine]) -> type[Engine]:
    """Add an engine (usable as a class decorator); asked before every engine registered earlier."""
    if not (isinstance(engine, type) and issubclass(engine, Engine)):
        raise TypeError(f"register_engine takes a subclass of vpipe.engines.Engine, got {engine!r}")
    if engine not in _ENGINES:
        _ENGINES.append(engine)
    return engine


def unregister_engine(engine: type[Engine]) -> None:
    """Forget an engine registered before (a test's own, once it is done)."""
    if engine in _ENGINES:
        _ENGINES.remove(engine)


def registered_engines() -> list[type[Engine]]:
    """The engines in the order they are asked."""
    return list(reversed(_ENGINES))


def engine_for(target: Any) -> Engine:
    """The engine ``target`` (what the trainer passed to ``attach``) runs under, its stages read."""
    for engine in reversed(_ENGINES):
        if engine.accepts(target):
            return engine.read(target)
    raise TypeError("vpipe.attach takes a pipelining schedule, a DeepSpeed PipelineEngine or "
                    f"a stage module, got {type(target).__name__}")
