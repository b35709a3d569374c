"""Ray RLlib (new API stack, torch; written against ray 2.60.0): PPO's GAE and IMPALA/APPO's
V-trace as fused scans, in the driver and inside the Learner actors.

    import rl_triton.integrations.rllib as rt_rllib
    rt_rllib.patch()          # this process: PPO's GAE connector, compute_value_targets, vtrace_torch
    rt_rllib.unpatch()        # RLlib's own objects again (the same objects)

or one line of the config, which also reaches remote Learner actors (``num_learners >= 1``)::

    config.learners(learner_class=rt_rllib.PPOTorchLearner)     # or APPOTorchLearner, IMPALATorchLearner

or every Ray worker process patched at its start::

    ray.init(runtime_env={"worker_process_setup_hook": "rl_triton.integrations.rllib.patch"})

What is replaced (docs/rllib.md):

- ``compute_value_targets`` where RLlib's ``GeneralAdvantageEstimation`` connector looks it up
  (``ray.rllib.connectors.learner.general_advantage_estimation``; patching
  ``value_predictions`` alone would change nothing): the same numpy-in, numpy-out contract,
  one fused scan on the host (numba) instead of the Python loop over the flattened batch.
- ``GeneralAdvantageEstimation`` as ``PPOLearner.build`` looks it up (``ppo_learner``): the
  connector here, which keeps the values on the Learner's device and does value targets,
  advantages and RLlib's normalisation there (one ``gae`` scan and one ``masked_whiten``), with
  no round trip through numpy.
- ``vtrace_torch`` where the APPO and IMPALA torch Learners look it up
  (``appo_torch_learner``, ``impala_torch_learner``): one fused V-trace scan on the
  Learner's device instead of the Python loop over T.

Conventions mapped here (docs/semantics.md, sections 2, 3 and 7). GAE: RLlib's flat 1-D batch
of episode chunks, each lengthened by one timestep (``AddOneTsToEpisodesAndTruncate``), with
``next_values[t] = values[t+1]`` (0 after the last), ``terminated=`` and ``truncated=``
passed through. V-trace: time-major ``[T, B]``, RLlib's ``discounts`` (gamma * (1 - terminated)
* loss mask) as the per-step ``gamma``, no episode flags (a zero discount cuts the trace),
``bootstrap_value=bootstrap_values``, ``c_bar=1`` (RLlib's fixed trace clip), ``rho_bar`` and
``rho_bar_pg`` from the clip thresholds (None: no clip).

Where the inputs are outside what the fused scans take (other shapes, a batch of 0 steps, mixed
dtypes or devices, a clip threshold <= 0, non-binary flags) the replacement calls RLlib's own function, so results
and errors are RLlib's. A stateful (recurrent) module makes the connector run RLlib's own.
"""

from __future__ import annotations

import math
import types
from numbers import Real

import numpy as np
import torch

from ._patching import requires_framework

requires_framework(__name__, "Ray RLlib", "ray", extra="rllib")

from ray.rllib.algorithms.appo.torch import appo_torch_learner as _appo  # noqa: E402
from ray.rllib.algorithms.impala.torch import impala_torch_learner as _impala  # noqa: E402
from ray.rllib.algorithms.ppo import ppo_learner as _ppo_learner  # noqa: E402
from ray.rllib.algorithms.ppo.torch import ppo_torch_learner as _ppo_torch  # noqa: E402
from ray.rllib.connectors.learner import general_advantage_estimation as _gae_connector  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI  # noqa: E402
from ray.rllib.evaluation.postprocessing import Postprocessing  # noqa: E402

from .. import gae as _rt_gae  # noqa: E402
from .. import masked_whiten as _rt_masked_whiten  # noqa: E402
from .. import vtrace as _rt_vtrace  # noqa: E402
from ._patching import PatchState  # noqa: E402

__all__ = [
    "APPOTorchLearner",
    "GeneralAdvantageEstimation",
    "IMPALATorchLearner",
    "PPOTorchLearner",
    "call_counts",
    "compute_value_targets",
    "is_patched",
    "patch",
    "patched",
    "unpatch",
    "use_fused_gae",
    "vtrace_torch",
]

