"""benchmarks/multi_gpu_check.py: its torch.distributed parts run here with gloo on the CPU (two
ranks: a DDP loop, GAE per shard gathered and compared with the whole rollout and the oracle;
one sequence split along time, every estimator against the single-device call); its
device-placement part needs CUDA."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "multi_gpu_check.py"), *args],
                            capture_output=True, text=True, env=env, timeout=600)
    return result.returncode, result.stdout + result.stderr


def test_two_gloo_ranks_match_the_single_device_gae():
    rc, out = _run(["--dist-backend", "gloo", "--world-size", "2", "--skip-devices"])
    assert rc == 0, out[-3000:]
    assert "ok   2 ranks (gloo, CPU), 3 DDP steps: gathered GAE vs single device" in out
    assert "ok   2 ranks (gloo, CPU): gathered GAE vs float64 oracle" in out
    assert "ok   2 ranks (gloo, CPU), sequences split along time: every estimator, masks, group advantages vs single " \
        "device, float64" in out
    assert "5/5 checks passed" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_placement_on_this_machine():
    rc, out = _run(["--dist-backend", "gloo"])
    assert rc == 0, out[-3000:]
