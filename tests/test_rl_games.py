"""rl_games integration: the same advantages as rl_games' own ``A2CBase.discount_values`` and
``discount_values_masks`` (value heads, float32 and float64, its episode-start flags), rl_games'
errors and other forms, the patch contract, and PPO trained through rl_games' Runner both ways
(patched, and through the agent registry)."""

import types

import pytest
import torch

gym = pytest.importorskip("gymnasium")
pytest.importorskip("rl_games")
from rl_games.common.a2c_common import A2CBase  # noqa: E402

import rl_triton.integrations.rl_games as rt_rl_games  # noqa: E402
from helpers import concatenated_normalisation, count_calls, held_in_thread, spawn_gloo  # noqa: E402

F64 = torch.float64

ORIGINALS = {name: A2CBase.__dict__[name] for name in ("discount_values", "discount_values_masks")}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_rl_games.unpatch()
    assert all(A2CBase.__dict__[name] is fn for name, fn in ORIGINALS.items())


def _rollout(T, N, K, dtype, seed, p_done=0.15, p_mask=0.8):
    """rl_games' arguments, as ``play_steps`` builds them: float flags, [T, N, K] values."""
    g = torch.Generator().manual_seed(seed)
    agent = types.SimpleNamespace(horizon_length=T, gamma=0.97, tau=0.9)
    fdones = (torch.rand(N, generator=g) < 0.3).float()
    last_values = torch.randn(N, K, generator=g, dtype=dtype)
    mb_fdones = (torch.rand(T, N, generator=g) < p_done).float()
    mb_fdones[0] = 1.0  # the rollout's first observation starts an episode in every row
    mb_values = torch.randn(T, N, K, generator=g, dtype=dtype)
    mb_rewards = torch.randn(T, N, K, generator=g, dtype=dtype)
    mb_masks = (torch.rand(T, N, generator=g) < p_mask).float()
    return agent, (fdones, last_values, mb_fdones, mb_values, mb_rewards), mb_masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,N,K", [(1, 1, 1), (1, 4, 2), (7, 3, 1), (16, 64, 1), (24, 32, 3)])
@pytest.mark.parametrize("gamma,tau", [(0.97, 0.9), (1.0, 1.0), (0.0, 0.5), (0.99, 0.0)])
def test_discount_values_matches_rl_games(dtype, T, N, K, gamma, tau):
    agent, args, masks = _rollout(T, N, K, dtype, T * 100 + N + K)
    agent.gamma, agent.tau = gamma, tau
    ours = rt_rl_games.discount_values(agent, *args)
    theirs = ORIGINALS["discount_values"](agent, *args)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, **TOL[dtype])
    ours = rt_rl_games.discount_values_masks(agent, *args, masks)
    theirs = ORIGINALS["discount_values_masks"](agent, *args, masks)
    torch.testing.assert_close(ours, theirs, **TOL[dtype])


def test_benchmark_transcriptions_are_rl_games():
    # benchmarks/skrl_rl_games.py times these copies where rl_games is not installed
    from rl_games.common.a2c_common import swap_and_flatten01

    from rl_triton.testing import sim_frameworks

    agent, args, _ = _rollout(16, 8, 3, torch.float32, 10)
    adv = ORIGINALS["discount_values"](agent, *args)
    assert torch.equal(sim_frameworks.rl_games_discount_values(agent, *args), adv)
    returns, values = swap_and_flatten01(adv + args[3]), swap_and_flatten01(args[3])
    expected = torch.sum(returns - values, axis=1)
    expected = (expected - expected.mean()) / (expected.std() + 1e-8)
    assert torch.equal(sim_frameworks.rl_games_normalized_advantages(returns, values), expected)


@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_masks_all_off_and_kinds(mask_dtype, flag_dtype):
    agent, args, masks = _rollout(12, 8, 2, torch.float64, 1, p_mask=0.5)
    args = (args[0].to(flag_dtype), args[1], args[2].to(flag_dtype), *args[3:])  # the dones as stored
    masks[:, 0] = 0  # a row with every step masked
    masks[-1] = 0  # the window's last step masked
    masks = masks.to(mask_dtype)
    ours = rt_rl_games.discount_values_masks(agent, *args, masks)
    theirs = ORIGINALS["discount_values_masks"](agent, *args, masks)
    torch.testing.assert_close(ours, theirs, **TOL[torch.float64])
    assert (ours[:, 0] == 0).all()