# RLlib's objects at the names patch() replaces, kept to restore the very same ones
_ORIGINAL_TARGETS = _gae_connector.compute_value_targets
_ORIGINAL_CONNECTOR = _ppo_learner.GeneralAdvantageEstimation
_ORIGINAL_VTRACE = {_appo: _appo.vtrace_torch, _impala: _impala.vtrace_torch}

# RLlib's advantage standardisation, (A - mean) / max(1e-4, std) with the population std, is
# masked_whiten's clamp mode: 1 / sqrt(max(var, 1e-8)) = 1 / max(1e-4, std)
_RLLIB_WHITEN = {"unbiased": False, "eps": 1e-8, "eps_mode": "clamp"}

# calls of each fused path in this process (the tests read them inside remote Learner actors)
_calls = {"compute_value_targets": 0, "connector": 0, "vtrace_torch": 0}


def call_counts() -> dict:
    """How often each fused path ran in this process: ``{"compute_value_targets": n,
    "connector": n, "vtrace_torch": n}`` (calls that fell back to RLlib's function not counted).
    In the Learner actors, one dict each:
    ``[r.get() for r in algo.learner_group.foreach_learner(lambda _: call_counts())]``."""
    return dict(_calls)


# ---------------------------------------------------------------------------------------------
# compute_value_targets: RLlib's numpy contract
# ---------------------------------------------------------------------------------------------

def _binary_flags(x: np.ndarray):
    """``x`` as bools, or None where it holds something else than 0/1 (RLlib would scale by it)
    or is a float narrower than float64 (RLlib's products with it round gamma to its precision)."""
    if x.dtype == np.bool_:
        return x
    if x.dtype.kind not in "fiu" or (x.dtype.kind == "f" and x.dtype.itemsize < 8):
        return None
    flags = x != 0
    return flags if np.array_equal(flags, x) else None


def compute_value_targets(values, rewards, terminateds, truncateds, gamma: float, lambda_: float):
    """Drop-in for RLlib's ``compute_value_targets``: GAE value targets of a flat batch.

    delta[t] = r[t] + gamma * (1 - terminated[t]) * V[t+1] - V[t]   (V[N] = 0)
    A[t] = delta[t] + gamma * lambda_ * (1 - terminated[t]) * (1 - truncated[t]) * A[t+1],  A[N] = 0

    Returns ``float32(float32(A) + values)``, a float32 numpy array, as RLlib's does; the scan
    runs in float64, as RLlib's loop (whose float64 flags and next values promote it) does.
    Arguments the fused path does not take as they are (not 1-D arrays of one length, flags that
    are not 0/1 or are floats narrower than float64, a gamma or lambda_ outside [0, 1]) go to
    RLlib's function.

    Args:
        values: ``V[t]``, a 1-D float numpy array (or array-like) of the flat batch's N steps.
        rewards: ``r[t]``, a 1-D array of N numbers.
        terminateds: ``terminated[t]``, N flags: ``s_{t+1}`` is terminal (no bootstrap, and the
            trace stops).
        truncateds: ``truncated[t]``, N flags: the episode was cut after step t (the trace stops;
            the step bootstraps from ``V[t+1]``, as RLlib's does).
        gamma: the discount, a Python number.
        lambda_: the GAE lambda, a Python number.
    """
    arrays = [np.asarray(x) for x in (values, rewards, terminateds, truncateds)]
    v, r = arrays[0], arrays[1]
    flags = [_binary_flags(f) for f in arrays[2:]]
    if (v.ndim != 1 or not v.size or any(a.shape != v.shape for a in arrays) or v.dtype.kind != "f"
            or r.dtype.kind not in "fiu" or any(f is None for f in flags)
            or not all(isinstance(x, Real) and not isinstance(x, bool) for x in (gamma, lambda_))):
        return _ORIGINAL_TARGETS(values, rewards, terminateds, truncateds, gamma, lambda_)
    # the float64 copies and the next values in numpy (single-threaded: no torch thread pool for
    # a few hundred kilobytes)
    v64 = v.astype(np.float64, copy=False)
    nv = np.empty_like(v64)
    nv[:-1] = v64[1:]
    nv[-1] = 0.0
    try:
        adv, _ = _rt_gae(torch.from_numpy(r.astype(np.float64, copy=False)), torch.from_numpy(v64),
                         next_values=torch.from_numpy(nv), terminated=torch.from_numpy(flags[0]),
                         truncated=torch.from_numpy(flags[1]), gamma=float(gamma), lmbda=float(lambda_))
    except (TypeError, ValueError):  # e.g. gamma outside [0, 1]: RLlib's loop takes it
        return _ORIGINAL_TARGETS(values, rewards, terminateds, truncateds, gamma, lambda_)
    _calls["compute_value_targets"] += 1
    return (adv.numpy().astype(np.float32) + v).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the device-resident GAE connector
