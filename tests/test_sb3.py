"""Stable-Baselines3 integration: same results as SB3's own loop, patching semantics, SB3's
own GAE and buffer tests with the patch applied, and learn() smoke runs."""

import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import threading

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")
sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer  # noqa: E402

import rl_triton.integrations.sb3 as rt_sb3  # noqa: E402
from helpers import count_calls  # noqa: E402

ORIGINAL = RolloutBuffer.__dict__["compute_returns_and_advantage"]


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_sb3.unpatch()


def _filled(cls, T, N, gamma, lam, rng, dict_obs=False):
    obs_space = (gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,)), "b": gym.spaces.Discrete(3)})
                 if dict_obs else gym.spaces.Box(-1, 1, (3,)))
    buf = cls(T, obs_space, gym.spaces.Discrete(2), "cpu", gae_lambda=lam, gamma=gamma, n_envs=N)
    buf.rewards[:] = rng.standard_normal((T, N))
    buf.values[:] = rng.standard_normal((T, N))
    buf.episode_starts[:] = rng.random((T, N)) < 0.2
    buf.episode_starts[0] = rng.random(N) < 0.5
    return buf


def _run(method, buf, last_values, dones):
    method(buf, last_values, dones)
    return buf.advantages.copy(), buf.returns


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 1.0), (0.99, 0.0), (0.0, 0.5)])
@pytest.mark.parametrize("T,N", [(1, 1), (7, 3), (64, 8), (333, 5)])
@pytest.mark.parametrize("dict_obs", [False, True])
@pytest.mark.parametrize("short_rollouts", ["sb3_loop", "fused", "fused, written in place"])
def test_matches_sb3(T, N, gamma, lam, dict_obs, short_rollouts, monkeypatch):
    if short_rollouts != "sb3_loop":  # the fused call at every length, short rollouts included
        monkeypatch.setattr(rt_sb3, "LOOP_MAX_STEPS", 0)
    if short_rollouts == "fused, written in place":  # the large buffers' path (out=) at every size
        monkeypatch.setattr(rt_sb3, "FRESH_MAX_ELEMENTS", 0)
    rng = np.random.default_rng(T * 100 + N)
    cls = DictRolloutBuffer if dict_obs else RolloutBuffer
    for trial in range(3):
        seed = rng.integers(1 << 30)
        ref_buf = _filled(cls, T, N, gamma, lam, np.random.default_rng(seed), dict_obs)
        buf = _filled(cls, T, N, gamma, lam, np.random.default_rng(seed), dict_obs)
        last_values = torch.randn(N, 1)
        dones = rng.random(N) < 0.5
        dones[0] = trial == 0  # the window's last step ends an episode in some rows
        ref_adv, ref_ret = _run(ORIGINAL, ref_buf, last_values, dones)
        adv_array = buf.advantages
        adv, ret = _run(rt_sb3.compute_returns_and_advantage, buf, last_values, dones)
        assert buf.advantages is adv_array, "advantages must be written in place"
        assert buf.advantages.dtype == np.float32 and buf.returns.dtype == np.float32
        assert buf.returns.shape == (T, N)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(buf.returns, buf.advantages + buf.values)


def test_patch_roundtrip_and_idempotence():
    assert not rt_sb3.is_patched()
    rt_sb3.patch()
    rt_sb3.patch()
    assert rt_sb3.is_patched()
    assert RolloutBuffer.compute_returns_and_advantage is rt_sb3.compute_returns_and_advantage
    assert DictRolloutBuffer.compute_returns_and_advantage is rt_sb3.compute_returns_and_advantage
    rt_sb3.unpatch()
    rt_sb3.unpatch()
    assert RolloutBuffer.__dict__["compute_returns_and_advantage"] is ORIGINAL
    assert not rt_sb3.is_patched()
    with rt_sb3.patched():
        assert rt_sb3.is_patched()
    assert RolloutBuffer.__dict__["compute_returns_and_advantage"] is ORIGINAL


def test_patched_context_keeps_an_outer_patch():
    rt_sb3.patch()
    with rt_sb3.patched():
        pass
    assert rt_sb3.is_patched()


def test_bad_settings():
    with pytest.raises(TypeError, match="device"):
        rt_sb3.patch(device=3)
    with pytest.raises(ValueError, match="gpu_min_elements"):
        rt_sb3.patch(gpu_min_elements=-1)
    with pytest.raises(ValueError, match="device"):
        rt_sb3.patch(device="gpu0")
    spaces = (gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2))
    with pytest.raises(TypeError, match="gae_device"):
        rt_sb3.FastRolloutBuffer(4, *spaces, gae_device=1)
    with pytest.raises(TypeError, match="unknown_kwarg"):
        rt_sb3.FastRolloutBuffer(4, *spaces, unknown_kwarg=2)


