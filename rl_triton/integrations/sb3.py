"""Stable-Baselines3: one fused GAE call instead of the Python loop of
``RolloutBuffer.compute_returns_and_advantage``.

    import rl_triton.integrations.sb3 as rt_sb3
    rt_sb3.patch()            # RolloutBuffer, DictRolloutBuffer and every subclass (sb3-contrib too)
    PPO("MlpPolicy", "CartPole-v1").learn(100_000)
    rt_sb3.unpatch()          # the original method, the same function object

or per algorithm, without patching: ``PPO(..., rollout_buffer_class=rt_sb3.FastRolloutBuffer)``
(``FastDictRolloutBuffer`` for dict observations).

SB3 keeps its rollout in numpy ``(n_steps, n_envs)`` float32 arrays on the host, so the
default runs the CPU backend on those arrays in place. ``device="cuda"`` (or a buffer's
``gae_device``) moves the three inputs to that GPU and the two outputs back; ``device="auto"``
does so when CUDA is available and the buffer holds at least ``gpu_min_elements`` steps.

Conventions mapped here (docs/semantics.md, section 4): ``episode_starts[t]`` marks obs t as
the first of an episode and ``dones`` closes the window: rl_triton's observation-aligned flags,
read in place (done[t] = episode_starts[t+1], done[T-1] = ``dones``, all terminations, as SB3
folds the time-limit bootstrap into the rewards); V(s_T) is ``last_values``. Advantages are written into ``self.advantages`` in place and ``self.returns``
is rebound to a new array (advantages + values), as SB3 does.
"""

from __future__ import annotations

import numpy as np
import torch

from ._patching import requires_framework

requires_framework(__name__, "Stable-Baselines3", "stable_baselines3", extra="sb3")

from stable_baselines3.common import buffers as _buffers  # noqa: E402

from .. import gae  # noqa: E402
from ._patching import PatchState  # noqa: E402

__all__ = ["FastDictRolloutBuffer", "FastRolloutBuffer", "is_patched", "patch", "patched", "unpatch"]

_ORIGINAL = _buffers.RolloutBuffer.__dict__["compute_returns_and_advantage"]
# the GPU pays from this many elements on (re-tune: python benchmarks/sb3_crossover.py)
_DEFAULTS = {"device": "cpu", "gpu_min_elements": 1 << 16}
# rollouts this short (A2C's default is 5 steps) keep SB3's own loop on the CPU, where it costs
# less than one fused call (docs/sb3.md)
LOOP_MAX_STEPS = 12
# up to this many steps the CPU path takes fresh outputs (a call without out= skips the overlap
# check, a few microseconds) and copies the advantages into the buffer; larger ones are written
# in place (re-tune: python benchmarks/sb3_crossover.py)
FRESH_MAX_ELEMENTS = 1 << 14


_CPU = torch.device("cpu")


def _target_device(name, n_elements: int, gpu_min_elements: int) -> torch.device:
    if name == "cpu":
        return _CPU
    if name == "auto":
        use_gpu = torch.cuda.is_available() and n_elements >= gpu_min_elements
        return torch.device("cuda" if use_gpu else "cpu")
    return torch.device(name)


def compute_returns_and_advantage(self, last_values: torch.Tensor, dones: np.ndarray) -> None:
    """GAE over the buffer (SB3's semantics) as one fused scan; see the module docstring.

    Args:
        self: the rollout buffer, whose ``rewards``, ``values`` and ``episode_starts`` (numpy
            ``(n_steps, n_envs)``) it reads and whose ``advantages`` and ``returns`` it sets.
        last_values: ``V(s_T)`` of the observation after the rollout's last step, one per
            environment (a tensor of ``n_envs`` elements, as SB3 passes it); detached and cast to
            the buffer's dtype.
        dones: whether each environment's last step ended its episode (SB3's ``dones``, a numpy
            array of ``n_envs`` flags, true where nonzero).
    """
    T, N = self.rewards.shape
    settings = _state.settings(_DEFAULTS)
    device = _target_device(getattr(self, "gae_device", None) or settings["device"], T * N,
                            settings["gpu_min_elements"])
    if device.type == "cpu" and T <= LOOP_MAX_STEPS:
        return _ORIGINAL(self, last_values, dones)
    # SB3 keeps the flags as float32; one byte per flag is what the kernels read fastest (and
    # what a GPU copy moves), so they are compared with 0 once on the way in
    starts, last = self.episode_starts != 0, np.asarray(dones).reshape(N) != 0
    rewards, values, starts, last = (torch.from_numpy(a) for a in (self.rewards, self.values, starts, last))
    bootstrap = last_values.detach().reshape(N)
    if device.type != "cpu":
        rewards, values, starts, last = (a.to(device, non_blocking=True) for a in (rewards, values, starts, last))
    if bootstrap.device != device or bootstrap.dtype != rewards.dtype:
        bootstrap = bootstrap.to(device=device, dtype=rewards.dtype)
    kw = dict(episode_starts=starts, last_done=last, bootstrap_value=bootstrap, gamma=float(self.gamma),
              lmbda=float(self.gae_lambda), time_dim=0)
    if device.type == "cpu" and T * N > FRESH_MAX_ELEMENTS:
        # written in place: fresh outputs this large would cost their pages' first touch and a copy
        returns = np.empty_like(self.values)
        gae(rewards, values, out=(torch.from_numpy(self.advantages), torch.from_numpy(returns)), **kw)
        self.returns = np.add(self.advantages, self.values, out=returns)
        return
    adv, _ = gae(rewards, values, **kw)
    np.copyto(self.advantages, adv.cpu().numpy())
    # SB3's own expression, so that returns == advantages + values holds to the bit
    self.returns = self.advantages + self.values


