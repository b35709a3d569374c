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
actions stay on. Each rollout's buffer goes through SB3's compute_returns_and_advantage and
rl_triton's, one after the other, and the run trains with the one picked: prints the time per
call of both, their ratio, and the time of the update, and writes the timings and the episode
returns (CSV and PNG) under --out. A game of Pong lasts 800 to 1,100 steps (of 4 frames) while
the policy is still untrained, so the default budget, 2 envs x 2,048 steps, finishes about 2
games per env. It runs in a few minutes on 2 CPU cores (far too short to learn Pong: it shows
the plumbing and the timings).
"""

from sb3_common import main

N_STEPS = 128
N_ENVS = 2
TIMESTEPS = 4096  # all envs together


def make_env(args):
    """ALE/Pong-v5 in SB3's Atari wrappers (with Monitor), ``args.n_envs`` of them, 4 frames stacked."""
    import ale_py
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    # v5 repeats each action 4 frames by default; frameskip=1 leaves the skipping to AtariWrapper
    env = make_atari_env("ALE/Pong-v5", n_envs=args.n_envs, seed=args.seed, env_kwargs={"frameskip": 1})
    return VecFrameStack(env, n_stack=4)


def make_model(args):
    from stable_baselines3 import PPO

    return PPO("CnnPolicy", make_env(args), n_steps=N_STEPS, batch_size=256, n_epochs=2, learning_rate=2.5e-4,
               clip_range=0.1, ent_coef=0.01, seed=args.seed, device="cpu", verbose=0)


if __name__ == "__main__":
    main(__doc__, make_model, n_steps=N_STEPS, timesteps=TIMESTEPS, n_envs=N_ENVS, out="runs/sb3_ppo_atari",
         title="SB3 PPO, ALE/Pong-v5", needs=("ale_py", "cv2"))
