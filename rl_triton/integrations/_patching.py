"""Who holds a framework patched: the shared state behind each integration's ``patch()``,
``unpatch()`` and ``patched()``."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import threading

import torch

_EXPLICIT = object()  # the holder key of patch()


class FrameworkNotInstalled(ModuleNotFoundError):
    """An integration needs a framework that is not installed; the message names the integration,
    the framework and the pip line that installs it. A ``ModuleNotFoundError`` (so an
    ``ImportError``), with ``name`` the framework's top-level module."""


def requires_framework(module: str, framework: str, import_name: str, extra: str | None = None,
                       requirement: str | None = None) -> None:
    """Raise ``FrameworkNotInstalled`` where the top-level module ``import_name`` cannot be found
    (not installed, or blocked by ``sys.modules[import_name] = None``); return None otherwise.

    Runs before the integration imports anything of the framework, so the error comes from one
    frame, not from inside the framework's import chain. Finding the module does not import it.

    Args:
        module: the integration's module name (``__name__``), which the message starts with.
        framework: the framework's name as its users know it, e.g. ``"Stable-Baselines3"``.
        import_name: the framework's top-level module, e.g. ``"stable_baselines3"``.
        extra: the extra of rl-triton that installs the framework, which the message's
            ``pip install -e`` line then names.
        requirement: where no extra installs it, the pip requirement that does, e.g.
            ``"openrlhf==0.11.0"``. Exactly one of ``extra`` and ``requirement`` is given.
    """
    if (extra is None) == (requirement is None):
        raise TypeError("requires_framework takes exactly one of extra and requirement")
    if sys.modules.get(import_name) is not None:
        return  # imported already (find_spec would reject a module made without a spec)
    if import_name not in sys.modules and importlib.util.find_spec(import_name) is not None:
        return
    how = (f"pip install -e '.[{extra}]' (from the rl_triton repository root)" if extra is not None
           else f"pip install '{requirement}'")
    named = framework if framework == import_name else f"{framework} (the module {import_name!r})"
    raise FrameworkNotInstalled(f"{module} needs {named}, which is not installed: {how}", name=import_name)


class PatchState:
    """The holders of one framework's patch: ``patch()`` (at most one holder, until
    ``unpatch()``) and every open ``patched()`` block, in any thread.

    ``apply()`` runs when the first holder arrives and ``restore()`` when the last one leaves,
    both under one lock, so the framework is patched exactly while some holder needs it.
    Each holder brings settings; the most recent holder's apply: a block's until it closes, and
    ``patch()``'s from each call on (a call moves it to the most recent place)."""

    def __init__(self, apply, restore):
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        # (key, settings) pairs, oldest first; replaced, never changed, so readers need no lock
        self._holders = ()

    def _set(self, holders) -> None:
        if holders and not self._holders:
            self._apply()
        elif self._holders and not holders:
            self._restore()
        self._holders = holders

    def _without(self, key):
        return tuple(h for h in self._holders if h[0] is not key)

    def patch(self, settings=None) -> None:
        with self._lock:
            self._set(self._without(_EXPLICIT) + ((_EXPLICIT, settings),))

    def unpatch(self) -> None:
        with self._lock:
            self._set(self._without(_EXPLICIT))

    @contextlib.contextmanager
    def patched(self, settings=None):
        key = object()
        with self._lock:
            self._set(self._holders + ((key, settings),))
        try:
            yield
        finally:
            with self._lock:
                self._set(self._without(key))

    @property
    def active(self) -> bool:
        return bool(self._holders)

    def settings(self, default=None):
        holders = self._holders
        return holders[-1][1] if holders else default


def error_of(fn, args, kwargs):
    """The exception ``fn(*args, **kwargs)`` raises, or None (the drop-ins' error path runs the
    framework's own function to raise what it raises)."""
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return error
    return None


@functools.lru_cache(maxsize=256)
def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a Python number: what a framework's loop computes with
    where it puts the number into a tensor of that dtype first. Formed once per (value, dtype),
    so that a drop-in's repeated call reads nothing back from a tensor."""
    return torch.tensor(value, dtype=dtype).item()


def raising_as(theirs):
    """Decorator for a drop-in: where it raises, raise instead what the framework's own function
    raises on the same arguments (its exception, type and message), if that raises at all;
    otherwise the drop-in's own error. ``theirs(name)`` gives the framework's function of the
    drop-in's ``__name__``, or None (framework not imported): then the drop-in's error stands.
    The framework's function runs on the error path only."""

    def decorate(ours):
        @functools.wraps(ours)
        def call(*args, **kwargs):
            try:
                return ours(*args, **kwargs)
            except Exception:
                fn = theirs(ours.__name__)
                error = None if fn is None else error_of(fn, args, kwargs)
                if error is None:
                    raise
                raise error from None

        return call

    return decorate


def normalisation_setting(global_normalisation, name: str = "global_normalisation"):
    """A drop-in's ``global_normalisation`` argument, checked: False (the framework's statistics
    of this process's rollout), True (those of every rank of the default process group) or a
    ``torch.distributed`` ProcessGroup (those of its ranks). ``TypeError`` naming ``name`` for
    anything else; returned as given."""
    if isinstance(global_normalisation, bool):
        return global_normalisation
    dist = torch.distributed
    if dist.is_available() and isinstance(global_normalisation, dist.ProcessGroup):
        return global_normalisation
    raise TypeError(f"{name} must be a bool or a torch.distributed ProcessGroup, "
                    f"got {type(global_normalisation).__name__}")


def normalisation_group(global_normalisation):
    """The process group whose ranks' rollouts the advantage statistics span, for ``whiten=
    dict(group=...)``: None for False, and for True where ``torch.distributed`` is not
    initialised (one process, whose rollout is the whole batch); the default group
    (``dist.group.WORLD``) for True in an initialised process; a ProcessGroup as given."""
    if global_normalisation is False:
        return None
    if global_normalisation is True:
        dist = torch.distributed
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return global_normalisation
