"""The host cost of one drop-in call against its framework's own call, side by side in one process.

At a tiny rollout (default 16 steps x 64 environments, float32) the arithmetic is a few
microseconds and the call's Python is most of its time: this is where a drop-in's argument
handling, flag conversions, casts and host reads show. Each row times the framework's own call
and the drop-in's on the same inputs (separate outputs, so in-place writers do not share them),
alternating (benchmarks/common.py's ``alternate``): median microseconds per call over the rounds
(lowest-highest round) and the drop-in's time over the framework's within each round. Beside
them, the drop-in's first call of a signature (the library's call plans cleared, the kernels
already compiled: validation, the plan's making and its first launch) and its second call (the
plan's hit function written; with ``RL_TRITON_GRAPHS=1`` the call that captures a graph where
the same tensors come again), one call each, median over the rounds.

The framework's function is the installed package's where it imports; for the frameworks this
environment lacks, the transcriptions in rl_triton/testing/frameworks.py and sim_frameworks.py
stand in (the "source" column says which). Drop-ins whose module needs its framework installed
(rsl_rl, SB3, TorchRL, RLlib) are reported as skipped without it. Before timing, every row
checks the drop-in's outputs against the framework's (largest absolute difference, --atol): a
row that errs or disagrees is marked FAILS and the script exits with status 1.

    python benchmarks/dropin_overhead.py                      # every framework, 16 x 64
    python benchmarks/dropin_overhead.py --shape 8x64 --only skrl,rl_games
    python benchmarks/dropin_overhead.py --threads 1          # a CPU shared with other work
    python benchmarks/dropin_overhead.py --device cuda --shape 24x4096 --peers-dir PEERS

On CUDA (``--device cuda``) the columns are what a training loop sees: the full call (CUDA events
around one call after a synchronize, the median of ``--calls`` calls in each round, rounds
alternating), the same calls back to back (one synchronize at the end, per call), and beside the
drop-in a CUDA graph of one drop-in call replayed, full and back to back: the floor of the same
kernels without their Python. ``--peers-dir`` adds two rows whose framework side is a GPU peer:
rl_games' own Triton GAE from its main branch (``rl_games_master/gae_kernel.py``, unreleased)
and PufferLib 3.0.0's CUDA advantage op (``pufferlib_ext/``, built on first use). Rows whose
framework's call reads NumPy arrays (SB3, RLlib's connector) are CPU rows and skipped there.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable, Dict, List, NamedTuple

import numpy as np
import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # after PYTHONPATH
from rl_triton.testing import frameworks, sim_frameworks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, first_calls, machine, parser, ratios, set_threads, spread  # noqa: E402

GAMMA, LAM = 0.99, 0.95
DEVICE = torch.device("cpu")
PEERS: dict = {}  # "rl_games" -> rl_games main's compute_gae, "pufferlib" -> PufferLib's op (--peers-dir)


class Row(NamedTuple):
    """One timed pair: ``theirs`` and ``ours`` take no arguments and return their outputs (a
    tuple of tensors or arrays, compared pairwise)."""

    theirs: Callable[[], tuple]
    ours: Callable[[], tuple]
    source: str


class Skip(Exception):
    """A row this environment cannot build (its framework is not installed)."""


def _needs(module: str):
    """The drop-in module ``rl_triton.integrations.<module>``; ``Skip`` where its framework is missing."""
    try:
        return __import__(f"rl_triton.integrations.{module}", fromlist=["_"])
    except ImportError as e:
        raise Skip(f"not installed: {e.name}") from None


def _version(name: str) -> str:
    from importlib.metadata import version

    return f"{name} {version(name)}"


def _data(seed=0):
    """(a seeded CPU generator, randn(*shape), flags(*shape, p): true with probability p), the
    tensors drawn on the CPU and placed on ``DEVICE``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    def flags(*shape, p=0.05):
        return (torch.rand(*shape, generator=g) < p).to(DEVICE)

    return g, randn, flags


def _cpu_only(name: str):
    if DEVICE.type != "cpu":
        raise Skip(f"{name}'s call reads NumPy arrays: a CPU row")


