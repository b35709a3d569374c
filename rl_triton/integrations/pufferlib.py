"""PufferLib 3: ``pufferlib.pufferl.compute_puff_advantage`` on rl_triton's fused scans
(written against pufferlib 3.0.0).

    import rl_triton.integrations.pufferlib as rt_puffer
    rt_puffer.patch()          # before training starts; PuffeRL.train() now runs rl_triton
    ...
    rt_puffer.unpatch()        # PufferLib's own function object is back

or without patching, with PufferLib's signature (PufferLib itself need not be installed)::

    rt_puffer.compute_puff_advantage(values, rewards, terminals, ratio, advantages,
                                     gamma, gae_lambda, vtrace_rho_clip, vtrace_c_clip)

PufferLib's buffers are ``[segments, horizon]``, one row per agent segment, with the reward and
the terminal flag stored with the observation they arrive with: rl_triton's arrival-aligned
rows, :func:`rl_triton.arrival_gae` (docs/semantics.md, section 6.9), which this module calls
with PufferLib's arguments: ``ratio`` the importance ratio, ``vtrace_rho_clip`` and
``vtrace_c_clip`` its clips, every terminal a termination. The advantages are written into
``advantages`` in place and returned, as PufferLib does. CUDA tensors run on the Triton backend
and CPU tensors on numba (no compiled PufferLib extension is needed, so a CPU-only torch works).

PufferLib never writes the last column of ``advantages`` (the last observation's reward arrives
with the next segment; PufferLib's issue 363). The default keeps that: the column holds what the
buffer held (0 in PufferLib's training loop, which passes fresh zeros). ``write_last=True``
(a keyword of the function, or of ``patch()``/``patched()``) writes 0 there instead, whatever
the buffer held.

Inputs: 2-D tensors of one shape on one device, float32 (PufferLib 3.0.0's only dtype),
bfloat16 or float64, ``ratio`` and ``values``/``rewards`` of one dtype; ``advantages`` of that
dtype, or float32 for bfloat16 inputs (computed from the inputs widened to float32).
``terminals`` may also be bool or integer. Any strides. Where PufferLib's op raises
``RuntimeError`` (not 2-D, shapes or devices that differ, a dtype it does not take) this
raises an error that is both a ``RuntimeError`` and a ``ValueError``/``TypeError``, naming the
argument; ``values`` of fewer than 2 dims, where the op raises ``IndexError`` (it reads
``values.size(1)`` first), raise :class:`DimError`, also an ``IndexError``.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

from .. import arrival_gae
from ._patching import PatchState, requires_framework

__all__ = ["DimError", "DtypeError", "InputError", "PUFFERLIB_VERSION", "compute_puff_advantage", "is_patched", "patch", "patched",
           "unpatch"]

PUFFERLIB_VERSION = "3.0.0"  # the release read for this module
_PUFFERL = "pufferlib.pufferl"
_EXTENSION = "pufferlib._C"
_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_DEFAULTS = {"write_last": False}


class InputError(ValueError, RuntimeError):
    """A bad argument: a ``ValueError`` for rl_triton's rules, a ``RuntimeError`` as PufferLib's
    op raises it."""


class DimError(InputError, IndexError):
    """``values`` with fewer than 2 dims: an :class:`InputError` that is also the ``IndexError``
    PufferLib's op raises there (it reads the horizon as ``values.size(1)`` before its checks)."""


class DtypeError(TypeError, RuntimeError):
    """An argument of a dtype the drop-in does not take (PufferLib's op: ``RuntimeError``)."""


_NAMES = ("values", "rewards", "terminals", "ratio", "advantages")