def test_cuda_device_without_cuda_fails_at_once(monkeypatch):
    spaces = (gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="device='cuda.*CUDA"):
            rt_sb3.patch(device=device)
        with pytest.raises(ValueError, match="device='cuda"):
            with rt_sb3.patched(device=device):
                pass
        with pytest.raises(ValueError, match="gae_device='cuda.*CUDA"):
            rt_sb3.FastRolloutBuffer(4, *spaces, gae_device=device)
    assert not rt_sb3.is_patched()
    rt_sb3.patch(device="auto")  # "auto" uses the GPU only where there is one
    rt_sb3.unpatch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="device='cuda:2'.*2"):
        rt_sb3.patch(device="cuda:2")
    assert not rt_sb3.is_patched()


def test_patch_holders_across_threads(monkeypatch):
    # patch() and every open patched() block, in any thread, hold one shared patch; the latest
    # holder's settings apply, and a holder's settings leave with it
    devices = []
    monkeypatch.setattr(rt_sb3, "_target_device", lambda name, *_: devices.append(name) or torch.device("cpu"))
    buf = _filled(RolloutBuffer, 16, 2, 0.99, 0.95, np.random.default_rng(0))

    def device_used():
        RolloutBuffer.compute_returns_and_advantage(buf, torch.zeros(2, 1), np.zeros(2))
        return devices.pop()  # IndexError where SB3's own method ran

    with rt_sb3.patched():  # unpatch() withdraws patch() only: the block keeps its patch
        rt_sb3.patch()
        rt_sb3.unpatch()
        assert device_used() == "cpu"
    assert RolloutBuffer.__dict__["compute_returns_and_advantage"] is ORIGINAL
    rt_sb3.patch(device="auto")
    with rt_sb3.patched(device="cpu"):
        assert device_used() == "cpu"
        rt_sb3.patch(device="auto")  # the latest holder now, and it outlives the block
        assert device_used() == "auto"
    assert device_used() == "auto"
    # blocks that close out of order across threads
    rt_sb3.patch(device="cpu")
    opened, release = threading.Event(), threading.Event()

    def block():
        with rt_sb3.patched(device="auto"):
            opened.set()
            release.wait(5)

    thread = threading.Thread(target=block)
    thread.start()
    opened.wait(5)
    assert device_used() == "auto"
    with rt_sb3.patched(device="cpu"):
        release.set()
        thread.join()  # the other thread's block closed: this one is still patched
        assert device_used() == "cpu"
    assert device_used() == "cpu"  # patch()'s, not the settings from before the block opened
    rt_sb3.unpatch()
    assert RolloutBuffer.__dict__["compute_returns_and_advantage"] is ORIGINAL


def _counting(monkeypatch):
    return count_calls(monkeypatch, rt_sb3)