def rl_games(T, N):
    import rl_triton.integrations.rl_games as rt_rl_games

    try:
        from rl_games.common.a2c_common import A2CBase
        theirs, source = A2CBase.__dict__["discount_values"], _version("rl-games")
    except ImportError:
        theirs, source = sim_frameworks.rl_games_discount_values, "rl-games 1.6.5 transcribed"
    _, randn, flags = _data()
    done = flags(T, N).float()
    args = (done[-1], randn(N, 1), torch.cat([torch.ones(1, N, device=DEVICE), done[:-1]]), randn(T, N, 1),
            randn(T, N, 1))
    agent = types.SimpleNamespace(horizon_length=T, gamma=GAMMA, tau=LAM)
    return Row(lambda: (theirs(agent, *args),), lambda: (rt_rl_games.discount_values(agent, *args),), source)


def rl_games_masks(T, N):
    import rl_triton.integrations.rl_games as rt_rl_games

    try:
        from rl_games.common.a2c_common import A2CBase
        theirs, source = A2CBase.__dict__["discount_values_masks"], _version("rl-games")
    except ImportError:
        raise Skip("not installed: rl_games") from None
    _, randn, flags = _data()
    done = flags(T, N).float()
    masks = (~flags(T, N, p=0.1)).float()
    args = (done[-1], randn(N, 1), torch.cat([torch.ones(1, N, device=DEVICE), done[:-1]]), randn(T, N, 1),
            randn(T, N, 1), masks)
    agent = types.SimpleNamespace(horizon_length=T, gamma=GAMMA, tau=LAM)
    return Row(lambda: (theirs(agent, *args),), lambda: (rt_rl_games.discount_values_masks(agent, *args),), source)


def skrl(T, N):
    import rl_triton.integrations.skrl as rt_skrl

    try:
        from skrl.agents.torch.ppo.ppo import compute_gae as theirs
        source = _version("skrl")
    except ImportError:
        theirs, source = sim_frameworks.skrl_compute_gae, "skrl 2.1.1 transcribed"
    _, randn, flags = _data()
    terminated = flags(T, N, 1, p=0.01)
    kw = dict(rewards=randn(T, N, 1), terminated=terminated, truncated=flags(T, N, 1, p=0.005) & ~terminated,
              values=randn(T, N, 1), last_values=randn(N, 1), discount_factor=GAMMA, lambda_coefficient=LAM)
    return Row(lambda: theirs(**kw), lambda: rt_skrl.compute_gae(**kw), source)


def rsl_rl(T, N):
    rt_rsl = _needs("rsl_rl")
    if rt_rsl.STORAGE_LAYOUT:
        raise Skip("rsl-rl-lib up to 3.1 (the storage's method) is not built here")
    from rsl_rl.models import MLPModel
    from rsl_rl.algorithms import PPO
    from rsl_rl.storage import RolloutStorage
    from tensordict import TensorDict

    _, randn, flags = _data()
    obs = TensorDict({"policy": randn(N, 3)}, batch_size=[N], device=DEVICE)
    groups = {"actor": ["policy"], "critic": ["policy"]}
    rollout = randn(T, N, 1), randn(T, N, 1), flags(T, N, 1).byte()

    def ppo():
        torch.manual_seed(0)
        actor = MLPModel(obs, groups, "actor", 2, hidden_dims=[8],
                         distribution_cfg={"class_name": "GaussianDistribution"})
        critic = MLPModel(obs, groups, "critic", 1, hidden_dims=[8])
        algo = PPO(actor.to(DEVICE), critic.to(DEVICE), RolloutStorage("rl", N, T, obs, [2], str(DEVICE)),
                   gamma=GAMMA, lam=LAM, device=str(DEVICE))
        st = algo.storage
        st.rewards, st.values, st.dones = (x.clone() for x in rollout)
        st.returns = torch.zeros(T, N, 1, device=DEVICE)
        return algo

    a, b = ppo(), ppo()

    def call(method, algo):
        def run():
            method(algo, obs)
            return algo.storage.returns, algo.storage.advantages
        return run

    return Row(call(rt_rsl._PPO_ORIGINAL, a), call(rt_rsl.compute_returns, b), _version("rsl-rl-lib"))


