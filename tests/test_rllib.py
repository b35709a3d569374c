"""rl_triton.integrations.rllib against RLlib itself (ray 2.60, the rllib extra): the numpy
``compute_value_targets``, the device-resident GAE connector in RLlib's own learner connector
pipeline, ``vtrace_torch``, the Learner classes, and patch()/unpatch()/patched().

No Ray cluster here (the connector pipeline, the RLModule and the episodes run in this process);
tests/test_rllib_actors.py and tests/test_rllib_setup_hook.py run remote Learner actors."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib", reason="needs the rllib extra: pip install -e '.[rllib]'")

import gymnasium as gym  # noqa: E402
from helpers import concurrent_patch_use, nested_blocks_across_threads  # noqa: E402
from ray.rllib.algorithms.appo.torch import appo_torch_learner as rl_appo  # noqa: E402
from ray.rllib.algorithms.impala.torch import impala_torch_learner as rl_impala  # noqa: E402
from ray.rllib.algorithms.impala.torch.vtrace_torch_v2 import vtrace_torch as rllib_vtrace  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.algorithms.ppo import ppo_learner as rl_ppo_learner  # noqa: E402
from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate  # noqa: E402
from ray.rllib.connectors.learner import general_advantage_estimation as rl_gae  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.evaluation.postprocessing import Postprocessing  # noqa: E402
from ray.rllib.utils.postprocessing.value_predictions import compute_value_targets as rllib_targets  # noqa: E402

import rl_triton.integrations.rllib as rt_rllib  # noqa: E402

RLLIB_CONNECTOR = rl_gae.GeneralAdvantageEstimation


def _assert_original():
    assert rl_gae.compute_value_targets is rllib_targets
    assert rl_ppo_learner.GeneralAdvantageEstimation is RLLIB_CONNECTOR
    assert rl_appo.vtrace_torch is rllib_vtrace and rl_impala.vtrace_torch is rllib_vtrace


def _flat_batch(rng, lens, ends, dtype):
    """RLlib's GAE input: episode chunks of ``lens`` steps, each followed by the extra timestep of
    ``AddOneTsToEpisodesAndTruncate`` (reward 0, neither flag); the last real step terminated
    ("term") or truncated (a time limit or the chunk's end: "trunc"), as that connector writes."""
    term, trunc = [], []
    for n, end in zip(lens, ends):
        term += [False] * (n - 1) + [end == "term", False]
        trunc += [False] * (n - 1) + [end == "trunc", False]
    n = len(term)
    values = rng.normal(size=n).astype(dtype)
    rewards = rng.normal(size=n).astype(dtype)
    starts = np.cumsum([0] + [k + 1 for k in lens])[1:] - 1
    rewards[starts] = 0.0
    return values, rewards, np.array(term), np.array(trunc)


def _episode_shape(rng, n_episodes, long=False):
    lens = rng.integers(1, 300 if long else 12, n_episodes).tolist()
    lens[0] = 1  # an episode of length 1
    ends = rng.choice(["term", "trunc"], n_episodes).tolist()
    return lens, ends


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(4))
def test_compute_value_targets_equals_rllib(dtype, seed):
    rng = np.random.default_rng(seed)
    lens, ends = _episode_shape(rng, 40, long=seed % 2 == 1)
    values, rewards, term, trunc = _flat_batch(rng, lens, ends, dtype)
    gamma, lambda_ = [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.0, 0.5)][seed]
    before = rt_rllib.call_counts()["compute_value_targets"]
    ours = rt_rllib.compute_value_targets(values, rewards, term, trunc, gamma, lambda_)
    assert rt_rllib.call_counts()["compute_value_targets"] == before + 1  # the fused path ran
    theirs = rllib_targets(values, rewards, term, trunc, gamma, lambda_)
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    # the same float64 recurrence rounded to float32 at the same places: equal to the bit, bar
    # the rare float64 rounding difference that moves a float32 rounding by one ulp
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=1)
    assert np.mean(ours == theirs) > 0.999


