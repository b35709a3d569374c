"""NeMo-RL: the GAE loop of ``GeneralizedAdvantageEstimator`` as one rl_triton call (written
against NVIDIA-NeMo/RL at commit ``7ea279ab``, nemo-rl 0.6.0, whose PPO runs it on the driver's
CPU).

    import rl_triton.integrations.nemo_rl as rt_nemo
    rt_nemo.patch()           # in the driver, before training starts
    ...                       # GeneralizedAdvantageEstimator.compute_advantage now scans with rl_triton
    rt_nemo.unpatch()         # NeMo-RL's own method again (the same object)

or without patching (NeMo-RL itself need not be installed)::

    adv, returns = rt_nemo.compute_gae(token_level_rewards, values, mask, gamma=1.0, lam=0.95)

``patch()`` replaces one method, ``GeneralizedAdvantageEstimator._compute_gae`` in
``nemo_rl.algorithms.advantage_estimator``: the Python loop over the tokens. Everything around it
stays NeMo-RL's: the token-level rewards (KL penalty, the terminal reward at the last response
token), the choice of lambda (VAPO's decoupled value/policy lambdas, the length-adaptive
per-sample lambda), the whitening and the zeroing of masked positions.

Conventions mapped here (docs/nemo_rl.md): one row per sample, tokens along the last dim, ``mask``
nonzero on the response tokens. NeMo-RL's "carry-forward" masking is rl_triton's
``mask_mode="skip"`` (docs/semantics.md, section 13): a masked token adds no TD error and carries
the next value and the running advantage across. Its per-sample lambda (a ``[batch_size]``
tensor) is a per-row ``lmbda`` (section 7). The mask is read as a flag (0/1), where NeMo-RL
multiplies by it: for 0/1 masks and finite inputs the results agree.
"""

from __future__ import annotations

import importlib

import torch

from .. import gae
from ..core.docstrings import documented
from ._llm import tensor_arg
from ._patching import PatchState, requires_framework

__all__ = ["compute_gae", "is_patched", "patch", "patched", "unpatch"]

_ESTIMATORS = "nemo_rl.algorithms.advantage_estimator"
NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"  # NVIDIA-NeMo/RL, the code these were checked against
_INSTALL = "nemo-rl @ git+https://github.com/NVIDIA-NeMo/RL"


def _per_row(lam, rows: int):
    """NeMo-RL's lambda: a number, or a ``[batch_size]`` tensor (one per sample) as a ``[batch_size, 1]``
    per-row lmbda."""
    if isinstance(lam, torch.Tensor) and lam.ndim == 1:
        if lam.shape[0] != rows:
            raise ValueError(f"lam must be a number or a [batch_size] tensor of {rows} values, got shape "
                             f"{tuple(lam.shape)}")
        return lam[:, None]
    return lam


@documented(
    token_level_rewards="``[batch_size, seq_len]`` float tensor of per-token rewards.",
    values="``V[t]``, ``[batch_size, seq_len]``, a float tensor.",
    mask=("``[batch_size, seq_len]``, 1 on the response tokens, 0 on the prompt, padding and other "
          "non-response tokens: integer or float (0/1)."),
    gamma="the discount: a number or a tensor in [0, 1].",
    lam=("the GAE lambda: a number in [0, 1], or a ``[batch_size]`` tensor of one lambda per sample (VAPO's "
         "length-adaptive lambda), in [0, 1]."),
)
def compute_gae(token_level_rewards, values, mask, gamma, lam):
    """NeMo-RL's GAE with carry-forward masking: ``(advantages, returns)``, ``[batch_size, seq_len]``.

    ``rl_triton.gae(rewards, values, mask=mask, mask_mode="skip", gamma=gamma, lmbda=lam)``
    (``lam[:, None]`` for a per-sample lambda). Per row, backwards over t, with nv = A = 0 past
    the last token: delta = r[t] + gamma*nv - V[t], A' = delta + gamma*lam*A; at a response token
    nv = V[t], A = A'; at a masked token both carry over; advantages[t] = A and returns = A + V.

    Computed in the promoted dtype of rewards, values, mask and a tensor lambda, as NeMo-RL's loop
    promotes them. Outputs never require grad.
    """
    with torch.no_grad():
        r = tensor_arg(token_level_rewards, "token_level_rewards")
        v = tensor_arg(values, "values")
        m = tensor_arg(mask, "mask")
        if r.ndim != 2 or v.shape != r.shape or m.shape != r.shape:
            raise ValueError(f"token_level_rewards, values and mask must be [batch_size, seq_len] of one shape, got "
                             f"{tuple(r.shape)}, {tuple(v.shape)} and {tuple(m.shape)}")
        dtype = torch.promote_types(torch.promote_types(r.dtype, v.dtype), m.dtype)
        if isinstance(lam, torch.Tensor):
            dtype = torch.promote_types(dtype, lam.dtype)
        return gae(r.to(dtype), v.to(dtype), mask=m, mask_mode="skip", gamma=gamma, lmbda=_per_row(lam, r.shape[0]))


def _compute_gae(self, token_level_rewards, values, mask, gae_lambda=None):
    """``GeneralizedAdvantageEstimator._compute_gae`` on rl_triton: :func:`compute_gae` with the
    estimator's ``gae_gamma`` and ``gae_lambda`` (or the ``gae_lambda`` given)."""
    lam = gae_lambda if gae_lambda is not None else self.gae_lambda
    return compute_gae(token_level_rewards, values, mask, self.gae_gamma, lam)


def _estimators():
    """NeMo-RL's ``advantage_estimator`` module, imported now; ``FrameworkNotInstalled`` without
    NeMo-RL."""
    requires_framework(__name__, "NeMo-RL", "nemo_rl", requirement=_INSTALL)
    return importlib.import_module(_ESTIMATORS)


_saved = {}  # "cls", "method": what patch() replaced


def _apply() -> None:
    cls = _estimators().GeneralizedAdvantageEstimator
    _saved.update(cls=cls, method=cls.__dict__["_compute_gae"])
    cls._compute_gae = _compute_gae


def _restore() -> None:
    cls = _saved.pop("cls")
    method = _saved.pop("method")
    if cls.__dict__.get("_compute_gae") is _compute_gae:  # what someone else set since stays
        cls._compute_gae = method


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route ``GeneralizedAdvantageEstimator._compute_gae`` (NeMo-RL's GAE loop) through
    rl_triton until ``unpatch()``. Imports NeMo-RL; ``ImportError`` where it cannot. Idempotent.
    Thread-safe. Call it in the driver process, which computes the advantages, before training
    starts; the patch is shared with ``patched()`` blocks, in any thread."""
    _estimators()
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``: NeMo-RL's own method (the same object) is back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Idempotent."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether NeMo-RL's GAE loop is routed through rl_triton now."""
    return _state.active


def patched():
    """``with patched(): ...``: NeMo-RL is patched for the block. Blocks nest, also across
    threads; NeMo-RL's own method comes back when the last holder (block or ``patch()``) lets
    go. Imports NeMo-RL when called (``ImportError`` where it cannot)."""
    _estimators()
    return _state.patched()