def pufferlib(T, N):
    import rl_triton.integrations.pufferlib as rt_puffer

    _, randn, flags = _data()
    values, rewards, ratio = randn(N, T), randn(N, T), 1 + 0.1 * randn(N, T)
    terminals = flags(N, T).float()
    adv_theirs, adv_ours = torch.zeros(N, T, device=DEVICE), torch.zeros(N, T, device=DEVICE)
    clips = (GAMMA, LAM, 1.0, 1.0)
    return Row(lambda: (frameworks.pufferlib_advantage(values, rewards, terminals, ratio, adv_theirs, *clips),),
               lambda: (rt_puffer.compute_puff_advantage(values, rewards, terminals, ratio, adv_ours, *clips),),
               "pufferlib 3.0.0 transcribed")


def sb3(T, N):
    _cpu_only("SB3")
    rt_sb3 = _needs("sb3")
    from gymnasium import spaces
    from stable_baselines3.common.buffers import RolloutBuffer

    _, randn, flags = _data()
    rollout = randn(T, N).numpy(), randn(T, N).numpy(), flags(T, N).float().numpy()
    last_values, dones = randn(N, 1), flags(N).numpy()

    def buffer():
        buf = RolloutBuffer(T, spaces.Box(-1, 1, (3,)), spaces.Box(-1, 1, (1,)), device="cpu", gae_lambda=LAM,
                            gamma=GAMMA, n_envs=N)
        buf.rewards, buf.values, buf.episode_starts = (x.copy() for x in rollout)
        return buf

    a, b = buffer(), buffer()

    def call(method, buf):
        def run():
            method(buf, last_values, dones)
            return buf.advantages, buf.returns
        return run

    return Row(call(rt_sb3._ORIGINAL, a), call(rt_sb3.compute_returns_and_advantage, b), _version("stable_baselines3"))


def torchrl(T, N):
    rt_torchrl = _needs("torchrl")
    from tensordict import TensorDict
    from torchrl.objectives.value import advantages as tadv

    _, randn, flags = _data()
    terminated = flags(N, T, 1, p=0.01)
    data = {"state_value": randn(N, T, 1), ("next", "state_value"): randn(N, T, 1),
            ("next", "reward"): randn(N, T, 1), ("next", "done"): terminated | flags(N, T, 1, p=0.01),
            ("next", "terminated"): terminated}

    def module(cls):
        td = TensorDict({}, batch_size=[N, T])
        for key, x in data.items():
            td.set(key, x.clone())
        est = cls(gamma=GAMMA, lmbda=LAM, value_network=None)

        def run():
            out = est(td)
            return out["advantage"], out["value_target"]
        return run

    return Row(module(tadv.GAE), module(rt_torchrl.GAE), _version("torchrl"))


def rllib_value_targets(T, N):
    _cpu_only("RLlib's connector")
    rt_rllib = _needs("rllib")
    _, randn, flags = _data()
    args = (randn(T * N).numpy(), randn(T * N).numpy(), flags(T * N).numpy(), flags(T * N, p=0.01).numpy(), GAMMA, LAM)
    return Row(lambda: (rt_rllib._ORIGINAL_TARGETS(*args),), lambda: (rt_rllib.compute_value_targets(*args),),
               _version("ray"))


def rllib_vtrace(T, N):
    rt_rllib = _needs("rllib")
    _, randn, flags = _data()
    kw = dict(target_action_log_probs=0.1 * randn(T, N), behaviour_action_log_probs=0.1 * randn(T, N),
              discounts=GAMMA * (~flags(T, N)).float(), rewards=randn(T, N), values=randn(T, N),
              bootstrap_values=randn(N), clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0)
    return Row(lambda: rt_rllib._ORIGINAL_VTRACE[rt_rllib._impala](**kw), lambda: rt_rllib.vtrace_torch(**kw),
               _version("ray"))


def _response_mask(T, N, g):
    """``[N, T]`` masks of LLM responses: each row's first ``length`` tokens valid (at least two)."""
    lengths = torch.randint(2, T + 1, (N, 1), generator=g)
    return (torch.arange(T) < lengths).float().to(DEVICE)


def verl(T, N):
    import rl_triton.integrations.verl as rt_verl

    g, randn, _ = _data()
    args = (randn(N, T), randn(N, T), _response_mask(T, N, g), GAMMA, LAM)
    return Row(lambda: frameworks.verl_compute_gae_advantage_return(*args),
               lambda: rt_verl.compute_gae_advantage_return(*args), "verl 0.5 transcribed")


