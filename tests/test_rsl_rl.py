"""rsl_rl integration against the installed rsl-rl-lib (the pinned 5.5.1 of the ``rsl_rl`` extra;
.ci/run runs this file again with 3.1.3 first on the path, the older layout whose loop is
``RolloutStorage.compute_returns``): the same returns and advantages as rsl_rl's own method on
random rollouts with dones (time-outs are folded into the rewards before it runs), float32 and
float64, feed-forward and recurrent critics, per-mini-batch normalisation; the float64 oracle;
the patch contract; the config route through ``OnPolicyRunner``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

rsl_rl = pytest.importorskip("rsl_rl")
TensorDict = pytest.importorskip("tensordict").TensorDict

import rl_triton.integrations.rsl_rl as rt_rsl  # noqa: E402
from rl_triton.testing import oracle  # noqa: E402

from helpers import concatenated_normalisation, spawn_gloo  # noqa: E402

F64, F32 = torch.float64, torch.float32
# rsl_rl's loop forms (1 - dones).float() * gamma, so with float64 storage (torch's default dtype
# set to float64) its gamma and gamma * lam are rounded to float32: 1e-6 apart from the float64
# recurrence, which rl_triton computes (test_matches_the_oracle: 1e-12)
TOL = {F64: 5e-6, F32: 2e-5}
OLD = rt_rsl.STORAGE_LAYOUT  # rsl-rl-lib up to 3.1
PATCH_POINT = rsl_rl.storage.RolloutStorage if OLD else rsl_rl.algorithms.PPO


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_rsl.unpatch()


def _ppo(T, N, dtype, recurrent=False, per_mini_batch=False, gamma=0.99, lam=0.95, seed=0, cls=None, **cls_kw):
    """A real rsl_rl PPO (``cls``, default rsl_rl's, with ``cls_kw``) with its own storage and
    models (the installed version's API), the storage filled with a random rollout; returns
    (ppo, obs)."""
    cls_ppo = cls or rsl_rl.algorithms.PPO
    torch.manual_seed(seed)
    obs = TensorDict({"policy": torch.randn(N, 3, dtype=dtype)}, batch_size=[N])
    groups = {"policy" if OLD else "actor": ["policy"], "critic": ["policy"]}
    kw = dict(gamma=gamma, lam=lam, normalize_advantage_per_mini_batch=per_mini_batch)
    if OLD:
        from rsl_rl.modules import ActorCritic, ActorCriticRecurrent

        cls = ActorCriticRecurrent if recurrent else ActorCritic
        extra = dict(rnn_hidden_dim=4, rnn_type="gru") if recurrent else {}
        policy = cls(obs, groups, 2, actor_hidden_dims=[8], critic_hidden_dims=[8], **extra).to(dtype)
        ppo = cls_ppo(policy, **kw, **cls_kw)
        ppo.init_storage("rl", N, T, obs, [2])
    else:
        from rsl_rl.models import MLPModel, RNNModel

        actor = MLPModel(obs, groups, "actor", 2, hidden_dims=[8], distribution_cfg={"class_name": "GaussianDistribution"})
        critic = (RNNModel(obs, groups, "critic", 1, hidden_dims=[8], rnn_type="gru", rnn_hidden_dim=4) if recurrent
                  else MLPModel(obs, groups, "critic", 1, hidden_dims=[8]))
        storage = rsl_rl.storage.RolloutStorage("rl", N, T, obs, [2], "cpu")
        ppo = cls_ppo(actor.to(dtype), critic.to(dtype), storage, **kw, **cls_kw)
    st = ppo.storage
    g = torch.Generator().manual_seed(seed + 1)
    st.rewards = torch.randn(T, N, 1, generator=g, dtype=F64).to(dtype)
    st.values = torch.randn(T, N, 1, generator=g, dtype=F64).to(dtype)
    st.dones = (torch.rand(T, N, 1, generator=g) < 0.15).byte()
    st.returns = torch.zeros(T, N, 1, dtype=dtype)
    if recurrent:  # a hidden state that the bootstrap pass must leave as the installed version leaves it
        _critic_forward(ppo, obs)
    return ppo, obs


def _critic_forward(ppo, obs):
    return ppo.policy.evaluate(obs) if OLD else ppo.critic(obs)


def _hidden(ppo):
    if OLD:
        state = ppo.policy.get_hidden_states()[1] if ppo.policy.is_recurrent else None
    else:
        state = ppo.critic.get_hidden_state()
    return None if state is None else state.clone()


def _run(ppo, obs, method):
    """``method`` on a copy of the rollout state: (returns, advantages, critic hidden state)."""
    st = ppo.storage
    saved = st.returns.clone(), _hidden(ppo)
    method(ppo, obs)
    result = st.returns.clone(), st.advantages.clone(), _hidden(ppo)
    st.returns.copy_(saved[0])
    if saved[1] is not None:  # the state before the call, for the next method
        (ppo.policy.memory_c if OLD else ppo.critic.rnn).hidden_state = saved[1].clone()
    return result


def _original(ppo, obs):
    if OLD:  # PPO's own method, the storage's own loop
        with_original = rt_rsl._ORIGINAL
        last = ppo.policy.evaluate(obs).detach()
        with_original(ppo.storage, last, ppo.gamma, ppo.lam, not ppo.normalize_advantage_per_mini_batch)
    else:
        rt_rsl._ORIGINAL(ppo, obs)


def _close(a, b, dtype):
    torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape", [(24, 64), (1, 5), (7, 300)])
@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("per_mini_batch", [False, True])
def test_matches_rsl_rl(dtype, shape, recurrent, per_mini_batch):
    ppo, obs = _ppo(*shape, dtype, recurrent, per_mini_batch, seed=shape[1])
    want = _run(ppo, obs, _original)
    routes = [rt_rsl.PPO.compute_returns]
    routes.append(lambda p, o: rt_rsl.storage_compute_returns(p.storage, p.policy.evaluate(o).detach(), p.gamma,
                                                              p.lam, not p.normalize_advantage_per_mini_batch)
                  if OLD else rt_rsl.compute_returns(p, o))
    for route in routes:
        got = _run(ppo, obs, route)
        _close(got[0], want[0], dtype)
        _close(got[1], want[1], dtype)
        assert got[0].dtype == got[1].dtype == dtype and got[1].shape == want[1].shape
        if recurrent:  # the bootstrap pass leaves the critic's state as rsl_rl's method does
            torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_matches_the_oracle(gamma, lam):
    """float64 against the oracle's GAE and the normalisation formula (docs/semantics.md 15)."""
    T, N = 16, 40
    ppo, obs = _ppo(T, N, F64, gamma=gamma, lam=lam, seed=3)
    st = ppo.storage
    last = _critic_forward(ppo, obs).detach()
    rt_rsl.PPO.compute_returns(ppo, obs)
    rows = lambda x: x[..., 0].T.numpy()  # noqa: E731
    d = rows(st.dones.double())
    nv = np.concatenate([rows(st.values)[:, 1:], last.numpy()], 1)
    adv, ret = oracle.gae(rows(st.rewards), rows(st.values), nv, d, d, np.full((N, T), gamma), np.full((N, T), lam))
    np.testing.assert_allclose(rows(st.returns), ret, rtol=1e-12, atol=1e-12)
    norm = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    np.testing.assert_allclose(rows(st.advantages), norm, rtol=1e-12, atol=1e-12)


def test_time_outs_reach_the_returns_through_the_rewards():
    """process_env_step folds ``gamma * V(s_t) * time_outs`` into the stored reward; the fused
    method reads that reward as rsl_rl's loop does."""
    ppo, obs = _ppo(4, 6, F32)
    st = ppo.storage
    st.step = 0
    st.rewards.zero_()
    for t in range(4):
        ppo.act(obs)
        time_outs = torch.zeros(6)
        time_outs[t] = 1.0
        ppo.process_env_step(obs, torch.ones(6), (time_outs > 0), {"time_outs": time_outs})
    want = _run(ppo, obs, _original)
    got = _run(ppo, obs, rt_rsl.PPO.compute_returns)
    _close(got[0], want[0], F32)
    _close(got[1], want[1], F32)
    assert not torch.equal(st.rewards, torch.ones_like(st.rewards))  # the time-outs did bootstrap


def test_patch_roundtrip_and_idempotence():
    original = PATCH_POINT.__dict__["compute_returns"]
    assert not rt_rsl.is_patched()
    rt_rsl.patch()
    rt_rsl.patch()
    assert rt_rsl.is_patched()
    assert PATCH_POINT.compute_returns is (rt_rsl.storage_compute_returns if OLD else rt_rsl.compute_returns)
    rt_rsl.unpatch()
    rt_rsl.unpatch()
    assert PATCH_POINT.__dict__["compute_returns"] is original and not rt_rsl.is_patched()
    with rt_rsl.patched():
        with rt_rsl.patched():
            assert rt_rsl.is_patched()
        assert rt_rsl.is_patched()
    assert PATCH_POINT.__dict__["compute_returns"] is original
    rt_rsl.patch()
    with rt_rsl.patched():
        pass
    assert rt_rsl.is_patched()  # an inner block leaves an outer patch() alone


def test_patched_method_matches(monkeypatch):
    """Through the patch, the framework's own entry point (PPO.compute_returns) calls the fused path."""
    calls = []
    inner = rt_rsl.gae
    monkeypatch.setattr(rt_rsl, "gae", lambda *a, **k: calls.append(1) or inner(*a, **k))
    ppo, obs = _ppo(9, 20, F32, seed=4)
    want = _run(ppo, obs, lambda p, o: rsl_rl.algorithms.PPO.compute_returns(p, o))
    assert calls == []
    with rt_rsl.patched():
        got = _run(ppo, obs, lambda p, o: rsl_rl.algorithms.PPO.compute_returns(p, o))
    assert calls == [1]
    _close(got[0], want[0], F32)
    _close(got[1], want[1], F32)


def test_patch_holders_across_threads():
    original = PATCH_POINT.__dict__["compute_returns"]
    opened, release = threading.Event(), threading.Event()

    def block():
        with rt_rsl.patched():
            opened.set()
            release.wait(5)

    thread = threading.Thread(target=block)
    thread.start()
    opened.wait(5)
    assert rt_rsl.is_patched()
    with rt_rsl.patched():
        release.set()
        thread.join()
        assert rt_rsl.is_patched()  # the other thread's block closed; this one holds the patch
    assert PATCH_POINT.__dict__["compute_returns"] is original


def test_unmapped_storage_runs_rsl_rls_own_method():
    """Storage that these versions do not allocate (here float64 returns for float32 values) goes
    to rsl_rl's method, which keeps its own behaviour."""
    ppo, obs = _ppo(5, 8, F32, seed=6)
    ppo.storage.returns = ppo.storage.returns.double()
    want = _run(ppo, obs, _original)
    got = _run(ppo, obs, rt_rsl.PPO.compute_returns)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


class _RandomEnv(rsl_rl.env.VecEnv):
    """A VecEnv of random observations and rewards, episodes of random length."""

    def __init__(self, num_envs=16):
        self.num_envs, self.num_actions, self.max_episode_length = num_envs, 2, 10
        self.device, self.cfg = "cpu", {}
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
        self._g = torch.Generator().manual_seed(0)

    def get_observations(self):
        return TensorDict({"policy": torch.randn(self.num_envs, 3, generator=self._g)}, batch_size=[self.num_envs])

    def step(self, actions):
        self.episode_length_buf += 1
        time_outs = self.episode_length_buf >= self.max_episode_length
        dones = time_outs | (torch.rand(self.num_envs, generator=self._g) < 0.05)
        self.episode_length_buf[dones] = 0
        return self.get_observations(), torch.randn(self.num_envs, generator=self._g), dones, {"time_outs": time_outs}


@pytest.mark.skipif(OLD, reason="runners up to 3.1 build the algorithm with eval(class_name)")
def test_class_name_route_through_the_runner(monkeypatch):
    calls = []
    inner = rt_rsl.gae
    monkeypatch.setattr(rt_rsl, "gae", lambda *a, **k: calls.append(1) or inner(*a, **k))
    from rsl_rl.runners import OnPolicyRunner

    cfg = {
        "num_steps_per_env": 8, "save_interval": 100, "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "algorithm": {"class_name": "rl_triton.integrations.rsl_rl:PPO", "num_learning_epochs": 1,
                      "num_mini_batches": 2},
        "actor": {"class_name": "MLPModel", "hidden_dims": [8],
                  "distribution_cfg": {"class_name": "GaussianDistribution"}},
        "critic": {"class_name": "MLPModel", "hidden_dims": [8]},
    }
    runner = OnPolicyRunner(_RandomEnv(), cfg, log_dir=None, device="cpu")
    assert type(runner.alg) is rt_rsl.PPO
    runner.learn(2)
    assert calls == [1, 1]
    assert torch.isfinite(runner.alg.storage.advantages).all()


def _patched_entry(ppo, obs):
    """rsl_rl's own entry point (``PPO.compute_returns``) with ``patch()`` in effect."""
    with rt_rsl.patched():
        rsl_rl.algorithms.PPO.compute_returns(ppo, obs)


@pytest.mark.parametrize("returns", ["float64", "two per step"])
def test_unmapped_storage_under_patch_runs_rsl_rls_own_method(returns):
    """With ``patch()`` in effect, a storage the drop-in does not map (float64 returns for
    float32 values, or returns ``[T, N, 2]``) runs rsl_rl's method as it was before patching:
    rsl_rl's result, exactly."""
    ppo, obs = _ppo(5, 8, F32, seed=6)
    st = ppo.storage
    st.returns = st.returns.double() if returns == "float64" else torch.zeros(5, 8, 2)
    want = _run(ppo, obs, _original)
    for route in (_patched_entry, lambda p, o: rt_rsl.PPO.compute_returns(p, o)):
        with rt_rsl.patched():
            got = _run(ppo, obs, route)
        for a, b in zip(got[:2], want[:2]):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_critic_of_two_outputs_raises_rsl_rls_error():
    """A critic with 2 outputs for 1-value storage: rsl_rl's RuntimeError, from every route."""
    ppo, obs = _ppo(5, 8, F32, seed=7)
    if OLD:
        ppo.policy.critic = torch.nn.Linear(3, 2)
    else:
        from rsl_rl.models import MLPModel

        ppo.critic = MLPModel(obs, {"actor": ["policy"], "critic": ["policy"]}, "critic", 2, hidden_dims=[8])
    with pytest.raises(RuntimeError) as want:
        _original(ppo, obs)
    routes = [_patched_entry, lambda p, o: rt_rsl.PPO.compute_returns(p, o)]
    if OLD:
        routes.append(lambda p, o: rt_rsl.storage_compute_returns(p.storage, p.policy.evaluate(o).detach(), p.gamma,
                                                                  p.lam))
    else:
        routes.append(rt_rsl.compute_returns)
    for route in routes:
        with pytest.raises(RuntimeError) as got:
            route(ppo, obs)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_nan_stops_at_the_episode_end():
    """A NaN reward after an episode end in its row: rsl_rl's loop multiplies the carried
    advantage by ``1 - dones`` (0 * NaN = NaN), so its returns and advantages are NaN at every
    earlier step of the row; rl_triton stops the NaN at the episode end (docs/semantics.md,
    section 11), where the earlier steps are rsl_rl's results of the rollout with that reward
    finite. (With the normalisation over the whole batch every advantage is NaN in both.)"""
    ppo, obs = _ppo(10, 6, F32, per_mini_batch=True, seed=8)
    st = ppo.storage
    st.dones.zero_()
    st.dones[4, 2] = 1  # the episode of env 2 ends at step 4
    finite = _run(ppo, obs, _original)
    st.rewards[7, 2] = float("nan")
    theirs, ours = _run(ppo, obs, _original), _run(ppo, obs, rt_rsl.PPO.compute_returns)
    for a, b, c in zip(ours[:2], theirs[:2], finite[:2]):
        assert b[:8, 2].isnan().all() and a[5:8, 2].isnan().all()
        assert torch.equal(a[5:].isnan(), b[5:].isnan())
        _close(a[:5], c[:5], F32)


# -- global_normalisation: the statistics over the ranks ---------------------------------------------
def _normalisation_worker(rank, world, group, dtype):
    """Rank k holds a rollout of 12 steps and 5 + k environments: with global_normalisation the
    advantages are normalised with the statistics of all ranks' rollouts concatenated (rsl_rl's
    own loop for the raw advantages, the float64 formula for the statistics), by patch() and by
    the PPO class; without it, as rsl_rl's method, with this rank's own."""
    T, envs = 12, [5 + k for k in range(world)]
    raw = [_run(*_ppo(T, envs[k], dtype, per_mini_batch=True, seed=20 + k), _original)[1].double().numpy()
           for k in range(world)]
    want = torch.from_numpy(concatenated_normalisation(raw)[rank]).to(dtype)
    ppo, obs = _ppo(T, envs[rank], dtype, seed=20 + rank)
    local = _run(ppo, obs, _original)[1]
    assert not torch.allclose(local, want, rtol=1e-3, atol=1e-3)  # the two statistics differ here
    for setting in (True, group):
        rt_rsl.patch(global_normalisation=setting)
        got = _run(ppo, obs, lambda p, o: p.compute_returns(o))[1]
        _close(got, want, dtype)
        assert got.dtype == dtype
        theirs, obs_cls = _ppo(T, envs[rank], dtype, seed=20 + rank, cls=rt_rsl.PPO, global_normalisation=setting)
        _close(_run(theirs, obs_cls, rt_rsl.PPO.compute_returns)[1], want, dtype)
    rt_rsl.patch()  # the setting back to the default: this rank's statistics, as rsl_rl's
    _close(_run(ppo, obs, lambda p, o: p.compute_returns(o))[1], local, dtype)
    rt_rsl.unpatch()
    # a storage the drop-in hands to rsl_rl's own method (float64 returns for float32 values):
    # its advantages, returns minus values, normalised again over the ranks
    if dtype == F32:
        def unmapped(k, per_mini_batch):
            ppo_k, obs_k = _ppo(T, envs[k], dtype, per_mini_batch=per_mini_batch, seed=20 + k)
            ppo_k.storage.returns = ppo_k.storage.returns.double()
            return ppo_k, obs_k

        raw = [_run(*unmapped(k, True), _original)[1].numpy() for k in range(world)]
        want = torch.from_numpy(concatenated_normalisation(raw)[rank])
        with rt_rsl.patched(global_normalisation=True):
            got = _run(*unmapped(rank, False), lambda p, o: p.compute_returns(o))[1]
        assert got.dtype == F64
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("world,dtype", [(2, F64), (3, F32)])
def test_global_normalisation_over_ranks(world, dtype):
    spawn_gloo(_normalisation_worker, world, dtype)


def test_global_normalisation_without_process_group_is_local():
    """True in a process without torch.distributed initialised: its rollout is the whole batch."""
    ppo, obs = _ppo(10, 7, F64, seed=4)
    want = _run(ppo, obs, _original)
    rt_rsl.patch(global_normalisation=True)
    got = _run(ppo, obs, lambda p, o: p.compute_returns(o))
    _close(got[1], want[1], F64)
    _close(got[0], want[0], F64)


def test_global_normalisation_rejects_other_values():
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_rsl.patch(global_normalisation=bad)
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_rsl.patched(global_normalisation=bad)
        with pytest.raises(TypeError, match="global_normalisation"):
            _ppo(4, 3, F64, cls=rt_rsl.PPO, global_normalisation=bad)
    assert not rt_rsl.is_patched()