@pytest.mark.parametrize("algo", ["PPO", "A2C"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_learn_with_patch(algo, when, monkeypatch):
    calls = _counting(monkeypatch)
    cls = getattr(sb3, algo)
    if when == "before":
        rt_sb3.patch()
    model = cls("MlpPolicy", "CartPole-v1", n_steps=32, seed=0, device="cpu")
    if when == "after":
        rt_sb3.patch()
    model.learn(128)
    assert len(calls) >= 2


def test_rollout_buffer_class(monkeypatch):
    calls = _counting(monkeypatch)
    model = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, seed=0, device="cpu",
                    rollout_buffer_class=rt_sb3.FastRolloutBuffer)
    model.learn(64)
    assert isinstance(model.rollout_buffer, rt_sb3.FastRolloutBuffer)
    assert len(calls) >= 2 and not rt_sb3.is_patched()


def test_short_rollouts_keep_sb3s_loop_on_the_cpu(monkeypatch):
    calls = _counting(monkeypatch)
    for T, fused in ((rt_sb3.LOOP_MAX_STEPS, False), (rt_sb3.LOOP_MAX_STEPS + 1, True)):
        ref_buf = _filled(RolloutBuffer, T, 4, 0.99, 0.95, np.random.default_rng(T))
        buf = _filled(RolloutBuffer, T, 4, 0.99, 0.95, np.random.default_rng(T))
        last_values, dones = torch.randn(4, 1), np.array([True, False, False, True])
        ref_adv, ref_ret = _run(ORIGINAL, ref_buf, last_values, dones)
        before = len(calls)
        adv, ret = _run(rt_sb3.compute_returns_and_advantage, buf, last_values, dones)
        assert (len(calls) > before) == fused
        if not fused:  # SB3's own loop: the same bits
            np.testing.assert_array_equal(adv, ref_adv)
            np.testing.assert_array_equal(ret, ref_ret)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_path_matches_sb3():
    rng = np.random.default_rng(0)
    ref_buf = _filled(RolloutBuffer, 128, 16, 0.99, 0.95, np.random.default_rng(1))
    buf = _filled(RolloutBuffer, 128, 16, 0.99, 0.95, np.random.default_rng(1))
    last_values, dones = torch.randn(16, 1, device="cuda"), rng.random(16) < 0.5
    ref_adv, ref_ret = _run(ORIGINAL, ref_buf, last_values, dones)
    rt_sb3.patch(device="cuda")
    adv, ret = _run(RolloutBuffer.compute_returns_and_advantage, buf, last_values, dones)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_sb3_contrib_buffers_inherit_the_patch():
    contrib = pytest.importorskip("sb3_contrib")
    from sb3_contrib.common.maskable.buffers import MaskableRolloutBuffer
    from sb3_contrib.common.recurrent.buffers import RecurrentRolloutBuffer

    rt_sb3.patch()
    for cls in (MaskableRolloutBuffer, RecurrentRolloutBuffer):
        assert cls.compute_returns_and_advantage is rt_sb3.compute_returns_and_advantage, contrib


_CONFTEST = """
import rl_triton.integrations.sb3 as rt_sb3
from stable_baselines3.common.buffers import RolloutBuffer

calls = []
inner = rt_sb3.compute_returns_and_advantage


def counted(self, last_values, dones):
    calls.append(1)
    return inner(self, last_values, dones)


def pytest_configure(config):
    rt_sb3.patch()
    RolloutBuffer.compute_returns_and_advantage = counted


def pytest_unconfigure(config):
    assert calls, "the patched method was never called"
    print(f"rl_triton patched compute_returns_and_advantage called {len(calls)} times")
"""


def _sb3_sdist(version: str):
    """SB3's source distribution of ``version``, downloaded once into a cache folder keyed by
    the version and reused by later runs (``RL_TRITON_TEST_CACHE``, else
    ``$XDG_CACHE_HOME/rl_triton`` or ``~/.cache/rl_triton``). Skips the test, with the reason,
    where it is not cached and the package registry cannot be reached."""
    root = os.environ.get("RL_TRITON_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rl_triton")
    folder = pathlib.Path(root) / "sb3-sdist" / version
    cached = sorted(folder.glob("stable_baselines3-*.tar.gz"))
    if cached:
        return cached[0]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: cache under the temporary folder instead
        folder = pathlib.Path(tempfile.gettempdir()) / "rl_triton-test-cache" / "sb3-sdist" / version
        folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as download:
        try:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "--timeout", "30", "--retries", "1", f"stable-baselines3=={version}", "-d",
                                  download, "-q"], capture_output=True, text=True, timeout=300)
            error = got.stderr.strip()[-300:] if got.returncode else ""
        except subprocess.TimeoutExpired:
            error = "pip download took over 300 s"
        sdists = list(pathlib.Path(download).glob("stable_baselines3-*.tar.gz"))
        if error or not sdists:
            pytest.skip(f"the stable-baselines3 {version} source distribution is not cached in {folder} and "
                        f"could not be downloaded (package registry unreachable?): {error or 'no sdist'}")
        target = folder / sdists[0].name
        os.replace(sdists[0], target)  # atomic: a concurrent run sees the whole file or none
    return target


def test_sb3_own_tests_pass_patched(tmp_path):
    """SB3's tests/test_gae.py and tests/test_buffers.py from its source distribution."""
    version = sb3.__version__
    sdist = _sb3_sdist(version)
    names = [f"stable_baselines3-{version}/tests/{n}" for n in ("test_gae.py", "test_buffers.py")]
    with tarfile.open(sdist) as tar:
        for name in names:
            tar.extract(name, tmp_path, filter="data")
    test_dir = tmp_path / f"stable_baselines3-{version}" / "tests"
    (test_dir / "conftest.py").write_text(_CONFTEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(test_dir)],
                            capture_output=True, text=True, cwd=test_dir, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "called" in result.stdout