@pytest.mark.parametrize("flag_dtype", [np.float64, np.int64, np.float32])
def test_compute_value_targets_flags_as_numbers_and_mid_batch_cuts(flag_dtype):
    # 0/1 flags as numbers, anywhere in the batch (not only at chunk ends), NaN in the values;
    # float32 flags make RLlib round gamma to float32, so they run RLlib's loop (counted apart)
    rng = np.random.default_rng(7)
    n = 500
    values, rewards = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    term = (rng.random(n) < 0.05).astype(flag_dtype)
    trunc = ((rng.random(n) < 0.05) & (term == 0)).astype(flag_dtype)
    before = rt_rllib.call_counts()["compute_value_targets"]
    np.testing.assert_array_max_ulp(rt_rllib.compute_value_targets(values, rewards, term, trunc, 0.99, 0.9),
                                    rllib_targets(values, rewards, term, trunc, 0.99, 0.9), maxulp=1)
    assert rt_rllib.call_counts()["compute_value_targets"] == before + (flag_dtype != np.float32)
    values[100] = np.nan
    ours = rt_rllib.compute_value_targets(values, rewards, term, trunc, 0.99, 0.9)
    theirs = rllib_targets(values, rewards, term, trunc, 0.99, 0.9)
    # NaN in, NaN out; RLlib's loop multiplies its carry by 0 at a cut (0 * NaN = NaN), so there
    # the NaN reaches every earlier step of the batch, where the scan stops it at the cut
    assert np.isnan(ours[100]) and np.all(np.isnan(theirs[np.isnan(ours)]))
    both = ~np.isnan(theirs)
    np.testing.assert_array_max_ulp(ours[both], theirs[both], maxulp=1)


@pytest.mark.parametrize("case", ["shapes", "2d", "empty", "scaled flags", "gamma > 1", "list"])
def test_compute_value_targets_keeps_rllib_behaviour_outside_the_scan(case):
    # inputs the fused scan does not take run RLlib's own function: its result or its error
    rng = np.random.default_rng(3)
    v, r = rng.normal(size=8).astype(np.float32), rng.normal(size=8).astype(np.float32)
    t = np.zeros(8, bool)
    args = {"shapes": (v, r[:5], t, t, 0.99, 0.95), "2d": (v.reshape(2, 4), r.reshape(2, 4), t.reshape(2, 4),
                                                         t.reshape(2, 4), 0.99, 0.95),
            "empty": (v[:0], r[:0], t[:0], t[:0], 0.99, 0.95), "scaled flags": (v, r, t + 0.5, t, 0.99, 0.95),
            "gamma > 1": (v, r, t, t, 1.5, 0.95), "list": (list(v), r, t, t, 0.99, 0.95)}[case]
    try:
        theirs = rllib_targets(*args)
    except Exception as error:
        with pytest.raises(type(error)) as got:
            rt_rllib.compute_value_targets(*args)
        assert str(got.value) == str(error)
        return
    ours = rt_rllib.compute_value_targets(*args)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------------------------------------
# the connector, in RLlib's own learner pipeline
# ---------------------------------------------------------------------------------------------

ENV = "CartPole-v1"


@pytest.fixture(scope="module")
def ppo_parts():
    env = gym.make(ENV)
    config = PPOConfig().environment(ENV)
    module = config.get_multi_rl_module_spec(env=gym.vector.SyncVectorEnv([lambda: gym.make(ENV)])).build()
    return config, env, module


def _episodes(rng, env, lens, ends):
    episodes = []
    for n, end in zip(lens, ends):
        episodes.append(SingleAgentEpisode(
            observations=list(rng.normal(size=(n + 1, 4)).astype(np.float32)),
            actions=list(rng.integers(0, 2, n)), rewards=list(rng.normal(size=n).astype(np.float32)),
            terminated=end == "term", truncated=end == "trunc", len_lookback_buffer=0,
            observation_space=env.observation_space, action_space=env.action_space).to_numpy())
    return episodes