def verl_grpo(T, N):
    import rl_triton.integrations.verl as rt_verl

    g, randn, _ = _data()
    mask = _response_mask(T, N, g)
    rewards = randn(N, T) * mask
    index = np.array([f"prompt-{i // 4}" for i in range(N)], dtype=object)  # verl's uid strings
    return Row(lambda: (frameworks.verl_grpo(rewards.clone(), mask, index),),
               lambda: rt_verl.compute_grpo_outcome_advantage(rewards, mask, index)[:1], "verl 0.5 transcribed")


def openrlhf(T, N):
    import rl_triton.integrations.openrlhf as rt_openrlhf

    g, randn, _ = _data()
    args = (randn(N, T), randn(N, T), _response_mask(T, N, g), GAMMA, LAM)
    return Row(lambda: frameworks.openrlhf_gae(*args), lambda: rt_openrlhf.get_advantages_and_returns(*args),
               "openrlhf 0.11.2 transcribed")


def trl(T, N):
    import rl_triton.integrations.trl as rt_trl

    g, randn, _ = _data()
    padding = _response_mask(T, N, g) == 0
    rewards, values = randn(N, T).masked_fill(padding, 0), randn(N, T).masked_fill(padding, 0)

    def theirs():  # TRL's step 6: OpenRLHF's loop without a mask, then masked_whiten over ~padding
        adv, returns = frameworks.openrlhf_gae(values, rewards, None, GAMMA, LAM)
        return frameworks.verl_masked_whiten(adv, ~padding).masked_fill(padding, 0), returns

    return Row(theirs, lambda: rt_trl.compute_advantages(rewards, values, padding, GAMMA, LAM),
               "trl 1.12 PPOTrainer transcribed")


def cleanrl(T, N):
    import rl_triton.integrations.cleanrl as rt_cleanrl

    _, randn, flags = _data()
    args = (randn(T, N), randn(T, N), flags(T, N).float(), randn(1, N), flags(N).float(), GAMMA, LAM)
    return Row(lambda: frameworks.cleanrl_gae(*args), lambda: rt_cleanrl.compute_gae(*args),
               "cleanrl ppo.py transcribed")


def _peer(name: str):
    if name not in PEERS:
        raise Skip(f"no {name} peer (--peers-dir, CUDA)")
    return PEERS[name]


def rl_games_triton(T, N):
    """rl_games main's Triton GAE (what its ``discount_values`` calls on CUDA) against the drop-in."""
    import rl_triton.integrations.rl_games as rt_rl_games

    theirs = _peer("rl_games")
    _, randn, flags = _data()
    done = flags(T, N).float()
    fdones, last_values = done[-1], randn(N, 1)
    mb_fdones = torch.cat([torch.ones(1, N, device=DEVICE), done[:-1]])
    values, rewards = randn(T, N, 1), randn(T, N, 1)
    agent = types.SimpleNamespace(horizon_length=T, gamma=GAMMA, tau=LAM)
    return Row(lambda: (theirs(rewards, values, mb_fdones, last_values, fdones, GAMMA, LAM),),
               lambda: (rt_rl_games.discount_values(agent, fdones, last_values, mb_fdones, values, rewards),),
               "rl_games main (262cf20) Triton")


def pufferlib_op(T, N):
    """PufferLib 3.0.0's CUDA op against the drop-in on the same buffers' copies."""
    import rl_triton.integrations.pufferlib as rt_puffer

    op = _peer("pufferlib")
    _, randn, flags = _data()
    values, rewards, ratio = randn(N, T), randn(N, T), 1 + 0.1 * randn(N, T)
    terminals = flags(N, T).float()
    adv_theirs, adv_ours = torch.zeros(N, T, device=DEVICE), torch.zeros(N, T, device=DEVICE)
    clips = (GAMMA, LAM, 1.0, 1.0)

    def theirs():
        op(values, rewards, terminals, ratio, adv_theirs, *clips)
        return (adv_theirs[:, :-1],)  # its last column is never written (PufferLib 3.0.0)

    def ours():
        rt_puffer.compute_puff_advantage(values, rewards, terminals, ratio, adv_ours, *clips)
        return (adv_ours[:, :-1],)

    return Row(theirs, ours, "PufferLib 3.0.0 CUDA op")


