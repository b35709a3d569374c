"""PPO on a MuJoCo task (HalfCheetah-v5, vectorised envs) with Stable-Baselines3, its GAE either
SB3's own loop or rl_triton's fused scan.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/sb3_ppo_mujoco.py              # rl_triton's GAE
    python examples/sb3_ppo_mujoco.py --no-patch   # SB3's loop
    python examples/sb3_ppo_mujoco.py --compare    # both, side by side

Each rollout's buffer goes through SB3's compute_returns_and_advantage and rl_triton's, one
after the other, and the run trains with the one picked: prints the time per call of both, their
ratio, and the time of the update, and writes the timings and the episode returns (CSV and PNG)
under --out. The default budget finishes in a few minutes on a CPU.
"""

from sb3_common import main

from rl_triton._scripts import quiet_mujoco

N_STEPS = 512


def make_model(args):
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    quiet_mujoco()
    env = make_vec_env("HalfCheetah-v5", n_envs=args.n_envs, seed=args.seed)
    return PPO("MlpPolicy", env, n_steps=N_STEPS, batch_size=256, n_epochs=5, gamma=0.99, gae_lambda=0.95,
               seed=args.seed, device="cpu", verbose=0)


if __name__ == "__main__":
    main(__doc__, make_model, n_steps=N_STEPS, timesteps=24_576, n_envs=8, out="runs/sb3_ppo_mujoco",
         title="SB3 PPO, HalfCheetah-v5", needs=("mujoco",))
