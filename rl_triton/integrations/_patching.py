"""Who holds a framework patched: the shared state behind each integration's ``patch()``,
``unpatch()`` and ``patched()``."""

from __future__ import annotations

import contextlib
import threading

_EXPLICIT = object()  # the holder key of patch()


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