def _check(tensors) -> None:
    values, rewards, terminals, ratio, advantages = tensors
    if type(values) is torch.Tensor and values.dim() == 2 and values.dtype in _DTYPES:
        # the common call (PufferLib's buffers) in a few comparisons; anything else below, with its message
        shape, device, dtype = values.shape, values.device, values.dtype
        if all(type(x) is torch.Tensor and x.shape == shape and x.device == device for x in tensors[1:]) \
                and rewards.dtype is dtype and ratio.dtype is dtype and advantages.dtype is dtype \
                and not terminals.is_complex():
            return
    for name, x in zip(_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            raise DtypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            error = DimError if name == "values" and x.dim() < 2 else InputError
            raise error(f"{name} must be 2-D [segments, horizon], got shape {tuple(x.shape)}")
        if x.device != values.device:
            raise InputError(f"{name} is on {x.device}, values on {values.device}: all tensors must be on one device")
        if x.shape != values.shape:
            raise InputError(f"{name} has shape {tuple(x.shape)}, values {tuple(values.shape)}: all tensors must "
                             f"have one shape [segments, horizon]")
        if name == "terminals" and not x.is_complex():  # flags of any real dtype, true where nonzero
            continue
        if x.dtype not in _DTYPES:
            raise DtypeError(f"{name} must be float32, bfloat16 or float64, got {x.dtype}")
    for name, x in zip(("rewards", "ratio"), (tensors[1], tensors[3])):
        if x.dtype != values.dtype:
            raise DtypeError(f"{name} is {x.dtype}, values {values.dtype}: values, rewards and ratio must share "
                             f"one dtype")
    adv = tensors[4]
    if adv.dtype != values.dtype and not (values.dtype == torch.bfloat16 and adv.dtype == torch.float32):
        raise DtypeError(f"advantages is {adv.dtype}: it must have the values' dtype ({values.dtype}), or be "
                         f"float32 for bfloat16 inputs")


def compute_puff_advantage(values, rewards, terminals, ratio, advantages, gamma, gae_lambda, vtrace_rho_clip,
                           vtrace_c_clip, *, write_last=None):
    """PufferLib's advantage, written into ``advantages`` (returned).

    For each row and t < horizon-1 (docs/semantics.md, section 6.9):
    rho = min(ratio[t], vtrace_rho_clip), c = min(ratio[t], vtrace_c_clip),
    delta = rho*(rewards[t+1] + gamma*values[t+1]*(1-terminals[t+1]) - values[t]),
    A[t] = delta + gamma*gae_lambda*c*(1-terminals[t+1])*A[t+1], A[horizon-1] = 0;
    ``advantages[:, -1]`` is left as it was unless ``write_last``. A bad argument raises
    ``InputError`` or ``DtypeError`` (``RuntimeError`` both, as PufferLib's op raises).

    Args:
        values: ``values[t]``, V of observation t: a ``[segments, horizon]`` float32, bfloat16 or
            float64 tensor; every tensor has its shape and device.
        rewards: the reward that arrived with observation t (the step from observation t reads
            ``rewards[t+1]``), the values' dtype.
        terminals: the done flag that arrived with observation t (any real dtype, true where
            nonzero): the step from observation t ends its episode where ``terminals[t+1]``.
        ratio: the importance ratio of the action taken at observation t, the values' dtype.
        advantages: the output, written in place: the values' dtype, or float32 for bfloat16
            inputs.
        gamma: the discount, a number in [0, 1].
        gae_lambda: the GAE lambda, a number in [0, 1].
        vtrace_rho_clip: the clip of ``rho``, a number > 0.
        vtrace_c_clip: the clip of ``c``, a number > 0.
        write_last: a bool: True writes 0 into the last column of ``advantages``, False leaves it
            as PufferLib does. None: the setting of the ``patch()``/``patched()`` in effect, else
            False.
    """
    tensors = (values, rewards, terminals, ratio, advantages)
    _check(tensors)
    if write_last is None:
        write_last = _state.settings(_DEFAULTS)["write_last"]
    if advantages.dtype != values.dtype:  # bfloat16 inputs into a float32 buffer
        values, rewards, ratio = values.float(), rewards.float(), ratio.float()
    arrival_gae(rewards, values, ratio=ratio, done=terminals, gamma=float(gamma), lmbda=float(gae_lambda),
                rho_bar=float(vtrace_rho_clip), c_bar=float(vtrace_c_clip), write_last=write_last, out=advantages)
    return advantages


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------

_module = None  # the pufferl module patched now
_original = None  # PufferLib's function that patch() replaced
_stand_in = None  # the empty pufferlib._C that patch() registered, where PufferLib's would not load


def _pufferl():
    """``pufferlib.pufferl``, imported now. Where PufferLib's compiled extension does not load
    (a CPU-only torch, no build), an empty ``pufferlib._C`` stands in for it, so that the module
    imports: the drop-in needs no extension. ``FrameworkNotInstalled`` where PufferLib is not
    installed."""
    global _stand_in
    if _PUFFERL in sys.modules:
        return sys.modules[_PUFFERL]
    requires_framework(__name__, "pufferlib", "pufferlib", requirement=f"pufferlib=={PUFFERLIB_VERSION}")
    try:
        importlib.import_module("pufferlib")
    except ImportError as e:
        raise ImportError(f"rl_triton.integrations.pufferlib needs pufferlib (written against pufferlib "
                          f"{PUFFERLIB_VERSION}) to patch it: {e}") from e
    try:
        importlib.import_module(_EXTENSION)
    except (ImportError, OSError):
        _stand_in = types.ModuleType(_EXTENSION, "stands in for PufferLib's extension (rl_triton's drop-in)")
        sys.modules[_EXTENSION] = _stand_in
    return importlib.import_module(_PUFFERL)


def _apply() -> None:
    global _module, _original
    module = _pufferl()
    _original = module.compute_puff_advantage
    module.compute_puff_advantage = compute_puff_advantage
    _module = module


def _restore() -> None:
    global _module, _original
    module, _module = _module, None
    # only where ours is still in place: an object set there since (by someone else) stays
    if getattr(module, "compute_puff_advantage", None) is compute_puff_advantage:
        module.compute_puff_advantage = _original
    _original = None


_state = PatchState(_apply, _restore)


def _settings_of(write_last) -> dict:
    if not isinstance(write_last, bool):
        raise TypeError(f"write_last must be a bool, got {type(write_last).__name__}")
    return {"write_last": write_last}


def patch(write_last: bool = False) -> None:
    """Route ``pufferlib.pufferl.compute_puff_advantage`` through rl_triton until ``unpatch()``.
    Imports ``pufferlib.pufferl`` (with an empty ``pufferlib._C`` standing in where PufferLib's
    extension does not load); ``ImportError`` where PufferLib is not installed. Idempotent;
    calling again only updates the settings. Thread-safe.

    The patch is shared with ``patched()`` blocks, which may be open in other threads; the
    settings of the latest holder apply.

    Args:
        write_last: a bool: the patched function writes 0 into the last column of
            ``advantages`` (default False: it leaves it, as PufferLib does); ``TypeError`` for
            another type.
    """
    settings = _settings_of(write_last)
    _pufferl()
    _state.patch(settings)


def unpatch() -> None:
    """Withdraw ``patch()``. PufferLib's own function object is back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Idempotent.
    Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``pufferlib.pufferl.compute_puff_advantage`` is routed through rl_triton now."""
    return _state.active


def patched(write_last: bool = False):
    """``with patched(): ...``: PufferLib is patched for the block, with these settings, and the
    block's hold on the patch ends with it. Blocks nest, also across threads: PufferLib's own
    function comes back when the last holder (block or ``patch()``) lets go.

    Args:
        write_last: as for ``patch()``.
    """
    settings = _settings_of(write_last)
    _pufferl()
    return _state.patched(settings)