def test_other_forms_take_rl_games_loop(monkeypatch):
    calls = count_calls(monkeypatch, rt_rl_games)
    agent, (fdones, last_values, mb_fdones, mb_values, mb_rewards), _ = _rollout(8, 4, 1, torch.float32, 2)
    # a horizon shorter than the tensors: rl_games reads the first horizon_length steps only
    agent.horizon_length = 6
    args = (fdones, last_values, mb_fdones, mb_values, mb_rewards)
    torch.testing.assert_close(rt_rl_games.discount_values(agent, *args),
                               ORIGINALS["discount_values"](agent, *args), rtol=0, atol=0)
    assert not calls


def test_rl_games_errors():
    agent, (fdones, last_values, mb_fdones, mb_values, mb_rewards), masks = _rollout(8, 4, 2, torch.float32, 3)
    bad_calls = [
        ("discount_values", (fdones, last_values, mb_fdones, mb_values[:, :3], mb_rewards)),
        ("discount_values", (fdones, None, mb_fdones, mb_values, mb_rewards)),
        ("discount_values_masks", (fdones, last_values, mb_fdones, mb_values, mb_rewards, masks[:5])),
    ]
    for name, args in bad_calls:
        with pytest.raises(Exception) as theirs:
            ORIGINALS[name](agent, *args)
        with pytest.raises(type(theirs.value)) as ours:
            getattr(rt_rl_games, name)(agent, *args)
        assert str(ours.value) == str(theirs.value)


def test_nan_in_nan_out():
    agent, args, _ = _rollout(8, 4, 1, torch.float32, 4)
    args[4][5, 1] = float("nan")
    ours = rt_rl_games.discount_values(agent, *args)
    theirs = ORIGINALS["discount_values"](agent, *args)
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours[5, 1].isnan()


def test_nan_stops_at_the_episode_end():
    """A NaN reward in a row that had an episode end before it: rl_games' loop multiplies the
    NaN advantage by the 0 flag (0 * NaN = NaN) and carries it to every earlier step of the row;
    rl_triton stops it at the episode end (docs/semantics.md, section 11), where the earlier
    steps are rl_games' advantages of the rollout with that reward finite."""
    agent, args, masks = _rollout(10, 4, 2, torch.float64, 6, p_done=0.0)
    args[2][6, 1] = 1.0  # obs 6 of row 1 starts an episode: the one before ended at step 5
    finite = tuple(x.clone() for x in args)
    args[4][8, 1, 0] = float("nan")
    for name, extra in (("discount_values", ()), ("discount_values_masks", (masks,))):
        ours = getattr(rt_rl_games, name)(agent, *args, *extra)
        theirs = ORIGINALS[name](agent, *args, *extra)
        assert theirs[:6, 1, 0].isnan().all()
        assert torch.equal(ours[6:].isnan(), theirs[6:].isnan()) and ours[8, 1, 0].isnan()
        torch.testing.assert_close(ours[:6], ORIGINALS[name](agent, *finite, *extra)[:6], rtol=0, atol=0)


@pytest.mark.parametrize("gamma", [0.99, 0.9, 0.995])
@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.uint8])
def test_float64_rollout_with_float32_flags_and_tau_one(gamma, flag_dtype):
    """Float64 rewards and values with float32 (or uint8) done flags, tau = 1: rl_games' loop
    forms gamma * tau * (1 - done) in float32, a trace factor above gamma; the drop-in computes
    rl_games' advantages exactly."""
    agent, args, masks = _rollout(16, 8, 2, torch.float64, 8)
    agent.gamma, agent.tau = gamma, 1.0
    args = (args[0].to(flag_dtype), args[1], args[2].to(flag_dtype), *args[3:])
    for name, extra in (("discount_values", ()), ("discount_values_masks", (masks,))):
        ours = getattr(rt_rl_games, name)(agent, *args, *extra)
        theirs = ORIGINALS[name](agent, *args, *extra)
        assert ours.dtype == theirs.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # float32 rollouts: the flags' dtype is the data's, no rounding of the trace factor
    agent, args, masks = _rollout(16, 8, 2, torch.float32, 8)
    agent.gamma, agent.tau = gamma, 1.0
    torch.testing.assert_close(rt_rl_games.discount_values_masks(agent, *args, masks),
                               ORIGINALS["discount_values_masks"](agent, *args, masks), **TOL[torch.float32])


