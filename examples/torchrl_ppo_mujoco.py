"""PPO on a MuJoCo task (HalfCheetah-v5, batched envs) with TorchRL, its GAE either TorchRL's
own or rl_triton's fused scan (rl_triton.integrations.torchrl.patch()).

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/torchrl_ppo_mujoco.py              # rl_triton's GAE
    python examples/torchrl_ppo_mujoco.py --no-patch   # TorchRL's GAE (the default, loop path)
    python examples/torchrl_ppo_mujoco.py --compare    # both, side by side

Prints the median time per advantage-module call and per update phase, and writes timings.csv,
episodes.csv and returns.png under --out. The default budget
finishes in a few minutes on a CPU. torchrl_impala_vtrace.py reuses the helpers here.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import parser, progress, quiet_mujoco, require, returns_plot  # noqa: E402

ENV = "HalfCheetah-v5"


def parse_args(doc: str, frames: int, n_envs: int, steps: int, out: str):
    p = parser(doc)
    p.add_argument("--frames", type=int, default=frames, help="total environment frames")
    p.add_argument("--n-envs", type=int, default=n_envs, help="environments stepped together (SerialEnv)")
    p.add_argument("--steps", type=int, default=steps, help="steps per env per batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments and torch")
    p.add_argument("--out", default=out, help="folder for the CSV and PNG outputs")
    p.add_argument("--device", default="cpu", help="where the networks, the batch and the estimator run "
                   "(the environments step on the CPU)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-patch", action="store_true", help="TorchRL's own estimator only")
    g.add_argument("--compare", action="store_true", help="TorchRL's, then rl_triton's")
    return p.parse_args()


def make_env(n_envs: int, seed: int):
    from torchrl.envs import Compose, DoubleToFloat, GymEnv, RewardSum, SerialEnv, TransformedEnv

    quiet_mujoco()
    env = TransformedEnv(SerialEnv(n_envs, lambda: GymEnv(ENV)), Compose(DoubleToFloat(), RewardSum()))
    env.set_seed(seed)
    return env


def make_modules(env, device):
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator

    n_obs = env.observation_spec["observation"].shape[-1]
    n_act = env.action_spec.shape[-1]
    policy = TensorDictModule(
        nn.Sequential(MLP(in_features=n_obs, out_features=2 * n_act, num_cells=[64, 64], activation_class=nn.Tanh),
                      NormalParamExtractor()),
        in_keys=["observation"], out_keys=["loc", "scale"],
    )
    spec = env.full_action_spec_unbatched[env.action_key].to(device)
    actor = ProbabilisticActor(policy, in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal,
                               distribution_kwargs={"low": spec.space.low, "high": spec.space.high},
                               return_log_prob=True)
    critic = ValueOperator(MLP(in_features=n_obs, out_features=1, num_cells=[64, 64], activation_class=nn.Tanh),
                           in_keys=["observation"])
    return actor.to(device), critic.to(device)


def train(args, build, patch: bool, label: str):
    """``build(env, actor, critic) -> (advantage_module, loss, update_fn)``; one run, timed."""
    from torchrl.collectors import Collector

    import rl_triton.integrations.torchrl as rt_torchrl

    torch.manual_seed(args.seed)
    (rt_torchrl.patch if patch else rt_torchrl.unpatch)()
    try:
        env = make_env(args.n_envs, args.seed)
        device = torch.device(args.device)
        actor, critic = make_modules(env, device)
        adv_module, loss, update = build(env, actor, critic)
        collector = Collector(env, actor, frames_per_batch=args.n_envs * args.steps, total_frames=args.frames,
                              auto_register_policy_transforms=False, env_device="cpu", policy_device=device,
                              storing_device=device)

        def clock():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter()

        timings = {"advantage": [], "update": []}
        episodes = []
        frames = 0
        bar = progress(args.frames, label, unit="frame")
        for data in collector:  # [n_envs, steps]
            if not frames:  # warm-up (numba compiles on the first call), not timed
                with torch.no_grad():
                    adv_module(data.clone())
            frames += data.numel()
            t0 = clock()
            with torch.no_grad():
                adv_module(data)
            timings["advantage"].append(clock() - t0)
            t0 = clock()
            update(data)
            timings["update"].append(clock() - t0)
            done = data["next", "done"]
            for r in data["next", "episode_reward"][done].tolist():
                episodes.append((label, frames, r))
            if bar is not None:
                if episodes:
                    bar.set_postfix(last_return=f"{episodes[-1][2]:.1f}", refresh=False)
                bar.update(data.numel())
            collector.update_policy_weights_()
        if bar is not None:
            bar.close()
        collector.shutdown()
        cls = type(adv_module)
        print(f"{label}: {len(timings['advantage'])} batches, estimator {cls.__module__}.{cls.__name__}, "
              f"rl_triton patch active: {rt_torchrl.is_patched()}")
        return timings, episodes
    finally:
        rt_torchrl.unpatch()


def ppo_build(args):
    def build(env, actor, critic):
        from torchrl.objectives import ClipPPOLoss

        loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.0, normalize_advantage=True)
        adv_module = loss.value_estimator  # the registry's GAE: TorchRL's, or rl_triton's when patched
        optim = torch.optim.Adam(loss.parameters(), lr=3e-4)

        def update(data):
            for _ in range(4):
                minibatch_pass(loss, optim, data, 256, ("loss_objective", "loss_critic", "loss_entropy"), 1.0)

        return adv_module, loss, update

    return build


def minibatch_pass(loss, optim, data, batch_size: int, terms, max_grad_norm: float):
    """One pass over the batch in shuffled minibatches: the sum of the loss ``terms``, clipped
    gradients, an optimiser step each."""
    flat = data.reshape(-1)
    for idx in torch.randperm(flat.numel(), device=flat.device).split(batch_size):
        out = loss(flat[idx])
        total = sum(out[term] for term in terms)
        optim.zero_grad()
        total.backward()
        nn.utils.clip_grad_norm_(loss.parameters(), max_grad_norm)
        optim.step()


def report(results, out: str, title: str):
    os.makedirs(out, exist_ok=True)
    labels = list(results)
    print(f"\n{title}: median ms per call")
    print("| | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    rows = []
    for key in ("advantage", "update"):
        cells = [1e3 * statistics.median(results[label][0][key]) for label in labels]
        rows.append([key, *cells])
        print(f"| {key} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    with open(os.path.join(out, "timings.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["phase", *labels], *rows])
    with open(os.path.join(out, "episodes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "frames", "episode_return"])
        for label in labels:
            w.writerows(results[label][1])
    returns_plot(os.path.join(out, "returns.png"), {label: [e[1:] for e in results[label][1]] for label in labels},
                 title, "frames")
    print(f"wrote {out}/timings.csv, episodes.csv and returns.png")


def main(doc, build, title, frames, n_envs, steps, out):
    """Parse the command line of the script whose docstring is ``doc``, check the optional
    packages, and train (TorchRL's estimator, rl_triton's, or both) and report."""
    args = parse_args(doc, frames, n_envs, steps, out)
    require("torchrl", "tensordict", "gymnasium", "mujoco", "matplotlib")
    runs = [(False, "TorchRL")] if args.no_patch else [(True, "rl_triton")]
    if args.compare:
        runs = [(False, "TorchRL"), (True, "rl_triton")]
    results = {label: train(args, build(args), patch, label) for patch, label in runs}
    report(results, args.out, title)


if __name__ == "__main__":
    main(__doc__, ppo_build, f"TorchRL PPO, {ENV}", frames=40_960, n_envs=8, steps=512,
         out="runs/torchrl_ppo_mujoco")
