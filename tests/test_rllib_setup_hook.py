"""The setup-hook route into Ray actors: ``ray.init(runtime_env={"worker_process_setup_hook":
"rl_triton.integrations.rllib.patch"})`` patches every worker process, so a plain PPO config's
remote Learner (``num_learners=1``) builds and runs the fused GAE connector. One Ray cluster,
with the hook, for the module (tests/test_rllib_actors.py has the cluster without it)."""

import math

import pytest

pytest.importorskip("ray.rllib", reason="needs the rllib extra: pip install -e '.[rllib]'")

from helpers import rllib_ray_init, rllib_remote_ppo_counts  # noqa: E402

import rl_triton.integrations.rllib as rt_rllib  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    import ray

    rllib_ray_init(runtime_env={"worker_process_setup_hook": "rl_triton.integrations.rllib.patch"})
    yield
    ray.shutdown()


def test_setup_hook_patches_the_remote_learner(cluster):
    report = rllib_remote_ppo_counts()
    assert report["patched"]  # the hook ran patch() in the actor process
    assert report["counts"]["connector"] >= 1  # PPOLearner.build appended the fused connector there
    assert math.isfinite(report["loss"])
    assert not rt_rllib.is_patched()  # the driver is not a worker: the hook does not run here