@pytest.mark.parametrize("which", ["fdones", "mb_fdones", "both"])
def test_bool_dones_raise_rl_games_error(which):
    """rl_games' loop forms ``1.0 - dones``, which torch refuses for bool tensors: the drop-in
    raises that RuntimeError, as rl_games' methods do."""
    agent, args, masks = _rollout(6, 4, 1, torch.float32, 9)
    fdones, mb_fdones = args[0], args[2]
    if which != "mb_fdones":
        fdones = fdones.bool()
    if which != "fdones":
        mb_fdones = mb_fdones.bool()
    args = (fdones, args[1], mb_fdones, *args[3:])
    for name, extra in (("discount_values", ()), ("discount_values_masks", (masks,))):
        with pytest.raises(RuntimeError) as theirs:
            ORIGINALS[name](agent, *args, *extra)
        with pytest.raises(RuntimeError) as ours:
            getattr(rt_rl_games, name)(agent, *args, *extra)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_patch_contract():
    assert not rt_rl_games.is_patched()
    rt_rl_games.patch()
    rt_rl_games.patch()
    assert rt_rl_games.is_patched()
    assert A2CBase.discount_values is rt_rl_games.discount_values
    assert A2CBase.discount_values_masks is rt_rl_games.discount_values_masks
    with rt_rl_games.patched():
        pass
    assert rt_rl_games.is_patched()
    rt_rl_games.unpatch()
    rt_rl_games.unpatch()
    assert not rt_rl_games.is_patched()
    assert all(A2CBase.__dict__[name] is fn for name, fn in ORIGINALS.items())
    with rt_rl_games.patched():
        with rt_rl_games.patched():
            assert A2CBase.discount_values is rt_rl_games.discount_values
        assert rt_rl_games.is_patched()
    assert all(A2CBase.__dict__[name] is fn for name, fn in ORIGINALS.items())
    # across threads: a block open in another thread holds the patch past unpatch()
    with held_in_thread(rt_rl_games.patched):
        rt_rl_games.patch()
        rt_rl_games.unpatch()
        assert A2CBase.discount_values is rt_rl_games.discount_values
    assert all(A2CBase.__dict__[name] is fn for name, fn in ORIGINALS.items())
    # prepare_dataset of the two bases: wrapped while patched, rl_games' own function after
    from rl_games.common import a2c_common

    bases = [a2c_common.ContinuousA2CBase, a2c_common.DiscreteA2CBase]
    theirs = [cls.__dict__["prepare_dataset"] for cls in bases]
    with rt_rl_games.patched():
        assert all(cls.__dict__["prepare_dataset"] is not fn for cls, fn in zip(bases, theirs))
    assert all(cls.__dict__["prepare_dataset"] is fn for cls, fn in zip(bases, theirs))


def test_agent_classes_and_register():
    from rl_games.algos_torch import a2c_continuous, a2c_discrete
    from rl_games.torch_runner import Runner

    assert issubclass(rt_rl_games.A2CAgent, a2c_continuous.A2CAgent)
    assert issubclass(rt_rl_games.DiscreteA2CAgent, a2c_discrete.DiscreteA2CAgent)
    assert rt_rl_games.A2CAgent.discount_values is rt_rl_games.discount_values
    with pytest.raises(TypeError, match="runner"):
        rt_rl_games.register(object())
    runner = Runner()
    sac_builder = runner.algo_factory._builders["sac"]
    rt_rl_games.register(runner)
    assert runner.algo_factory._builders["sac"] is sac_builder


# -- PPO through rl_games' Runner on a small torch vector env (the IsaacLab wrapper's form) ----

class _Env:
    """A vector env of torch tensors with ``value_size`` reward heads, episodes that end at
    random or at a time limit (``infos["time_outs"]``, which rl_games bootstraps)."""

    def __init__(self, num_envs, value_size):
        self.n, self.k = num_envs, value_size
        self.g = torch.Generator().manual_seed(0)
        self.t = torch.zeros(num_envs, dtype=torch.long)

    def reset(self):
        self.t.zero_()
        return torch.randn(self.n, 4, generator=self.g)

    def step(self, actions):
        self.t += 1
        obs = torch.randn(self.n, 4, generator=self.g)
        reward = -actions.pow(2).sum(-1, keepdim=True) * torch.arange(1, self.k + 1)
        time_outs = self.t >= 7
        dones = time_outs | (torch.rand(self.n, generator=self.g) < 0.05)
        self.t[dones] = 0
        return obs, reward if self.k > 1 else reward[:, 0], dones.to(torch.uint8), {"time_outs": time_outs}

    def get_env_info(self):
        return {"observation_space": gym.spaces.Box(-10, 10, (4,)), "action_space": gym.spaces.Box(-1, 1, (2,)),
                "agents": 1, "value_size": self.k}

    def seed(self, seed):
        pass

    def has_action_masks(self):
        return False

    def get_number_of_agents(self):
        return 1

    def set_train_info(self, *args, **kwargs):
        pass

    def get_env_state(self):
        return None