# ---------------------------------------------------------------------------------------------

def _on(x, device):
    return x if isinstance(x, torch.Tensor) and x.device == device else torch.as_tensor(x, device=device)


def _targets_and_advantages(values: torch.Tensor, rewards, terminateds, truncateds, gamma: float, lambda_: float):
    """Value targets and RLlib-standardised advantages of one module's flat batch, on
    ``values``' device: one ``gae`` scan, then ``masked_whiten`` in place. Both float32, as
    RLlib's ``NumpyToTensor`` makes them whatever the module's dtype."""
    v = values.detach()
    device = v.device
    r = _on(rewards, device)
    term, trunc = (_on(f, device) for f in (terminateds, truncateds))
    term, trunc = (f if f.dtype == torch.bool else f != 0 for f in (term, trunc))
    if r.dtype != v.dtype:
        r = r.to(v.dtype)
    nv = torch.cat([v[1:], v.new_zeros(1)])
    adv, targets = _rt_gae(r, v, next_values=nv, terminated=term, truncated=trunc, gamma=gamma, lmbda=lambda_)
    _rt_masked_whiten(adv, out=adv, **_RLLIB_WHITEN)
    return adv.to(torch.float32), targets.to(torch.float32)


class GeneralAdvantageEstimation(_gae_connector.GeneralAdvantageEstimation):
    """RLlib's ``GeneralAdvantageEstimation`` learner connector (same constructor, same batch
    columns: ``Postprocessing.ADVANTAGES`` and ``VALUE_TARGETS``), computed on the Learner's
    device: the value-function forward pass, then per module one fused GAE scan over the flat
    batch and RLlib's standardisation ``(A - mean) / max(1e-4, std)`` in place. Advantages and
    value targets are float32 whatever the module's dtype, as RLlib's. Batches of stateful
    (recurrent) modules, which RLlib zero-pads per sequence, take RLlib's own connector. Its
    constructor is RLlib's (``gamma``, ``lambda_`` and the connector's spaces)."""

    def __call__(self, *, rl_module, episodes, batch, **kwargs):
        def stateful(mid, module):
            return mid in batch and isinstance(module, ValueFunctionAPI) and module.is_stateful()

        if any(rl_module.foreach_module(func=stateful, return_dict=True).values()):
            return super().__call__(rl_module=rl_module, episodes=episodes, batch=batch, **kwargs)
        with torch.no_grad():  # no graph for the forward pass: its values are data here, as RLlib's numpy copy
            values = rl_module.foreach_module(
                func=lambda mid, module: (module.compute_values(batch[mid])
                                          if mid in batch and isinstance(module, ValueFunctionAPI) else None),
                return_dict=True,
            )
            for mid, v in values.items():
                if v is None:
                    continue
                columns = batch[mid]
                adv, targets = _targets_and_advantages(v, columns[Columns.REWARDS], columns[Columns.TERMINATEDS],
                                                       columns[Columns.TRUNCATEDS], float(self.gamma),
                                                       float(self.lambda_))
                columns[Postprocessing.ADVANTAGES] = adv
                columns[Postprocessing.VALUE_TARGETS] = targets
                _calls["connector"] += 1
        return batch


def use_fused_gae(pipeline) -> int:
    """Replace each of RLlib's ``GeneralAdvantageEstimation`` pieces in a learner connector
    pipeline by this module's (same gamma and lambda_, same place); returns how many.

    Args:
        pipeline: an RLlib learner ``ConnectorPipelineV2``, changed in place.
    """
    replaced = 0
    for i, piece in enumerate(pipeline.connectors):
        if type(piece) is _ORIGINAL_CONNECTOR:
            pipeline.connectors[i] = GeneralAdvantageEstimation(
                piece.input_observation_space, piece.input_action_space, gamma=piece.gamma, lambda_=piece.lambda_)
            replaced += 1
    return replaced


