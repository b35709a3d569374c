"""The Learner-class route into Ray actors: ``config.learners(learner_class=rt_rllib.PPOTorchLearner)``
runs the device-resident GAE connector inside a real remote Learner actor (``num_learners=1``),
and a plain PPO config does not run rl_triton there. One Ray cluster for the module."""

import math

import pytest

pytest.importorskip("ray.rllib", reason="needs the rllib extra: pip install -e '.[rllib]'")

from helpers import rllib_ray_init, rllib_remote_ppo_counts  # noqa: E402

import rl_triton.integrations.rllib as rt_rllib  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    import ray

    rllib_ray_init()
    yield
    ray.shutdown()


def test_learner_class_runs_the_fused_connector_in_the_remote_learner(cluster):
    driver_before = rt_rllib.call_counts()
    report = rllib_remote_ppo_counts(rt_rllib.PPOTorchLearner)
    assert report["ours"]
    assert report["counts"]["connector"] >= 1  # ran there, in the actor process
    assert report["docs_recipe"] == [report["counts"]]  # docs/rllib.md's recipe reads them as written
    assert not report["patched"]  # by the class, without patching RLlib in the actor
    assert math.isfinite(report["loss"])
    assert rt_rllib.call_counts() == driver_before and not rt_rllib.is_patched()  # the driver untouched


def test_plain_config_does_not_run_rl_triton_in_the_remote_learner(cluster):
    rt_rllib.patch()  # a patch in the driver does not reach the actor
    try:
        report = rllib_remote_ppo_counts()
    finally:
        rt_rllib.unpatch()
    assert not report["ours"]
    assert not report["patched"]
    assert report["counts"] == {"compute_value_targets": 0, "connector": 0, "vtrace_torch": 0}
    assert math.isfinite(report["loss"])