def _train(tmp_path, value_size, register=False):
    """Two epochs of rl_games' continuous PPO, seeded; the model's parameters after them."""
    from rl_games.common import env_configurations, vecenv
    from rl_games.torch_runner import Runner

    vecenv.register("RL_TRITON_TEST", lambda config_name, num_actors, **kw: _Env(num_actors, value_size))
    env_configurations.register("rl_triton_test", {"vecenv_type": "RL_TRITON_TEST", "env_creator": lambda **kw: None})
    space = {"mu_activation": "None", "sigma_activation": "None", "mu_init": {"name": "default"},
             "sigma_init": {"name": "const_initializer", "val": 0}, "fixed_sigma": True}
    config = {"name": "rt", "env_name": "rl_triton_test", "device": "cpu", "ppo_device": "cpu", "multi_gpu": False,
              "ppo": True, "mixed_precision": False, "normalize_input": False, "normalize_value": False,
              "value_bootstrap": True, "num_actors": 8, "reward_shaper": {"scale_value": 1.0},
              "normalize_advantage": True, "gamma": 0.99, "tau": 0.95, "learning_rate": 3e-4, "lr_schedule": None,
              "kl_threshold": 0.008, "score_to_win": 1e9, "max_epochs": 2, "save_best_after": 100,
              "save_frequency": 0, "grad_norm": 1.0, "entropy_coef": 0.0, "truncate_grads": True, "e_clip": 0.2,
              "horizon_length": 16, "minibatch_size": 64, "mini_epochs": 2, "critic_coef": 2, "clip_value": True,
              "bounds_loss_coef": 0.0001, "train_dir": str(tmp_path), "full_experiment_name": "rt",
              "print_stats": False, "torch_compile": False}
    params = {"seed": 7, "algo": {"name": "a2c_continuous"}, "model": {"name": "continuous_a2c_logstd"},
              "network": {"name": "actor_critic", "separate": False, "space": {"continuous": space},
                          "mlp": {"units": [16], "activation": "elu", "initializer": {"name": "default"}}},
              "config": config}
    runner = Runner()
    if register:
        rt_rl_games.register(runner)
    runner.load({"params": params})
    agent = runner.algo_factory.create("a2c_continuous", base_name="run", params=runner.params)
    agent.train()
    return type(agent), [p.detach().clone() for p in agent.model.parameters()]


