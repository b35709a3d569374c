"""skrl integration: the same returns and advantages as skrl's own ``compute_gae`` of every
torch agent module (both signatures, float32 and float64, time-limit bootstrap on and off),
skrl's errors, the patch contract, the agent classes' route, and agents trained both ways."""

import threading

import pytest
import torch

pytest.importorskip("gymnasium")
pytest.importorskip("skrl")
import rl_triton.integrations.skrl as rt_skrl  # noqa: E402
from helpers import concatenated_normalisation, count_calls, held_in_thread, spawn_gloo  # noqa: E402

ORIGINALS = dict(rt_skrl._ORIGINALS) if rt_skrl._load() else {}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_skrl.unpatch()
    assert all(rt_skrl._MODULES[name].compute_gae is fn for name, fn in ORIGINALS.items())


def _rollout(T, N, dtype, seed, p_end=0.15, K=1):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, K, generator=g, dtype=dtype)
    values = torch.randn(T, N, K, generator=g, dtype=dtype)
    last_values = torch.randn(N, K, generator=g, dtype=dtype)
    terminated = torch.rand(T, N, K, generator=g) < p_end
    truncated = torch.rand(T, N, K, generator=g) < p_end
    terminated[-1, 0] = True  # the window's last step ends an episode in some rows
    truncated[-1, -1] = True
    return rewards, values, last_values, terminated, truncated


def _close(ours, theirs, dtype):
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, equal_nan=True, **TOL[dtype])


@pytest.mark.filterwarnings("ignore:std")  # one element: no std (NaN), in skrl's loop and here
@pytest.mark.parametrize("module", rt_skrl.FEED_FORWARD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("time_limit_bootstrap", [False, True])
@pytest.mark.parametrize("T,N", [(1, 1), (1, 5), (7, 3), (24, 64)])
def test_feed_forward_matches_skrl(module, dtype, time_limit_bootstrap, T, N):
    rewards, values, last_values, terminated, truncated = _rollout(T, N, dtype, T * 1000 + N)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values,
              last_values=last_values, discount_factor=0.97, lambda_coefficient=0.9,
              time_limit_bootstrap=time_limit_bootstrap)
    _close(rt_skrl.compute_gae(**kw), ORIGINALS[module](**kw), dtype)


