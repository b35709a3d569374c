"""PPO on an Atari game (ALE Pong with SB3's Atari wrappers and 4-frame stacking, vectorised
envs) with Stable-Baselines3, its GAE either SB3's own loop or rl_triton's fused scan.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/sb3_ppo_atari.py               # rl_triton's GAE
    python examples/sb3_ppo_atari.py --no-patch    # SB3's loop
    python examples/sb3_ppo_atari.py --compare     # both, side by side

The environment is ALE/Pong-v5 made with frameskip=1, so that SB3's AtariWrapper does the
standard frame skipping (4 frames per step, max-pooled over the last two) and v5's sticky
actions stay on. Prints the time per call of compute_returns_and_advantage and of the update,
and writes episode returns (CSV and PNG) under --out. The default budget finishes in a few
minutes on a CPU (far too short to learn Pong: it shows the plumbing and the timings).
"""

from sb3_common import main

N_STEPS = 128


def make_model(args):
    import ale_py
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    # v5 repeats each action 4 frames by default; frameskip=1 leaves the skipping to AtariWrapper
    env = make_atari_env("ALE/Pong-v5", n_envs=args.n_envs, seed=args.seed, env_kwargs={"frameskip": 1})
    env = VecFrameStack(env, n_stack=4)
    return PPO("CnnPolicy", env, n_steps=N_STEPS, batch_size=256, n_epochs=2, learning_rate=2.5e-4, clip_range=0.1,
               ent_coef=0.01, seed=args.seed, device="cpu", verbose=0)


if __name__ == "__main__":
    main(__doc__, make_model, n_steps=N_STEPS, timesteps=4096, n_envs=8, out="runs/sb3_ppo_atari",
         title="SB3 PPO, ALE/Pong-v5", needs=("ale_py", "cv2"))