@pytest.mark.parametrize("value_size", [1, 3])
def test_ppo_trains_the_same(tmp_path, monkeypatch, capsys, value_size):
    calls = count_calls(monkeypatch, rt_rl_games)
    cls, theirs = _train(tmp_path, value_size)
    assert not calls and cls is not rt_rl_games.A2CAgent
    cls, ours = _train(tmp_path, value_size, register=True)
    assert len(calls) == 2 and cls is rt_rl_games.A2CAgent and not rt_rl_games.is_patched()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with rt_rl_games.patched():
        _, patched = _train(tmp_path, value_size)
    assert len(calls) == 4
    for a, b in zip(patched, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_repeated_calls_read_no_tensor_back(monkeypatch):
    """The rounded trace factor (float64 rollouts, float32 flags, tau = 1) is formed once per
    (gamma, tau, flag dtype): a repeated call reads no tensor back to the host."""
    agent, args, masks = _rollout(16, 8, 1, torch.float64, 9)
    agent.gamma, agent.tau = 0.971, 1.0
    first = rt_rl_games.discount_values(agent, *args)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    again = rt_rl_games.discount_values(agent, *args)
    assert reads == []
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(again, ORIGINALS["discount_values"](agent, *args), rtol=0, atol=0)


# -- global_normalisation: the statistics over the ranks, after rl_games' prepare_dataset ----------
class _Dataset:
    def update_values_dict(self, values_dict):
        self.values_dict = values_dict


def _agent(cls, is_rnn, config, central=False):
    """An agent of ``cls`` (rl_games' class, or one with ``FusedDiscount`` first) with what
    ``prepare_dataset`` reads: advantages normalised over the batch, no value normalisation."""
    agent = object.__new__(cls)
    agent.config, agent.is_rnn, agent.has_central_value = config, is_rnn, central
    agent.normalize_value, agent.normalize_advantage, agent.normalize_rms_advantage = False, True, False
    agent.use_action_masks, agent.dataset = False, _Dataset()
    if central:
        agent.central_value_net = types.SimpleNamespace(dataset=_Dataset())
        agent.central_value_net.update_dataset = agent.central_value_net.dataset.update_values_dict
    return agent


def _batch(rank, dtype, K=2):
    """Rank ``rank``'s batch: 24 + 5 * rank samples, ``K`` value heads, RNN masks with zeros."""
    g = torch.Generator().manual_seed(50 + rank)
    B = 24 + 5 * rank
    batch = {name: torch.randn(B, K, generator=g, dtype=F64).to(dtype) for name in ("returns", "values")}
    batch.update({name: torch.randn(B, 1, generator=g) for name in ("obses", "states", "actions", "neglogpacs", "mus",
                                                                    "sigmas", "dones")})
    batch["rnn_masks"] = (torch.rand(B, generator=g) < 0.7).to(dtype)
    return batch


def _normalisation_worker(rank, world, group, dtype):
    """With global_normalisation (patch()'s, or the agent config's field with the agent classes'
    mixin) each rank's dataset advantages are normalised with the statistics of every rank's
    batch (the valid elements under RNN masks), float64 formula; rl_games' own otherwise."""
    from rl_games.common.a2c_common import ContinuousA2CBase, DiscreteA2CBase

    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-6, atol=2e-6)
    batches = [_batch(k, dtype) for k in range(world)]
    raw = [(b["returns"] - b["values"]).sum(1).double().numpy() for b in batches]
    for cls in (ContinuousA2CBase, DiscreteA2CBase):
        for is_rnn in (False, True):
            masks = [b["rnn_masks"].numpy() for b in batches] if is_rnn else None
            want = torch.from_numpy(concatenated_normalisation(raw, masks)[rank]).to(dtype)
            mine = dict(batches[rank])
            local = _agent(cls, is_rnn, {})
            cls.prepare_dataset(local, mine)
            local = local.dataset.values_dict["advantages"]
            assert not torch.allclose(local, want, rtol=1e-3, atol=1e-3)  # the statistics differ here
            for setting in (True, group):
                rt_rl_games.patch(global_normalisation=setting)
                agent = _agent(cls, is_rnn, {}, central=True)
                cls.prepare_dataset(agent, mine)
                for got in (agent.dataset.values_dict, agent.central_value_net.dataset.values_dict):
                    torch.testing.assert_close(got["advantages"], want, **tol)
                rt_rl_games.unpatch()
                fused = type("Agent", (rt_rl_games.FusedDiscount, cls), {})
                agent = _agent(fused, is_rnn, {"global_normalisation": setting})
                agent.prepare_dataset(mine)
                torch.testing.assert_close(agent.dataset.values_dict["advantages"], want, **tol)
            with rt_rl_games.patched():  # the default: rl_games' own statistics
                agent = _agent(cls, is_rnn, {})
                cls.prepare_dataset(agent, mine)
                assert torch.equal(agent.dataset.values_dict["advantages"], local)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("world,dtype", [(2, F64), (3, torch.float32)])
def test_global_normalisation_over_ranks(world, dtype):
    spawn_gloo(_normalisation_worker, world, dtype)


def test_global_normalisation_without_process_group_is_local_and_checked():
    from rl_games.common.a2c_common import ContinuousA2CBase

    batch = _batch(0, F64)
    want = _agent(ContinuousA2CBase, False, {})
    ContinuousA2CBase.prepare_dataset(want, batch)
    with rt_rl_games.patched(global_normalisation=True):
        got = _agent(ContinuousA2CBase, False, {})
        ContinuousA2CBase.prepare_dataset(got, batch)
        torch.testing.assert_close(got.dataset.values_dict["advantages"], want.dataset.values_dict["advantages"],
                                   rtol=1e-12, atol=1e-12)
        bad = _agent(ContinuousA2CBase, False, {"global_normalisation": "yes"})
        with pytest.raises(TypeError, match="global_normalisation"):
            ContinuousA2CBase.prepare_dataset(bad, batch)
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_rl_games.patch(global_normalisation=value)
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_rl_games.patched(global_normalisation=value)
    assert not rt_rl_games.is_patched()
