"""IMPALA-style V-trace actor-critic on a MuJoCo task (HalfCheetah-v5) with TorchRL, its V-trace
either TorchRL's own loop or rl_triton's fused scan (rl_triton.integrations.torchrl.patch()).

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/torchrl_impala_vtrace.py              # rl_triton's V-trace
    python examples/torchrl_impala_vtrace.py --no-patch   # TorchRL's
    python examples/torchrl_impala_vtrace.py --compare    # both, side by side

Each batch is learned from for two passes: the second pass re-runs V-trace with the updated
actor, so the importance weights pi/mu correct for the policy lag, as in IMPALA's learner.
Outputs as in torchrl_ppo_mujoco.py (whose helpers this script reuses).
"""

from __future__ import annotations

import torch

from torchrl_ppo_mujoco import ENV, main, minibatch_pass


def impala_build(args):
    def build(env, actor, critic):
        from torchrl.objectives import A2CLoss
        from torchrl.objectives.value import VTrace

        # TorchRL's class, built directly as in TorchRL's impala_single_node.py: patch() reaches it
        adv_module = VTrace(gamma=0.99, value_network=critic, actor_network=actor, average_adv=False)
        loss = A2CLoss(actor, critic, loss_critic_type="l2", entropy_coeff=0.0)
        optim = torch.optim.RMSprop(loss.parameters(), lr=3e-4)

        def update(data):
            for epoch in range(2):
                if epoch:  # V-trace again, now off-policy by one pass of updates
                    with torch.no_grad():
                        adv_module(data)
                minibatch_pass(loss, optim, data, 512, ("loss_objective", "loss_critic"), 40.0)

        return adv_module, loss, update

    return build


if __name__ == "__main__":
    main(__doc__, impala_build, f"TorchRL IMPALA (V-trace), {ENV}", frames=40_960, n_envs=8,
         steps=256, out="runs/torchrl_impala_vtrace")