@pytest.mark.parametrize("module", rt_skrl.RECURRENT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,N", [(1, 5), (7, 3), (24, 64)])
def test_recurrent_matches_skrl(module, dtype, T, N):
    rewards, values, last_values, terminated, _ = _rollout(T, N, dtype, T * 1000 + N + 1)
    kw = dict(rewards=rewards, terminated=terminated, values=values, next_values=last_values,
              discount_factor=0.99, lambda_coefficient=0.95)
    _close(rt_skrl.compute_gae_rnn(**kw), ORIGINALS[module](**kw), dtype)


def test_benchmark_transcription_is_skrls():
    # benchmarks/skrl_rl_games.py times this copy where skrl is not installed
    from rl_triton.testing.sim_frameworks import skrl_compute_gae

    rewards, values, last_values, terminated, truncated = _rollout(16, 8, torch.float32, 9)
    for tlb in (False, True):
        kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values,
                  last_values=last_values, discount_factor=0.97, lambda_coefficient=0.9, time_limit_bootstrap=tlb)
        for a, b in zip(skrl_compute_gae(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo"](**kw), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.0, 0.5), (0.99, 0.0), (0.5, 1.0)])
def test_coefficients_and_defaults(gamma, lam):
    rewards, values, last_values, terminated, truncated = _rollout(16, 8, torch.float64, 3)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values, last_values=last_values)
    original = ORIGINALS["skrl.agents.torch.ppo.ppo"]
    _close(rt_skrl.compute_gae(**kw), original(**kw), torch.float64)  # skrl's defaults
    kw.update(discount_factor=gamma, lambda_coefficient=lam, time_limit_bootstrap=True)
    _close(rt_skrl.compute_gae(**kw), original(**kw), torch.float64)


def test_value_heads_and_lower_precision_last_values():
    # several value columns (skrl's loop is elementwise over them) and last values from an
    # autocast critic, in a lower precision than the stored values
    rewards, values, last_values, terminated, truncated = _rollout(12, 6, torch.float32, 4, K=3)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values,
              last_values=last_values.to(torch.bfloat16), time_limit_bootstrap=True)
    _close(rt_skrl.compute_gae(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo"](**kw), torch.float32)
    kw.update(terminated=terminated[..., :1], truncated=truncated[..., :1])  # flags shared by the columns
    _close(rt_skrl.compute_gae(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo"](**kw), torch.float32)


def test_mixed_dtypes_and_gradients():
    # float64 values with float32 rewards (skrl's returns take the values' dtype), and inputs
    # that need gradients (skrl's loop is differentiable): the normalisation runs on its own
    rewards, values, last_values, terminated, truncated = _rollout(12, 6, torch.float32, 8)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values.double(),
              last_values=last_values, time_limit_bootstrap=True)
    original = ORIGINALS["skrl.agents.torch.ppo.ppo"]
    _close(rt_skrl.compute_gae(**kw), original(**kw), torch.float32)
    kw["values"] = values.clone().requires_grad_()
    ours, theirs = rt_skrl.compute_gae(**kw), original(**kw)
    _close([x.detach() for x in ours], [x.detach() for x in theirs], torch.float32)
    grad_ours, = torch.autograd.grad(ours[1].square().sum() + ours[0].sum(), kw["values"])
    grad_theirs, = torch.autograd.grad(theirs[1].square().sum() + theirs[0].sum(), kw["values"])
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-4, atol=1e-4)


def test_nan_in_nan_out():
    rewards, values, last_values, terminated, truncated = _rollout(8, 4, torch.float32, 5)
    rewards[3, 2] = float("nan")
    returns, adv = rt_skrl.compute_gae(rewards=rewards, terminated=terminated, truncated=truncated,
                                       values=values, last_values=last_values)
    assert adv.isnan().all()  # the normalisation's statistics are NaN: every advantage is
    assert returns[3, 2].isnan() and not returns[4:, 2].isnan().any()


def test_nan_stops_at_the_episode_end():
    """A NaN reward after an episode end in its row: skrl's loop multiplies the carried advantage
    by the 0 flag (0 * NaN = NaN) and its returns are NaN at every earlier step of the row;
    rl_triton stops the NaN at the episode end (docs/semantics.md, section 11), where the earlier
    returns are skrl's returns of the rollout with that reward finite."""
    rewards, values, last_values, terminated, truncated = _rollout(10, 4, torch.float64, 11, p_end=0.0)
    terminated[4, 2] = True
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values, last_values=last_values)
    finite = ORIGINALS["skrl.agents.torch.ppo.ppo"](**{**kw, "rewards": rewards.clone()})
    rewards[7, 2] = float("nan")
    ours, theirs = rt_skrl.compute_gae(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo"](**kw)
    assert theirs[0][:8, 2].isnan().all()
    assert torch.equal(ours[0][5:].isnan(), theirs[0][5:].isnan()) and ours[0][7, 2].isnan()
    torch.testing.assert_close(ours[0][:5], finite[0][:5], **TOL[torch.float64])
    assert ours[1].isnan().all() and theirs[1].isnan().all()  # the normalisation's statistics are NaN


@pytest.mark.filterwarnings("ignore:std")  # no elements: no std (NaN), in skrl's loop and here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(0, 4, 1), (0, 3, 2), (0, 4)])
def test_rollout_of_zero_steps(dtype, shape):
    """A rollout of 0 steps: skrl's empty returns and advantages, of its shapes and dtypes."""
    rewards, values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    flags, last_values = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape[1:], dtype=dtype)
    kw = dict(rewards=rewards, terminated=flags, truncated=flags, values=values, last_values=last_values)
    _close(rt_skrl.compute_gae(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo"](**kw), dtype)
    kw = dict(rewards=rewards, terminated=flags, values=values, next_values=last_values)
    _close(rt_skrl.compute_gae_rnn(**kw), ORIGINALS["skrl.agents.torch.ppo.ppo_rnn"](**kw), dtype)


def test_skrls_errors():
    rewards, values, last_values, terminated, truncated = _rollout(8, 4, torch.float32, 6)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values, last_values=last_values)
    original = ORIGINALS["skrl.agents.torch.ppo.ppo"]
    for bad in (dict(values=values[:5]), dict(rewards=rewards.tolist()), dict(terminated=None)):
        with pytest.raises(Exception) as theirs:
            original(**{**kw, **bad})
        with pytest.raises(type(theirs.value)) as ours:
            rt_skrl.compute_gae(**{**kw, **bad})
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="positional"):
        rt_skrl.compute_gae(rewards, terminated, truncated, values, last_values)


def test_patch_contract():
    modules = rt_skrl._MODULES
    assert not rt_skrl.is_patched()
    rt_skrl.patch()
    rt_skrl.patch()
    assert rt_skrl.is_patched()
    for name, module in modules.items():
        expected = rt_skrl.compute_gae_rnn if name in rt_skrl.RECURRENT else rt_skrl.compute_gae
        assert module.compute_gae is expected
    with rt_skrl.patched():
        pass
    assert rt_skrl.is_patched()  # a block inside patch() leaves it in effect
    rt_skrl.unpatch()
    rt_skrl.unpatch()
    assert not rt_skrl.is_patched()
    assert all(modules[name].compute_gae is fn for name, fn in ORIGINALS.items())
    with rt_skrl.patched():
        with rt_skrl.patched():
            assert modules["skrl.agents.torch.ppo.ppo"].compute_gae is rt_skrl.compute_gae
        assert rt_skrl.is_patched()
    assert all(modules[name].compute_gae is fn for name, fn in ORIGINALS.items())


def test_patch_holders_across_threads():
    module = rt_skrl._MODULES["skrl.agents.torch.ppo.ppo"]
    with held_in_thread(rt_skrl.patched):
        assert module.compute_gae is rt_skrl.compute_gae
        rt_skrl.patch()
    assert module.compute_gae is rt_skrl.compute_gae  # patch() still holds it
    rt_skrl.unpatch()
    assert module.compute_gae is ORIGINALS["skrl.agents.torch.ppo.ppo"]


def test_agent_route_leaves_other_callers_alone(monkeypatch):
    # inside an rl_triton agent's update the module function routes to rl_triton; a caller in
    # another thread at the same time (an agent of skrl's own class) gets skrl's loop
    calls = count_calls(monkeypatch, rt_skrl)
    name = "skrl.agents.torch.ppo.ppo"
    module = rt_skrl._MODULES[name]
    rewards, values, last_values, terminated, truncated = _rollout(8, 4, torch.float32, 7)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values, last_values=last_values)
    inside, release, seen = threading.Event(), threading.Event(), []

    def agent_update():
        with rt_skrl._routing():
            module.compute_gae(**kw)
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=agent_update)
    thread.start()
    inside.wait(5)
    assert len(calls) == 1 and not rt_skrl.is_patched()
    assert module.compute_gae is not ORIGINALS[name]
    module.compute_gae(**kw)  # this thread did not ask
    seen.append(len(calls))
    release.set()
    thread.join()
    assert seen == [1]
    assert module.compute_gae is ORIGINALS[name]


