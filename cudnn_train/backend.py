"""Backend choice for every fused op.

Each op is an :class:`Op` with an ordered list of backends (for example
``cutedsl`` -> ``fla`` -> ``torch``). A backend is a plain function. It either
returns the result, or raises :class:`Unsupported` *before touching any
memory*; the dispatcher then tries the next backend. Any other exception
propagates unchanged: a decline is never a wrong answer and an error is never
swallowed.

``last_path(op_name)`` reports which backend served the most recent call and,
when it was not the first choice, why the earlier ones declined::

    "cutedsl:sm90"                    the kernel served it
    "torch:fallback(no GPU)"          cutedsl declined with reason "no GPU"
    "torch:forced"                    CUDNN_TRAIN_BACKEND=torch or use_backend("torch")

Forcing: ``CUDNN_TRAIN_BACKEND`` (read at every call) or the ``use_backend``
context manager name one backend, or a comma-separated preference list. With a
single forced backend a decline raises ``Unsupported`` with its reason; an op
that has none of the named backends raises too.

Determinism: ``deterministic(True)`` (also usable as a context manager) or
``CUDNN_TRAIN_DETERMINISTIC=1`` asks every backward for a bitwise reproducible
path (no float atomics, fixed reduction order). Backends read it through
``is_deterministic()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Any, Callable, Iterator, Sequence

__all__ = [
    "Unsupported",
    "Served",
    "Op",
    "get_op",
    "registered_ops",
    "last_path",
    "use_backend",
    "deterministic",
    "is_deterministic",
]


class Unsupported(Exception):
    """Raised by a backend that cannot serve a call, before it touches memory."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Served:
    """What a backend may return to name its path detail, e.g. ``Served(out, "sm90")``."""

    __slots__ = ("value", "tag")

    def __init__(self, value: Any, tag: str):
        self.value = value
        self.tag = tag


_forced: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "cudnn_train_forced_backend", default=None
)
_det_global: list[bool | None] = [None]

_ops: dict[str, "Op"] = {}
_last: dict[str, str] = {}
_lock = threading.Lock()


def _parse_names(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        names = tuple(n.strip() for n in value.split(",") if n.strip())
    else:
        names = tuple(value)
    if not names:
        raise ValueError(f"backend: expected a backend name, got {value!r}")
    return names


def _forced_names() -> tuple[str, ...] | None:
    ctx = _forced.get()
    if ctx is not None:
        return ctx
    env = os.environ.get("CUDNN_TRAIN_BACKEND", "").strip()
    return _parse_names(env) if env else None


class Op:
    """One dispatch point: an op name and its ordered backends."""

    def __init__(self, name: str, order: Sequence[str]):
        if name in _ops:
            raise ValueError(f"op {name!r} is registered already")
        self.name = name
        self.order = tuple(order)
        self._impls: dict[str, Callable[..., Any]] = {}
        self._backends: tuple[str, ...] = ()
        with _lock:
            _ops[name] = self

    def register(self, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``@op.register("torch")`` binds a backend function."""
        if backend not in self.order:
            raise ValueError(f"op {self.name!r}: backend {backend!r} is not in its order {self.order}")

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._impls[backend] = fn
            self._backends = tuple(b for b in self.order if b in self._impls)
            return fn

        return deco

    @property
    def backends(self) -> tuple[str, ...]:
        return self._backends

    def after(self, backend: str) -> tuple[str, ...]:
        """The backends a call would try after ``backend`` now (the forced list where one is set; none
        where ``backend`` is not in the plan), for a backend that declines to a faster next one."""
        plan = self._plan()[0]
        return plan[plan.index(backend) + 1:] if backend in plan else ()

    def _plan(self) -> tuple[tuple[str, ...], bool]:
        forced = _forced_names()
        if forced is None:
            return self.backends, False
        plan = tuple(b for b in forced if b in self._impls)
        if not plan:
            raise Unsupported(
                f"op {self.name!r} has none of the forced backends {forced} (it has {self.backends})"
            )
        return plan, True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan, forced = self._plan()
        declined: list[str] = []
        for name in plan:
            try:
                out = self._impls[name](*args, **kwargs)
            except Unsupported as e:
                declined.append(f"{name}: {e.reason}")
                if forced and len(plan) == 1:
                    raise Unsupported(f"op {self.name!r}: forced backend {name!r} declined: {e.reason}") from None
                continue
            if isinstance(out, Served):
                tag, out = out.tag, out.value
            else:
                tag = ""
            if forced and name == plan[0]:
                path = f"{name}:forced" + (f"({tag})" if tag else "")
            elif declined:
                first = declined[0].split(": ", 1)[1]
                path = f"{name}:fallback({first})"
            else:
                path = f"{name}:{tag}" if tag else name
            _last[self.name] = path
            return out
        raise Unsupported(f"op {self.name!r}: every backend declined: " + "; ".join(declined))


def get_op(name: str) -> Op:
    try:
        return _ops[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known: {sorted(_ops)}") from None


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {name: op.backends for name, op in _ops.items()}


def last_path(op_name: str | None = None) -> str | dict[str, str] | None:
    """The backend (and reason) that served the latest call of ``op_name``; all ops if None."""
    if op_name is None:
        return dict(_last)
    return _last.get(op_name)


@contextlib.contextmanager
def use_backend(name: str | Sequence[str]) -> Iterator[None]:
    """Force a backend (or a preference list) inside the block."""
    token = _forced.set(_parse_names(name))
    try:
        yield
    finally:
        _forced.reset(token)


class _DeterministicScope:
    def __init__(self, flag: bool):
        self._prev = _det_global[0]
        _det_global[0] = bool(flag)

    def __enter__(self) -> "_DeterministicScope":
        return self

    def __exit__(self, *exc: Any) -> None:
        _det_global[0] = self._prev


def deterministic(flag: bool = True) -> _DeterministicScope:
    """Select bitwise-reproducible backward paths.

    ``deterministic(True)`` sets it for the process; ``with deterministic(True):``
    sets it for the block and restores the previous setting afterwards.
    """
    return _DeterministicScope(flag)


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment switch: 1/true/yes/on (any case) set it, anything else clears it;
    ``default`` when the variable is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in ("1", "true", "yes", "on")


def is_deterministic() -> bool:
    if _det_global[0] is not None:
        return _det_global[0]
    return env_flag("CUDNN_TRAIN_DETERMINISTIC")