# ---------------------------------------------------------------------------------------------
# vtrace_torch
# ---------------------------------------------------------------------------------------------

def _clip(threshold):
    """RLlib's clip threshold as rl_triton's (None: no clip), or None where it is not a number."""
    if threshold is None:
        return math.inf
    if isinstance(threshold, torch.Tensor) and threshold.numel() == 1:
        threshold = threshold.item()  # a host read, as RLlib's config holds Python floats
    if isinstance(threshold, bool) or not isinstance(threshold, Real):
        return None
    return float(threshold)


def vtrace_torch(*, target_action_log_probs, behaviour_action_log_probs, discounts, rewards, values,
                 bootstrap_values, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0):
    """Drop-in for RLlib's ``vtrace_torch`` (``vtrace_torch_v2.py``): returns ``(vs,
    pg_advantages)``, detached, ``[T, B]`` time-major, as RLlib's.

    rho = min(rho_bar, ratio), c = min(1, ratio), ratio = exp(target - behaviour)
    (vs - V)[t] = rho[t] * (r[t] + discounts[t] * V[t+1] - V[t]) + discounts[t] * c[t] * (vs - V)[t+1]
    pg[t] = min(rho_bar_pg, ratio[t]) * (r[t] + discounts[t] * vs[t+1] - V[t]),
    V[T] = vs[T] = bootstrap_values; rho_bar / rho_bar_pg = the clip thresholds (None: inf).

    Arguments the fused path does not take as they are (not tensors of one dtype and device,
    other shapes, a threshold that is not a number, a discount outside [0, 1], a threshold <= 0)
    go to RLlib's function. Every argument is keyword-only, as in RLlib.

    Args:
        target_action_log_probs: the learner policy's log-probabilities of the taken actions,
            ``[T, B]`` time-major.
        behaviour_action_log_probs: the behaviour policy's, ``[T, B]``.
        discounts: ``discounts[t]``, the discount of step t, ``[T, B]`` (0 where the episode
            ends: it cuts the trace and the bootstrap).
        rewards: ``r[t]``, ``[T, B]``.
        values: ``V[t]``, ``[T, B]``, a float tensor; every tensor has its dtype and device.
        bootstrap_values: ``V[T]``, the value after the last step, ``[B]``.
        clip_rho_threshold: ``rho_bar``, a number (or a one-element tensor, read on the host);
            None: no clipping.
        clip_pg_rho_threshold: ``rho_bar_pg``, as ``clip_rho_threshold``.
    """
    kwargs = dict(target_action_log_probs=target_action_log_probs,
                  behaviour_action_log_probs=behaviour_action_log_probs, discounts=discounts, rewards=rewards, values=values, bootstrap_values=bootstrap_values,
                  clip_rho_threshold=clip_rho_threshold, clip_pg_rho_threshold=clip_pg_rho_threshold)
    rho_bar, rho_bar_pg = _clip(clip_rho_threshold), _clip(clip_pg_rho_threshold)
    steps = (target_action_log_probs, behaviour_action_log_probs, discounts, rewards, values)
    if (rho_bar is None or rho_bar_pg is None
            or not all(isinstance(x, torch.Tensor) for x in (*steps, bootstrap_values))
            or values.ndim != 2 or not values.shape[0] or any(x.shape != values.shape for x in steps)
            or bootstrap_values.shape != values.shape[1:]
            or len({x.dtype for x in (*steps, bootstrap_values)}) != 1 or not values.is_floating_point()
            or len({x.device for x in (*steps, bootstrap_values)}) != 1):
        return _ORIGINAL_VTRACE[_impala](**kwargs)
    try:
        with torch.no_grad():
            vs, pg = _rt_vtrace(rewards.detach(), values.detach(), target_action_log_probs.detach(),
                                behaviour_action_log_probs.detach(), bootstrap_value=bootstrap_values.detach(),
                                gamma=discounts.detach(), lmbda=1.0, rho_bar=rho_bar, c_bar=1.0,
                                rho_bar_pg=rho_bar_pg, time_dim=0)
    except (TypeError, ValueError):  # e.g. a threshold <= 0 or a discount outside [0, 1]: RLlib's loop takes it
        return _ORIGINAL_VTRACE[_impala](**kwargs)
    _calls["vtrace_torch"] += 1
    return vs, pg