def test_agent_classes():
    import skrl.agents.torch as agents
    import skrl.multi_agents.torch as multi_agents

    for cls_name in ("A2C", "A2C_RNN", "AMP", "PPO", "PPO_RNN", "RPO", "RPO_RNN", "TRPO", "TRPO_RNN"):
        ours, package = getattr(rt_skrl, cls_name), getattr(agents, cls_name.split("_")[0].lower())
        assert issubclass(ours, getattr(package, cls_name))
    for cls_name in ("IPPO", "MAPPO"):
        assert issubclass(getattr(rt_skrl, cls_name), getattr(getattr(multi_agents, cls_name.lower()), cls_name))


def _ppo_run(cls, tmp_path, seed=0, rollouts=16):
    """One rollout and one update of a PPO agent on a 4-env Pendulum, seeded: the memory's
    returns and advantages after the update, and the policy's parameters."""
    import gymnasium
    from skrl.envs.wrappers.torch import wrap_env
    from skrl.memories.torch import RandomMemory
    from skrl.trainers.torch import SequentialTrainer
    from skrl.utils.model_instantiators.torch import deterministic_model, gaussian_model

    torch.manual_seed(seed)
    vec = gymnasium.make_vec("Pendulum-v1", num_envs=4, vectorization_mode="sync")
    vec.reset(seed=seed)  # the trainer's reset() goes on from this seed
    env = wrap_env(vec, verbose=False)
    net = [{"name": "net", "input": "OBSERVATIONS", "layers": [8], "activations": "tanh"}]
    spaces = dict(observation_space=env.observation_space, action_space=env.action_space, device=env.device)
    models = {"policy": gaussian_model(**spaces, network=net, output="ACTIONS"),
              "value": deterministic_model(**spaces, network=net, output="ONE")}
    memory = RandomMemory(memory_size=rollouts, num_envs=env.num_envs, device=env.device)
    cfg = {"rollouts": rollouts, "learning_epochs": 2, "mini_batches": 2, "time_limit_bootstrap": True,
           "experiment": {"write_interval": 0, "checkpoint_interval": 0, "directory": str(tmp_path)}}
    agent = cls(models=models, memory=memory, cfg=cfg, **spaces)
    SequentialTrainer(cfg={"timesteps": rollouts, "headless": True, "disable_progressbar": True,
                           "close_environment_at_exit": False}, env=env, agents=agent).train()
    vec.close()
    return ([memory.get_tensor_by_name(n).clone() for n in ("returns", "advantages")],
            [p.detach().clone() for p in models["policy"].parameters()])