def _check_device(device, name: str) -> str:
    """``device`` as given, once it names a device this torch can use now (or is "auto")."""
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a string ('cpu', 'cuda', 'cuda:N' or 'auto'), got {type(device).__name__}")
    if device == "auto":
        return device
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a device: {e}") from None
    if dev.type == "cpu":
        return device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r}, but CUDA is not available to this torch "
                             f"({torch.__version__}); use 'cpu' or 'auto'")
        count = torch.cuda.device_count()
    else:
        current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if current is None or current.type != dev.type:
            raise ValueError(f"{name}={device!r}, but this torch ({torch.__version__}) has no {dev.type} device")
        count = torch.accelerator.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name}={device!r}, but torch sees {count} {dev.type} device(s)")
    return device


def _settings_of(device, gpu_min_elements) -> dict:
    _check_device(device, "device")
    if gpu_min_elements is None:
        gpu_min_elements = _state.settings(_DEFAULTS)["gpu_min_elements"]
    elif isinstance(gpu_min_elements, bool) or not isinstance(gpu_min_elements, int) or gpu_min_elements < 0:
        raise ValueError(f"gpu_min_elements must be a non-negative int, got {gpu_min_elements!r}")
    return {"device": device, "gpu_min_elements": gpu_min_elements}


def _apply() -> None:
    _buffers.RolloutBuffer.compute_returns_and_advantage = compute_returns_and_advantage


def _restore() -> None:
    _buffers.RolloutBuffer.compute_returns_and_advantage = _ORIGINAL


_state = PatchState(_apply, _restore)


def patch(device: str = "cpu", gpu_min_elements: int | None = None) -> None:
    """Route ``RolloutBuffer.compute_returns_and_advantage`` (and so every subclass that
    inherits it) through rl_triton until ``unpatch()``. Idempotent; calling again only updates
    the settings. Thread-safe.

    The patch is shared with ``patched()`` blocks, which may be open in other threads: SB3's
    method is set while ``patch()`` is in effect or any block is open, and the settings of the
    latest of them apply (a ``patch()`` call counts as the latest from then on).

    Args:
        device: "cpu" (default), "cuda"/"cuda:N", or "auto" (the GPU for buffers of at least
            ``gpu_min_elements`` steps, where CUDA is available); a device that this torch cannot
            use raises ``ValueError`` here.
        gpu_min_elements: with ``device="auto"``, the smallest buffer (``n_steps * n_envs``) that
            goes to the GPU: an int >= 0 (``ValueError`` otherwise). None keeps the value in
            effect (default 65,536).
    """
    _state.patch(_settings_of(device, gpu_min_elements))


def unpatch() -> None:
    """Withdraw ``patch()``. SB3's own method (the original function object) is back at once,
    or, while ``patched()`` blocks are open (in any thread), when the last of them closes.
    Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether ``RolloutBuffer.compute_returns_and_advantage`` is routed through rl_triton now."""
    return _state.active


def patched(device: str = "cpu", gpu_min_elements: int | None = None):
    """``with patched(): ...``: SB3 is patched for the block, with these settings, and the
    block's hold on the patch ends with it. Blocks nest, also across threads: each holds the
    patch until it closes, and SB3's own method comes back when the last holder (block or
    ``patch()``) lets go. The settings are the latest holder's (see ``patch()``).

    Args:
        device: as for ``patch()``.
        gpu_min_elements: as for ``patch()``.
    """
    return _state.patched(_settings_of(device, gpu_min_elements))


class _FastGAE:
    """Mixin for ``rollout_buffer_class``: the fused GAE, optionally on ``gae_device``."""

    def __init__(self, *args, gae_device: str | None = None, **kwargs):
        self.gae_device = None if gae_device is None else _check_device(gae_device, "gae_device")
        super().__init__(*args, **kwargs)

    compute_returns_and_advantage = compute_returns_and_advantage


class FastRolloutBuffer(_FastGAE, _buffers.RolloutBuffer):
    """``RolloutBuffer`` with the fused GAE: ``PPO(..., rollout_buffer_class=FastRolloutBuffer)``.

    Args:
        *args: SB3's constructor arguments, passed on.
        gae_device: the device of this buffer's GAE ("cpu", "cuda"/"cuda:N" or "auto", as
            ``patch(device=)``; ``ValueError`` for a device this torch cannot use). None: the
            setting of ``patch()``, default "cpu".
        **kwargs: SB3's keyword arguments, passed on.
    """


class FastDictRolloutBuffer(_FastGAE, _buffers.DictRolloutBuffer):
    """``DictRolloutBuffer`` with the fused GAE, for dict observation spaces.

    Args:
        *args: SB3's constructor arguments, passed on.
        gae_device: the device of this buffer's GAE ("cpu", "cuda"/"cuda:N" or "auto", as
            ``patch(device=)``; ``ValueError`` for a device this torch cannot use). None: the
            setting of ``patch()``, default "cpu".
        **kwargs: SB3's keyword arguments, passed on.
    """