def _learner_batch(parts, gae_cls, episodes, gamma=0.99, lambda_=0.95):
    """RLlib's default learner pipeline with PPO's two pieces, as PPOLearner.build adds them."""
    config, env, module = parts
    pipeline = config.build_learner_connector(input_observation_space=env.observation_space,
                                              input_action_space=env.action_space)
    pipeline.prepend(AddOneTsToEpisodesAndTruncate())
    pipeline.append(gae_cls(gamma=gamma, lambda_=lambda_))
    return pipeline(rl_module=module, episodes=copy.deepcopy(episodes), batch={}, metrics=None, shared_data={})


@pytest.mark.parametrize("seed", range(3))
def test_connector_equals_rllibs_in_its_pipeline(ppo_parts, seed):
    rng = np.random.default_rng(seed)
    # "none": an episode chunk cut mid-episode (the connector marks it truncated)
    lens = rng.integers(1, 30, 12).tolist()
    lens[seed] = 1
    ends = rng.choice(["term", "trunc", "none"], 12).tolist()
    episodes = _episodes(rng, ppo_parts[1], lens, ends)
    before = rt_rllib.call_counts()["connector"]
    ours = _learner_batch(ppo_parts, rt_rllib.GeneralAdvantageEstimation, episodes)["default_policy"]
    assert rt_rllib.call_counts()["connector"] == before + 1
    theirs = _learner_batch(ppo_parts, RLLIB_CONNECTOR, episodes)["default_policy"]
    assert ours.keys() == theirs.keys()
    for key in (Postprocessing.ADVANTAGES, Postprocessing.VALUE_TARGETS):
        a, b = ours[key], theirs[key]
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
        # float32 scans (RLlib's runs in float64) and a whitening in another order: to rounding
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    for key in ours:
        if key not in (Postprocessing.ADVANTAGES, Postprocessing.VALUE_TARGETS):
            assert torch.equal(ours[key], theirs[key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_connector_math_equals_rllib_on_random_batches(dtype):
    rng = np.random.default_rng(11)
    lens, ends = _episode_shape(rng, 60, long=True)
    values, rewards, term, trunc = _flat_batch(rng, lens, ends, np.float64)
    values *= 5.0
    adv, targets = rt_rllib._targets_and_advantages(torch.from_numpy(values).to(dtype),
                                                    torch.from_numpy(rewards).to(dtype),
                                                    torch.from_numpy(term), torch.from_numpy(trunc), 0.99, 0.95)
    v = values.astype(dtype == torch.float32 and np.float32 or np.float64)
    expected_targets = rllib_targets(v, rewards.astype(v.dtype), term, trunc, 0.99, 0.95)
    # RLlib 2.60, general_advantage_estimation.py, GeneralAdvantageEstimation.__call__ (transcribed)
    a = expected_targets - v
    expected_adv = (a - a.mean()) / max(1e-4, a.std())
    assert targets.dtype == adv.dtype == torch.float32  # as RLlib's NumpyToTensor makes them
    np.testing.assert_allclose(targets.numpy(), expected_targets, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adv.numpy(), expected_adv, rtol=1e-5, atol=1e-5)


def test_connector_columns_are_float32_for_a_float64_module(ppo_parts, monkeypatch):
    """A module whose values are float64: RLlib's connector hands its results to NumpyToTensor,
    which makes float32 columns, and so does the fused connector."""
    policy = ppo_parts[2]["default_policy"]
    compute_values = policy.compute_values
    monkeypatch.setattr(policy, "compute_values", lambda batch, **kw: compute_values(batch, **kw).double())
    rng = np.random.default_rng(5)
    episodes = _episodes(rng, ppo_parts[1], rng.integers(1, 30, 8).tolist(), rng.choice(["term", "trunc"], 8).tolist())
    ours = _learner_batch(ppo_parts, rt_rllib.GeneralAdvantageEstimation, episodes)["default_policy"]
    theirs = _learner_batch(ppo_parts, RLLIB_CONNECTOR, episodes)["default_policy"]
    for key in (Postprocessing.ADVANTAGES, Postprocessing.VALUE_TARGETS):
        a, b = ours[key], theirs[key]
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_connector_normalisation_floor_of_rllib():
    # constant advantages: RLlib divides by max(1e-4, std) = 1e-4, and so does the connector
    n = 64
    values = torch.zeros(n)
    rewards = torch.full((n,), 0.5)
    term = torch.ones(n, dtype=torch.bool)
    adv, _ = rt_rllib._targets_and_advantages(values, rewards, term, torch.zeros(n, dtype=torch.bool), 0.99, 0.95)
    targets = rllib_targets(values.numpy(), rewards.numpy(), term.numpy(), np.zeros(n, bool), 0.99, 0.95)
    a = targets - values.numpy()
    np.testing.assert_allclose(adv.numpy(), (a - a.mean()) / max(1e-4, a.std()), atol=1e-6)


def test_connector_hands_stateful_modules_to_rllibs(ppo_parts, monkeypatch):
    # RLlib zero-pads a recurrent module's batch per sequence: that batch goes to RLlib's connector
    module = ppo_parts[2]
    monkeypatch.setattr(type(module["default_policy"]), "is_stateful", lambda self: True)
    seen = []
    monkeypatch.setattr(RLLIB_CONNECTOR, "__call__", lambda self, **kw: seen.append(kw) or kw["batch"])
    batch = {"default_policy": {}}
    before = rt_rllib.call_counts()
    out = rt_rllib.GeneralAdvantageEstimation(gamma=0.99, lambda_=0.95)(rl_module=module, episodes=[], batch=batch)
    assert out is batch and len(seen) == 1 and seen[0]["batch"] is batch
    assert rt_rllib.call_counts() == before


def test_use_fused_gae_replaces_rllibs_piece_in_place(ppo_parts):
    config, env, _ = ppo_parts
    pipeline = config.build_learner_connector(input_observation_space=env.observation_space,
                                              input_action_space=env.action_space)
    pipeline.append(RLLIB_CONNECTOR(gamma=0.9, lambda_=0.8))
    names = [type(c).__name__ for c in pipeline.connectors]
    assert rt_rllib.use_fused_gae(pipeline) == 1
    assert [type(c).__name__ for c in pipeline.connectors] == names  # same name, same place
    piece = pipeline.connectors[-1]
    assert type(piece) is rt_rllib.GeneralAdvantageEstimation and (piece.gamma, piece.lambda_) == (0.9, 0.8)
    assert rt_rllib.use_fused_gae(pipeline) == 0


# ---------------------------------------------------------------------------------------------
# vtrace_torch
# ---------------------------------------------------------------------------------------------

def _vtrace_inputs(T, B, dtype, seed, p_term=0.1):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    terminated = torch.rand(T, B, generator=g) < p_term  # terminals mid-row
    loss_mask = torch.rand(T, B, generator=g) > 0.05  # the appended bootstrap steps, as APPO masks them
    discounts = (1.0 - terminated.to(dtype)) * 0.99 * loss_mask.to(dtype)
    return dict(target_action_log_probs=randn(T, B) * 0.7, behaviour_action_log_probs=randn(T, B) * 0.7,
                discounts=discounts, rewards=randn(T, B), values=randn(T, B), bootstrap_values=randn(B))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clips", [(None, None), (1.0, 1.0), (0.7, 2.0), (math.inf, 0.5), (None, 1.0)])
def test_vtrace_equals_rllib(dtype, clips):
    kwargs = _vtrace_inputs(50, 24, dtype, seed=hash(clips) % 1000)
    kwargs.update(clip_rho_threshold=clips[0], clip_pg_rho_threshold=clips[1])
    before = rt_rllib.call_counts()["vtrace_torch"]
    ours = rt_rllib.vtrace_torch(**kwargs)
    assert rt_rllib.call_counts()["vtrace_torch"] == before + 1
    theirs = rllib_vtrace(**kwargs)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape and not a.requires_grad
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_vtrace_detaches_like_rllib_and_threshold_tensors():
    kwargs = _vtrace_inputs(16, 4, torch.float32, seed=5)
    kwargs["target_action_log_probs"].requires_grad_(True)
    kwargs["values"].requires_grad_(True)
    kwargs.update(clip_rho_threshold=torch.tensor(1.0), clip_pg_rho_threshold=torch.tensor(0.8))
    ours, theirs = rt_rllib.vtrace_torch(**kwargs), rllib_vtrace(**kwargs)
    for a, b in zip(ours, theirs):
        assert not a.requires_grad and a.grad_fn is None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bootstrap shape", "step shapes", "threshold 0", "mixed dtypes", "numpy",
                                  "0 steps"])