def load_peers(folder: str) -> None:
    """Fill ``PEERS`` from a peers folder (``rl_games_master/``, ``pufferlib_ext/``); a peer that
    fails to load is printed and left out."""
    import importlib.util

    folder = os.path.abspath(folder)
    try:
        spec = importlib.util.spec_from_file_location("rl_games_master_gae",
                                                      os.path.join(folder, "rl_games_master", "gae_kernel.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        PEERS["rl_games"] = module._triton_gae
    except Exception as e:  # noqa: BLE001 - reported; the row is then skipped
        print(f"rl_games main peer: absent ({type(e).__name__}: {e})")
    sys.path.insert(0, folder)
    try:
        from pufferlib_ext.build import load_puff_advantage

        PEERS["pufferlib"] = load_puff_advantage()[0]
    except Exception as e:  # noqa: BLE001
        print(f"PufferLib op peer: absent ({type(e).__name__}: {e})")


# row name -> (the framework's call, the builder)
ROWS: Dict[str, tuple] = {
    "rl_games": ("A2CBase.discount_values", rl_games),
    "rl_games_masks": ("A2CBase.discount_values_masks", rl_games_masks),
    "skrl": ("ppo.compute_gae", skrl),
    "rsl_rl": ("PPO.compute_returns", rsl_rl),
    "pufferlib": ("compute_puff_advantage", pufferlib),
    "sb3": ("RolloutBuffer.compute_returns_and_advantage", sb3),
    "torchrl": ("GAE module", torchrl),
    "rllib": ("compute_value_targets", rllib_value_targets),
    "rllib_vtrace": ("vtrace_torch", rllib_vtrace),
    "verl": ("compute_gae_advantage_return", verl),
    "verl_grpo": ("compute_grpo_outcome_advantage", verl_grpo),
    "openrlhf": ("get_advantages_and_returns", openrlhf),
    "trl": ("compute advantages (step 6)", trl),
    "cleanrl": ("the GAE loop of ppo.py", cleanrl),
    "rl_games_triton": ("rl_games main's Triton compute_gae", rl_games_triton),
    "pufferlib_op": ("compute_puff_advantage (CUDA op)", pufferlib_op),
}


def largest_difference(theirs: tuple, ours: tuple) -> float:
    """The largest absolute difference over the output pairs (NaN where one differs in shape or
    holds a NaN the other does not)."""
    if len(theirs) != len(ours):
        return float("nan")
    worst = 0.0
    for a, b in zip(theirs, ours):
        a, b = (torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).double() for x in (a, b))
        if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
            return float("nan")
        both = ~a.isnan()
        worst = max(worst, (a[both] - b[both]).abs().max().item() if both.any() else 0.0)
    return worst


def replay_of(fn: Callable[[], object]) -> Callable[[], object]:
    """A CUDA graph of one call of ``fn`` (captured on a side stream after a warm-up there), as
    a function that replays it; raises where the call cannot be captured (it synchronises)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def gpu_alternate(impls: Dict[str, Callable[[], object]], rounds: int, calls: int) -> Dict[str, List[float]]:
    """Per implementation and round, the median full call of ``calls`` calls (benchmarks/run.py's
    ``_full_call_round``), in seconds; the order rotates per round."""
    from run import _full_call_round

    names = list(impls)
    for fn in impls.values():
        fn()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(1e-6 * _full_call_round(impls[name], calls))
    return times


def run(names, T: int, N: int, rounds: int = 9, batch_s: float = 0.05, atol: float = 1e-4,
        timer=alternate, out=print, calls: int = 30) -> bool:
    """Check and time each row of ``ROWS`` named in ``names``; print the table with ``out``.
    True where every row that could be built ran and agreed. ``timer`` is ``alternate``'s
    signature (``impls``, ``rounds``, ``batch_s``)."""
    gpu = DEVICE.type == "cuda"
    if gpu:
        out("| framework | call | source | framework's call: full (us) | drop-in: full (us) | drop-in / framework "
            f"| {FIRST_COLUMNS} | replay of the drop-in's kernels: full (us) | drop-in / replay "
            "| drop-in back to back (us) | replay back to back (us) | largest difference |"
            "\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    else:
        out(f"| framework | call | source | framework's call (us) | drop-in (us) | drop-in / framework "
            f"| {FIRST_COLUMNS} | largest difference |\n|---|---|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name in names:
        call, build = ROWS[name]
        try:
            row = build(T, N)
        except Skip as e:
            out(f"| {name} | {call} | skipped: {e} | | | | | | |")
            continue
        try:
            diff = largest_difference(row.theirs(), row.ours())
        except Exception as e:  # noqa: BLE001 - reported, then the exit status says so
            out(f"| {name} | {call} | {row.source} | | error: {type(e).__name__}: {e} | | | | FAILS |")
            ok = False
            continue
        bad = not diff <= atol
        ok &= not bad
        if gpu:
            out(_gpu_row(name, call, row, rounds, calls, diff, bad))
            continue
        times = timer({"theirs": row.theirs, "ours": row.ours}, rounds, batch_s)
        us = [spread([1e6 * t for t in times[k]], "{:.1f}") for k in ("theirs", "ours")]
        out(f"| {name} | {call} | {row.source} | {us[0]} | {us[1]} | "
            f"{spread(ratios(times['ours'], times['theirs']), '{:.2f}', 'x')} | {_first_cells(row.ours, rounds)} | "
            f"{diff:.1e}{' FAILS' if bad else ''} |")
    return ok


FIRST_COLUMNS = "drop-in: first call of its signature (us) | second call (us)"


def _first_cells(fn, rounds: int) -> str:
    times = first_calls(fn, rounds, DEVICE.type)
    return f"{spread(times['first'], '{:.1f}')} | {spread(times['second'], '{:.1f}')}"


def _gpu_row(name, call, row: Row, rounds: int, calls: int, diff: float, bad: bool) -> str:
    from run import _throughput_round

    try:
        replay = replay_of(row.ours)
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured has no replay column
        replay, why = None, f"not capturable ({type(e).__name__})"
    impls = {"theirs": row.theirs, "ours": row.ours}
    if replay is not None:
        impls["replay"] = replay
    times = gpu_alternate(impls, rounds, calls)
    us = {k: spread([1e6 * t for t in v], "{:.1f}") for k, v in times.items()}
    b2b = {k: f"{_throughput_round(fn, 10 * calls):.1f}" for k, fn in impls.items()}
    vs_theirs = spread(ratios(times["ours"], times["theirs"]), "{:.2f}", "x")
    if replay is None:
        replay_cells = f"{why} | | {b2b['ours']} |"
    else:
        replay_cells = (f"{us['replay']} | {spread(ratios(times['ours'], times['replay']), '{:.2f}', 'x')} | "
                        f"{b2b['ours']} | {b2b['replay']}")
    return (f"| {name} | {call} | {row.source} | {us['theirs']} | {us['ours']} | {vs_theirs} | "
            f"{_first_cells(row.ours, rounds)} | {replay_cells} | "
            f"{diff:.1e}{' FAILS' if bad else ''} |")


def main(argv=None, timer=alternate) -> int:
    """The command line (``argv``, default ``sys.argv[1:]``); returns the exit status.
    ``timer`` as in :func:`run`."""
    p = parser(__doc__)
    p.add_argument("--shape", default="16x64", help="T x N: steps x environments (LLM rows: N responses of T tokens)")
    p.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--batch-s", type=float, default=0.05, help="seconds of back-to-back calls per timed batch")
    p.add_argument("--atol", type=float, default=1e-4, help="largest difference from the framework's outputs")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU columns")
    p.add_argument("--calls", type=int, default=30, help="CUDA: calls timed one by one per round")
    p.add_argument("--peers-dir", metavar="DIR", help="CUDA: folder with rl_games_master/ and pufferlib_ext/")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's and numba's CPU threads (0: their defaults); 1 on a machine whose cores are busy")
    a = p.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(a.device)
    set_threads(a.threads)
    if a.peers_dir and DEVICE.type == "cuda":
        load_peers(a.peers_dir)
    names = a.only.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; the rows are {', '.join(ROWS)}")
    T, N = (int(x) for x in a.shape.split("x"))
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
    print(f"{machine()}; torch {torch.__version__}; {T} x {N} float32, {where}; us per call, median "
          f"(lowest-highest) of {a.rounds} rounds")
    ok = run(names, T, N, a.rounds, a.batch_s, a.atol, timer, calls=a.calls)
    if not ok:
        print("FAILED: a drop-in erred or disagreed with its framework's call (--atol) in a row")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