def test_ppo_agent_trains_the_same(tmp_path, monkeypatch):
    from skrl.agents.torch.ppo import PPO

    calls = count_calls(monkeypatch, rt_skrl)
    theirs = _ppo_run(PPO, tmp_path)
    assert not calls
    ours = _ppo_run(rt_skrl.PPO, tmp_path)
    assert len(calls) == 1 and not rt_skrl.is_patched()
    _close(ours[0], theirs[0], torch.float32)
    _close(ours[1], theirs[1], torch.float32)
    rt_skrl.patch()  # skrl's own class, patched
    patched = _ppo_run(PPO, tmp_path)
    assert len(calls) == 2
    _close(patched[0], theirs[0], torch.float32)


_WITHOUT_FRAMEWORKS = """
import runpy
import sys
sys.modules.update({"skrl": None, "rl_games": None})  # neither framework importable
import torch
import rl_triton.integrations.rl_games as rt_rl_games
import rl_triton.integrations.skrl as rt_skrl

r, v, last = torch.randn(8, 4, 1), torch.randn(8, 4, 1), torch.randn(4, 1)
term = torch.zeros(8, 4, 1, dtype=torch.bool)
returns, adv = rt_skrl.compute_gae(rewards=r, terminated=term, truncated=term, values=v, last_values=last)
assert torch.allclose(returns[-1], r[-1] + 0.99 * last)
agent = type("Agent", (), {"horizon_length": 8, "gamma": 0.99, "tau": 0.95})()
adv = rt_rl_games.discount_values(agent, torch.zeros(4), last, torch.zeros(8, 4), v, r)
assert torch.allclose(adv[-1], r[-1] + 0.99 * last - v[-1])
for module, name in ((rt_skrl, "PPO"), (rt_rl_games, "A2CAgent")):
    try:
        getattr(module, name)
    except ImportError:
        pass
    else:
        raise AssertionError(name + " without its framework")
# the benchmark, with the frameworks' transcribed loops (it exits 1 where rl_triton disagrees)
sys.argv = [BENCHMARK, "--shapes", "5x8x1,3x6x2", "--rounds", "1"]
try:
    runpy.run_path(BENCHMARK, run_name="__main__")
except SystemExit as end:
    assert end.code == 0, end.code
print("ok")
"""


def test_drop_ins_need_no_framework():
    # the benchmark machine has neither framework: the drop-in functions import and run there,
    # and so does the benchmark
    import os
    import subprocess
    import sys

    benchmark = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                             "skrl_rl_games.py")
    code = f"BENCHMARK = {benchmark!r}\n" + _WITHOUT_FRAMEWORKS
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]
    assert "skrl 2.1.1 transcribed, rl-games 1.6.5 transcribed" in done.stdout