def test_vtrace_keeps_rllib_behaviour_outside_the_scan(case):
    kwargs = _vtrace_inputs(0 if case == "0 steps" else 8, 3, torch.float32, seed=2)
    if case == "bootstrap shape":
        kwargs["bootstrap_values"] = kwargs["bootstrap_values"][:2]
    elif case == "step shapes":
        kwargs["rewards"] = kwargs["rewards"][:5]
    elif case == "threshold 0":
        kwargs["clip_rho_threshold"] = 0.0
    elif case == "mixed dtypes":
        kwargs["rewards"] = kwargs["rewards"].double()
    elif case == "numpy":
        kwargs["rewards"] = kwargs["rewards"].numpy()
    try:
        theirs = rllib_vtrace(**kwargs)
    except Exception as error:
        with pytest.raises(type(error)) as got:
            rt_rllib.vtrace_torch(**kwargs)
        assert str(got.value) == str(error)
        return
    ours = rt_rllib.vtrace_torch(**kwargs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_vtrace_nan_in_nan_out():
    kwargs = _vtrace_inputs(12, 3, torch.float32, seed=4, p_term=0.0)
    kwargs["rewards"][5, 1] = float("nan")
    ours, theirs = rt_rllib.vtrace_torch(**kwargs), rllib_vtrace(**kwargs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())



def test_vtrace_nan_stops_at_a_zero_discount():
    """A NaN reward after a terminal (discount 0 at step 4) in its row: RLlib's loop multiplies
    the carried (vs - V) by the 0 discount (0 * NaN = NaN), so vs and the policy-gradient
    advantages are NaN at every earlier step of the row. rl_triton's scan stops the NaN at the
    zero coefficient (docs/semantics.md, section 11 (c)): vs up to step 4 and the advantages up
    to step 3 are RLlib's results of the rollout with that reward finite; the advantage of step
    4 reads vs[5] through its 0 discount, plain arithmetic (section 11 (e)), and is NaN."""
    kwargs = _vtrace_inputs(12, 3, torch.float64, seed=6, p_term=0.0)
    kwargs["discounts"][:, 1] = 0.99
    kwargs["discounts"][4, 1] = 0.0
    finite = rllib_vtrace(**{**kwargs, "rewards": kwargs["rewards"].clone()})
    kwargs["rewards"][8, 1] = float("nan")
    ours, theirs = rt_rllib.vtrace_torch(**kwargs), rllib_vtrace(**kwargs)
    for a, b, c, steps in zip(ours, theirs, finite, (5, 4)):
        assert b[:9, 1].isnan().all() and a[steps:9, 1].isnan().all()
        assert torch.equal(a[5:].isnan(), b[5:].isnan())
        torch.testing.assert_close(a[:steps], c[:steps], rtol=1e-12, atol=1e-12)


def test_learner_classes_call_the_fused_vtrace():
    for ours, theirs in ((rt_rllib.APPOTorchLearner, rl_appo.APPOTorchLearner),
                         (rt_rllib.IMPALATorchLearner, rl_impala.IMPALATorchLearner)):
        assert issubclass(ours, theirs)
        fn, original = ours.compute_loss_for_module, theirs.compute_loss_for_module
        assert fn.__code__ is original.__code__  # RLlib's loss, line for line
        assert fn.__globals__["vtrace_torch"] is rt_rllib.vtrace_torch
        assert original.__globals__["vtrace_torch"] is rllib_vtrace  # RLlib's module untouched
    _assert_original()


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------

def _routes_ours():
    return (rl_gae.compute_value_targets is rt_rllib.compute_value_targets
            and rl_ppo_learner.GeneralAdvantageEstimation is rt_rllib.GeneralAdvantageEstimation
            and rl_appo.vtrace_torch is rt_rllib.vtrace_torch and rl_impala.vtrace_torch is rt_rllib.vtrace_torch)


def test_patch_unpatch_round_trip():
    _assert_original()
    assert not rt_rllib.is_patched()
    rt_rllib.patch()
    rt_rllib.patch()  # idempotent
    assert rt_rllib.is_patched() and _routes_ours()
    rt_rllib.unpatch()
    rt_rllib.unpatch()
    assert not rt_rllib.is_patched()
    _assert_original()
    with rt_rllib.patched():
        with rt_rllib.patched():
            assert _routes_ours()
        assert _routes_ours()
    _assert_original()


def test_patch_reaches_rllibs_connector_module(ppo_parts):
    # RLlib's own connector, built before the patch, runs ours through its module global
    rng = np.random.default_rng(0)
    episodes = _episodes(rng, ppo_parts[1], [4, 1, 7], ["term", "trunc", "none"])
    theirs = _learner_batch(ppo_parts, RLLIB_CONNECTOR, episodes)["default_policy"]
    before = rt_rllib.call_counts()["compute_value_targets"]
    with rt_rllib.patched():
        ours = _learner_batch(ppo_parts, RLLIB_CONNECTOR, episodes)["default_policy"]
    assert rt_rllib.call_counts()["compute_value_targets"] == before + 1
    for key in (Postprocessing.ADVANTAGES, Postprocessing.VALUE_TARGETS):
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6)
    _assert_original()