# ---------------------------------------------------------------------------------------------
# Learner classes: config.learners(learner_class=...)
# ---------------------------------------------------------------------------------------------

def _with_vtrace(fn):
    """A copy of the Learner method ``fn`` whose global ``vtrace_torch`` is this module's; RLlib's
    module and function are left as they are."""
    if "vtrace_torch" not in fn.__code__.co_names:
        raise RuntimeError(f"{fn.__qualname__} does not call vtrace_torch (this module is written against ray 2.60)")
    namespace = {**fn.__globals__, "vtrace_torch": vtrace_torch}
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return copy


class PPOTorchLearner(_ppo_torch.PPOTorchLearner):
    """RLlib's ``PPOTorchLearner`` with this module's device-resident GAE connector in place of
    RLlib's: ``config.learners(learner_class=PPOTorchLearner)``. Works in remote Learner actors,
    where the class is built."""

    def build(self) -> None:
        super().build()
        if self._learner_connector is not None:
            use_fused_gae(self._learner_connector)


class APPOTorchLearner(_appo.APPOTorchLearner):
    """RLlib's ``APPOTorchLearner`` whose loss calls the fused V-trace:
    ``config.learners(learner_class=APPOTorchLearner)``."""

    compute_loss_for_module = _with_vtrace(_appo.APPOTorchLearner.compute_loss_for_module)


class IMPALATorchLearner(_impala.IMPALATorchLearner):
    """RLlib's ``IMPALATorchLearner`` whose loss calls the fused V-trace:
    ``config.learners(learner_class=IMPALATorchLearner)``."""

    compute_loss_for_module = _with_vtrace(_impala.IMPALATorchLearner.compute_loss_for_module)


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------

def _apply() -> None:
    _gae_connector.compute_value_targets = compute_value_targets
    _ppo_learner.GeneralAdvantageEstimation = GeneralAdvantageEstimation
    for module in _ORIGINAL_VTRACE:
        module.vtrace_torch = vtrace_torch


def _restore() -> None:
    _gae_connector.compute_value_targets = _ORIGINAL_TARGETS
    _ppo_learner.GeneralAdvantageEstimation = _ORIGINAL_CONNECTOR
    for module, fn in _ORIGINAL_VTRACE.items():
        module.vtrace_torch = fn


_state = PatchState(_apply, _restore)


def patch() -> None:
    """Route RLlib's GAE and V-trace in this process through rl_triton until ``unpatch()``:
    ``compute_value_targets`` in the GAE connector's module, the ``GeneralAdvantageEstimation``
    class that ``PPOLearner.build`` appends (so PPO Learners built from now on use the
    device-resident connector), and ``vtrace_torch`` in the APPO and IMPALA torch Learners.
    Idempotent. Thread-safe. Learner actors are other processes: use a Learner class of this
    module or ``ray.init(runtime_env={"worker_process_setup_hook": "rl_triton.integrations.rllib.patch"})``.

    The patch is shared with ``patched()`` blocks, which may be open in other threads: RLlib is
    patched while ``patch()`` is in effect or any block is open."""
    _state.patch()


def unpatch() -> None:
    """Withdraw ``patch()``. RLlib's own objects (the same objects) are back at once, or, while
    ``patched()`` blocks are open (in any thread), when the last of them closes. Connectors and
    Learners built while patched keep the pieces they were built with. Idempotent. Thread-safe."""
    _state.unpatch()


def is_patched() -> bool:
    """Whether RLlib's GAE and V-trace are routed through rl_triton in this process now."""
    return _state.active


def patched():
    """``with patched(): ...``: RLlib is patched for the block, and the block's hold on the patch
    ends with it. Blocks nest, also across threads: each holds the patch until it closes, and
    RLlib's own objects come back when the last holder (block or ``patch()``) lets go."""
    return _state.patched()