def test_repeated_calls_read_no_tensor_back(monkeypatch):
    """skrl's loop discounts by the factor rounded to torch's default dtype; the drop-in forms
    that number once per (factor, dtype), so a repeated call reads no tensor back to the host."""
    rewards, values, last_values, terminated, truncated = _rollout(16, 8, torch.float64, 3)
    kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values,
              last_values=last_values, discount_factor=0.973, lambda_coefficient=0.9)
    first = rt_skrl.compute_gae(**kw)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    again = rt_skrl.compute_gae(**kw)
    assert reads == []
    _close(again, first, torch.float64)
    _close(again, ORIGINALS[rt_skrl.FEED_FORWARD[2]](**kw), torch.float64)


# -- global_normalisation: the statistics over the ranks ---------------------------------------------
FF, RNN = "skrl.agents.torch.ppo.ppo", "skrl.agents.torch.ppo.ppo_rnn"


def _skrl_kwargs(module, rank, dtype):
    """skrl's arguments for rank ``rank``'s rollout (12 steps, 5 + rank environments)."""
    rewards, values, last_values, terminated, truncated = _rollout(12, 5 + rank, dtype, 40 + rank)
    if module == RNN:
        return dict(rewards=rewards, terminated=terminated, values=values, next_values=last_values,
                    discount_factor=0.97, lambda_coefficient=0.9)
    return dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values, last_values=last_values,
                discount_factor=0.97, lambda_coefficient=0.9, time_limit_bootstrap=True)


class _Updating:
    """A stand-in agent whose update calls its module's compute_gae, as skrl's agents do."""

    def __init__(self, module, kwargs):
        self.module, self.kwargs = module, kwargs

    def update(self):
        return rt_skrl._MODULES[self.module].compute_gae(**self.kwargs)


class _FusedAgent(rt_skrl.FusedUpdate, _Updating):
    pass


def _normalisation_worker(rank, world, group, dtype):
    """With global_normalisation each rank's advantages are normalised with the statistics of all
    ranks' rollouts concatenated (skrl's own returns, minus the values, for the raw advantages;
    the float64 formula for the statistics), by patch() and by an agent of the classes here; the
    returns are skrl's; without it, skrl's per-rank result."""
    for module in (FF, RNN):
        theirs = [ORIGINALS[module](**_skrl_kwargs(module, k, dtype)) for k in range(world)]
        raw = [(ret - _skrl_kwargs(module, k, dtype)["values"]).double().numpy() for k, (ret, _) in enumerate(theirs)]
        want = (theirs[rank][0], torch.from_numpy(concatenated_normalisation(raw)[rank]).to(dtype))
        kw = _skrl_kwargs(module, rank, dtype)
        assert not torch.allclose(theirs[rank][1], want[1], rtol=1e-3, atol=1e-3)  # the statistics differ
        for setting in (True, group):
            rt_skrl.patch(global_normalisation=setting)
            _close(rt_skrl._MODULES[module].compute_gae(**kw), want, dtype)
            rt_skrl.patch()  # this rank's statistics, as skrl's; an agent's own setting wins
            agent = _FusedAgent(module, kw)
            agent.global_normalisation = setting
            _close(agent.update(), want, dtype)
            _close(rt_skrl._MODULES[module].compute_gae(**kw), theirs[rank], dtype)
            rt_skrl.unpatch()
            _close(agent.update(), want, dtype)
            _close(_FusedAgent(module, kw).update(), theirs[rank], dtype)  # the class default: skrl's


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("world,dtype", [(2, torch.float64), (4, torch.float32)])
def test_global_normalisation_over_ranks(world, dtype):
    spawn_gloo(_normalisation_worker, world, dtype)


def test_global_normalisation_without_process_group_is_local():
    kw = _skrl_kwargs(FF, 0, torch.float64)
    rt_skrl.patch(global_normalisation=True)
    _close(rt_skrl._MODULES[FF].compute_gae(**kw), ORIGINALS[FF](**kw), torch.float64)


def test_global_normalisation_rejects_other_values():
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_skrl.patch(global_normalisation=bad)
        with pytest.raises(TypeError, match="global_normalisation"):
            rt_skrl.patched(global_normalisation=bad)
        agent = _FusedAgent(FF, _skrl_kwargs(FF, 0, torch.float64))
        agent.global_normalisation = bad
        with pytest.raises(TypeError, match="global_normalisation"):
            agent.update()
    assert not rt_skrl.is_patched()