def test_patched_blocks_nest_across_threads():
    assert nested_blocks_across_threads(rt_rllib.patched, _routes_ours) == [True]
    _assert_original()


def test_patch_state_under_concurrent_use():
    assert not concurrent_patch_use(rt_rllib.patched, rt_rllib.patch, rt_rllib.unpatch, _routes_ours, rounds=30)
    assert not rt_rllib.is_patched()
    _assert_original()


def test_gpu_benchmark_transcriptions_equal_rllib(monkeypatch):
    # benchmarks/rllib_gpu.py runs where Ray is not installed, on its copies of RLlib's two loops
    import importlib.util
    import os

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    monkeypatch.syspath_prepend(folder)
    path = os.path.join(folder, "rllib_gpu.py")
    spec = importlib.util.spec_from_file_location("rllib_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for clips in ((1.0, 1.0), (None, 0.5)):
        kwargs = _vtrace_inputs(20, 5, torch.float32, seed=8)
        kwargs.update(clip_rho_threshold=clips[0], clip_pg_rho_threshold=clips[1])
        for a, b in zip(bench.rllib_vtrace(**kwargs), rllib_vtrace(**kwargs)):
            assert torch.equal(a, b)
    rng = np.random.default_rng(2)
    args = (*_flat_batch(rng, *_episode_shape(rng, 30), np.float32), 0.99, 0.95)
    np.testing.assert_array_equal(bench.rllib_value_targets(*args), rllib_targets(*args))
    # and its rl_triton calls are the integration's
    k = _vtrace_inputs(20, 5, torch.float32, seed=9)
    k.update(clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0)
    for a, b in zip(bench.rl_triton_vtrace(k), rt_rllib.vtrace_torch(**k)):
        assert torch.equal(a, b)
    v, r, te, tr = (torch.from_numpy(x) for x in _flat_batch(rng, *_episode_shape(rng, 30), np.float32))
    for a, b in zip(bench.rl_triton_gae_step(v, r, te, tr), rt_rllib._targets_and_advantages(v, r, te, tr, 0.99, 0.95)):
        assert torch.equal(a, b)
