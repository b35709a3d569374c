"""PufferLib drop-in: ``compute_puff_advantage`` against a loop transcribed from pufferlib 3.0.0's
``pufferlib/extensions/pufferlib.cpp`` (``rl_triton.testing.frameworks.pufferlib_advantage``) in
float32 and float64, and against PufferLib's own CPU op built from its source distribution
where a C++ compiler is present; the in-place contract, the last column, bfloat16, errors; and
patch()/unpatch()/patched() on a stand-in ``pufferlib`` package (pufferlib 3.0.0 itself does
not install beside the other frameworks: docs/pufferlib.md says why)."""

from __future__ import annotations

import hashlib
import io
import math
import os
import pathlib
import shutil
import sys
import tarfile
import textwrap
import threading

import pytest
import torch

import rl_triton.integrations.pufferlib as rt_puffer
from conftest import TRITON_INTERPRET_AT_STARTUP
from rl_triton.testing.frameworks import pufferlib_advantage

BACKENDS = ["cpu", "torch"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
# (gamma, lambda, rho_clip, c_clip): PufferLib's defaults, then clips on both sides of the ratios
SETTINGS = [(0.99, 0.95, 1.0, 1.0), (0.97, 0.9, 0.8, 1.5), (0.995, 1.0, 2.0, 0.7)]

# pufferlib 3.0.0's source distribution (PyPI's sha256) and the file the op is built from
SDIST_SHA256 = "7df3a3e3f5f894d78d2a1f5374097890aec01473183e748abefe4f3faa10eaa9"
CPP_MEMBER = "pufferlib-3.0.0/pufferlib/extensions/pufferlib.cpp"
CPP_SHA256 = "3efbfd62a5b2875451cc77bbb5cdb70a48001400e43cb3a4bbb724a926ee9a53"
CACHE = pathlib.Path(os.environ.get("RL_TRITON_CACHE", pathlib.Path.home() / ".cache" / "rl_triton"))


def _draw(R, T, dtype, seed, *, ratio_one=False, p_done=0.2):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(R, T, generator=g, dtype=torch.float64).to(dtype)
    rewards = torch.randn(R, T, generator=g, dtype=torch.float64).clamp(-1, 1).to(dtype)
    dones = (torch.rand(R, T, generator=g) < p_done).to(dtype)
    if T > 1:
        dones[0, 1] = dones[-1, -1] = 1  # a done arriving with the first step's successor and at the end
    dones[:, 0] = torch.rand(R, generator=g) < 0.5  # ignored: it belongs to no step of the row
    ratio = torch.ones(R, T, dtype=dtype) if ratio_one else \
        torch.exp(0.7 * torch.randn(R, T, generator=g, dtype=torch.float64)).to(dtype)
    return values, rewards, dones, ratio


def _tol(dtype, ref):
    scale = max(1.0, float(ref.abs().max()))
    return dict(rtol=0, atol=1e-12 * scale if dtype == torch.float64 else 4e-6 * scale)


@pytest.mark.parametrize("backend,setting", [(b, s) for b in BACKENDS for s in SETTINGS
                                             if b != "triton" or s == SETTINGS[1]])  # the interpreter is slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ratio_one", [True, False], ids=["ratio 1", "ratio far from 1"])
def test_matches_the_transcribed_loop(backend, dtype, ratio_one, setting, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", backend)
    shapes = [(3, 1), (2, 2), (5, 19)] if backend == "triton" else [(3, 1), (2, 2), (8, 64), (33, 7), (2, 300)]
    for seed, (R, T) in enumerate(shapes):
        values, rewards, dones, ratio = _draw(R, T, dtype, seed, ratio_one=ratio_one)
        want = pufferlib_advantage(values, rewards, dones, ratio, torch.full((R, T), 5.0, dtype=dtype), *setting)
        advantages = torch.full((R, T), 5.0, dtype=dtype)
        got = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, advantages, *setting)
        assert got is advantages
        assert torch.equal(got[:, -1], want[:, -1])  # not written: still 5
        torch.testing.assert_close(got, want, **_tol(dtype, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_last(backend, monkeypatch, stand_in):
    monkeypatch.setenv("RL_TRITON_BACKEND", backend)
    values, rewards, dones, ratio = _draw(4, 10, torch.float32, 7)
    want = pufferlib_advantage(values, rewards, dones, ratio, torch.zeros(4, 10), 0.99, 0.95, 1.0, 1.0)
    advantages = torch.full((4, 10), 3.0)
    rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, advantages, 0.99, 0.95, 1.0, 1.0,
                                     write_last=True)
    torch.testing.assert_close(advantages, want, **_tol(torch.float32, want))
    assert (advantages[:, -1] == 0).all()
    advantages.fill_(3.0)
    with rt_puffer.patched(write_last=True):  # the setting of the block reaches the positional call
        rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, advantages, 0.99, 0.95, 1.0, 1.0)
    assert (advantages[:, -1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adv_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16(backend, adv_dtype, monkeypatch):
    """bfloat16 inputs into a bfloat16 or a float32 buffer, against the loop in float64 on the
    same (rounded) inputs."""
    monkeypatch.setenv("RL_TRITON_BACKEND", backend)
    values, rewards, dones, ratio = _draw(6, 24, torch.bfloat16, 8)
    wide = [x.double() for x in (values, rewards, dones, ratio)]
    want = pufferlib_advantage(*wide, torch.zeros(6, 24, dtype=torch.float64), 0.99, 0.95, 0.9, 1.2)
    advantages = torch.zeros(6, 24, dtype=adv_dtype)
    rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, advantages, 0.99, 0.95, 0.9, 1.2)
    tol = 3e-2 if adv_dtype == torch.bfloat16 else 1e-4  # one bfloat16 rounding of the result, or none
    torch.testing.assert_close(advantages.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_strided_and_flag_dtypes():
    """Rows of a wider buffer (PufferLib reads such views as if contiguous) and bool or uint8
    terminals give the results of the dense float call."""
    values, rewards, dones, ratio = _draw(5, 12, torch.float32, 9)
    want = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, torch.zeros(5, 12), 0.99, 0.95, 1.0, 1.0)
    wide = torch.zeros(5, 20)
    wide[:, :12] = values
    for flags in (dones.bool(), dones.to(torch.uint8)):
        got = rt_puffer.compute_puff_advantage(wide[:, :12], rewards, flags, ratio, torch.zeros(5, 12), 0.99, 0.95,
                                               1.0, 1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_errors_name_the_argument():
    x = torch.zeros(2, 4)
    cases = [
        ((x, x, x, x, torch.zeros(8)), rt_puffer.InputError, "advantages must be 2-D"),
        ((x, torch.zeros(2, 5), x, x, x), rt_puffer.InputError, "rewards has shape"),
        ((x, x, x, x.double(), x), rt_puffer.DtypeError, "ratio is torch.float64"),
        ((x.half(), x.half(), x, x.half(), x.half()), rt_puffer.DtypeError, "values must be"),
        ((x, x, x, x, x.bfloat16()), rt_puffer.DtypeError, "advantages is torch.bfloat16"),
        ((x, x, x, [0.0], x), rt_puffer.DtypeError, "ratio must be a torch.Tensor"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message) as info:
            rt_puffer.compute_puff_advantage(*args, 0.99, 0.95, 1.0, 1.0)
        assert isinstance(info.value, RuntimeError)  # what PufferLib's op raises


@pytest.mark.parametrize("shape", [(8,), ()])
def test_values_of_fewer_than_2_dims_raise_index_error(shape):
    """PufferLib's op reads ``values.size(0)`` and ``values.size(1)`` before its checks, an
    IndexError for values of fewer than 2 dims (as the transcription's reads of the shape): the
    drop-in raises DimError, an IndexError (and rl_triton's ValueError) naming the argument."""
    x, values = torch.zeros(2, 4), torch.zeros(shape)
    args = (values, x, x, x, x, 0.99, 0.95, 1.0, 1.0)
    with pytest.raises(IndexError):
        pufferlib_advantage(*args)
    with pytest.raises(rt_puffer.DimError, match="values must be 2-D") as info:
        rt_puffer.compute_puff_advantage(*args)
    assert isinstance(info.value, IndexError) and isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------------
# PufferLib's own CPU op, built from its source distribution
# ---------------------------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pufferlib_cpp() -> pathlib.Path:
    """pufferlib.cpp of pufferlib 3.0.0, from the cache or the sdist at $RL_TRITON_PUFFERLIB_SDIST
    (sha256 checked); pytest.skip where neither is at hand. pip cannot fetch the sdist on its own:
    it builds metadata first, and 3.0.0's setup.py fails there without network access."""
    cpp = CACHE / "pufferlib-3.0.0" / "pufferlib.cpp"
    if cpp.exists() and _sha256(cpp.read_bytes()) == CPP_SHA256:
        return cpp
    sdist = os.environ.get("RL_TRITON_PUFFERLIB_SDIST")
    if not sdist:
        pytest.skip("PufferLib's CPU op needs its source: set RL_TRITON_PUFFERLIB_SDIST to pufferlib-3.0.0.tar.gz, "
                    "PyPI's source distribution of pufferlib 3.0.0")
    try:
        data = pathlib.Path(sdist).read_bytes()
    except OSError as e:
        pytest.skip(f"RL_TRITON_PUFFERLIB_SDIST is not readable ({e})")
    if _sha256(data) != SDIST_SHA256:
        pytest.skip("the pufferlib 3.0.0 source distribution found does not have PyPI's sha256")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        source = tar.extractfile(CPP_MEMBER).read()
    assert _sha256(source) == CPP_SHA256
    cpp.parent.mkdir(parents=True, exist_ok=True)
    cpp.write_bytes(source)
    return cpp


@pytest.fixture(scope="module")
def puffer_op():
    """torch.ops.pufferlib.compute_puff_advantage from pufferlib 3.0.0's pufferlib.cpp, built with
    torch.utils.cpp_extension (cached per torch version: about 25 s of compiler time once)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build PufferLib's CPU op")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("torch.utils.cpp_extension needs ninja to build PufferLib's CPU op")
    cpp = _pufferlib_cpp()
    build = CACHE / "pufferlib-3.0.0" / f"build-torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name="pufferlib_cpu_op", sources=[str(cpp)], build_directory=str(build),
                           extra_cflags=["-O2"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        pytest.skip(f"PufferLib's CPU op did not build: {e}")
    return torch.ops.pufferlib.compute_puff_advantage


@pytest.mark.parametrize("ratio_one", [True, False], ids=["ratio 1", "ratio far from 1"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_matches_pufferlib_op(puffer_op, ratio_one, setting):
    for seed, (R, T) in enumerate([(1, 1), (3, 2), (16, 64), (7, 129)]):
        values, rewards, dones, ratio = _draw(R, T, torch.float32, 100 + seed, ratio_one=ratio_one)
        want = torch.full((R, T), -2.0)
        puffer_op(values, rewards, dones, ratio, want, *setting)
        torch.testing.assert_close(pufferlib_advantage(values, rewards, dones, ratio, torch.full((R, T), -2.0),
                                                       *setting), want, rtol=0, atol=0)  # the transcription
        got = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, torch.full((R, T), -2.0), *setting)
        assert torch.equal(got[:, -1], want[:, -1])
        torch.testing.assert_close(got, want, **_tol(torch.float32, want))


def test_pufferlib_op_rejects_what_the_drop_in_rejects(puffer_op):
    x = torch.zeros(2, 4)
    for args in ((x, x, x, x, torch.zeros(8)), (x, torch.zeros(2, 5), x, x, x)):
        with pytest.raises(RuntimeError):
            puffer_op(*args, 0.99, 0.95, 1.0, 1.0)
        with pytest.raises(RuntimeError):
            rt_puffer.compute_puff_advantage(*args, 0.99, 0.95, 1.0, 1.0)
    args = (torch.zeros(8), x, x, x, x, 0.99, 0.95, 1.0, 1.0)
    with pytest.raises(IndexError):
        puffer_op(*args)
    with pytest.raises(IndexError):
        rt_puffer.compute_puff_advantage(*args)


# ---------------------------------------------------------------------------------------------
# patch() on a stand-in package
# ---------------------------------------------------------------------------------------------

# pufferlib.pufferl's structure as far as the patch reads it: the extension imported at the top
# (an ImportError without it, as in 3.0.0), a module function called by name from a method
PUFFERL = '''
try:
    from pufferlib import _C
except ImportError:
    raise ImportError("Failed to import C/CUDA advantage kernel")


def compute_puff_advantage(values, rewards, terminals, ratio, advantages, gamma, gae_lambda,
                           vtrace_rho_clip, vtrace_c_clip):
    raise RuntimeError("PufferLib's own function ran")


def train(values, rewards, terminals, ratio, config):
    advantages = values.new_zeros(values.shape)
    return compute_puff_advantage(values, rewards, terminals, ratio, advantages, config["gamma"],
                                  config["gae_lambda"], config["vtrace_rho_clip"], config["vtrace_c_clip"])
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A ``pufferlib`` package without its extension on sys.path, removed afterwards."""
    package = tmp_path / "pufferlib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pufferl.py").write_text(textwrap.dedent(PUFFERL))
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {k: v for k, v in sys.modules.items() if k == "pufferlib" or k.startswith("pufferlib.")}
    for k in saved:
        del sys.modules[k]
    yield
    rt_puffer.unpatch()
    for k in [k for k in sys.modules if k == "pufferlib" or k.startswith("pufferlib.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_patch_replaces_and_restores_the_same_object(stand_in):
    rt_puffer.patch()
    pufferl = sys.modules["pufferlib.pufferl"]  # imported by patch(), with a stand-in extension
    original = rt_puffer._original
    assert pufferl.compute_puff_advantage is rt_puffer.compute_puff_advantage and rt_puffer.is_patched()
    values, rewards, dones, ratio = _draw(4, 9, torch.float32, 11)
    config = dict(gamma=0.99, gae_lambda=0.95, vtrace_rho_clip=1.0, vtrace_c_clip=1.0)
    got = pufferl.train(values, rewards, dones, ratio, config)
    want = pufferlib_advantage(values, rewards, dones, ratio, torch.zeros(4, 9), 0.99, 0.95, 1.0, 1.0)
    torch.testing.assert_close(got, want, **_tol(torch.float32, want))
    rt_puffer.patch()  # idempotent
    rt_puffer.unpatch()
    assert pufferl.compute_puff_advantage is original and not rt_puffer.is_patched()
    with pytest.raises(RuntimeError, match="own function ran"):
        pufferl.train(values, rewards, dones, ratio, config)
    rt_puffer.unpatch()  # idempotent
    assert pufferl.compute_puff_advantage is original


def test_patched_blocks_nest_across_threads(stand_in):
    rt_puffer.patch()
    pufferl = sys.modules["pufferlib.pufferl"]
    original = rt_puffer._original
    rt_puffer.unpatch()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with rt_puffer.patched():
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=hold)
    worker.start()
    inside.wait(10)
    with rt_puffer.patched(write_last=True):
        assert pufferl.compute_puff_advantage is rt_puffer.compute_puff_advantage
    assert rt_puffer.is_patched()  # the other thread's block still holds it
    release.set()
    worker.join()
    assert pufferl.compute_puff_advantage is original and not rt_puffer.is_patched()


def test_patch_needs_pufferlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "pufferlib", None)  # import pufferlib raises ImportError
    monkeypatch.delitem(sys.modules, "pufferlib.pufferl", raising=False)
    with pytest.raises(ImportError, match="needs pufferlib"):
        rt_puffer.patch()
    with pytest.raises(TypeError, match="write_last"):
        rt_puffer.patched(write_last=1)
    assert not rt_puffer.is_patched()


def test_nan_ratio():
    """NaN in gives NaN out (where PufferLib's fminf would clip a NaN ratio to the clip)."""
    values, rewards, dones, ratio = _draw(1, 6, torch.float32, 12, p_done=0.0)
    dones.zero_()
    ratio[0, 2] = math.nan
    got = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, torch.zeros(1, 6), 0.99, 0.95, 1.0, 1.0)
    assert torch.isnan(got[0, :3]).all() and not torch.isnan(got[0, 3:]).any()


def test_nan_stops_at_the_episode_end():
    """A NaN reward after a terminal in its row: PufferLib's loop multiplies the carried
    advantage by ``1 - terminals`` (0 * NaN = NaN) and carries the NaN to every earlier step of
    the row; rl_triton stops it at the episode end (docs/semantics.md, section 11), where the
    earlier steps are PufferLib's advantages of the row with that reward finite."""
    values, rewards, dones, ratio = _draw(3, 12, torch.float64, 13, p_done=0.0)
    dones.zero_()
    dones[1, 5] = 1  # the episode of row 1 ends with the transition into observation 5
    setting = SETTINGS[1]
    finite = pufferlib_advantage(values, rewards, dones, ratio, torch.zeros(3, 12, dtype=torch.float64), *setting)
    rewards[1, 9] = math.nan
    theirs = pufferlib_advantage(values, rewards, dones, ratio, torch.zeros(3, 12, dtype=torch.float64), *setting)
    ours = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, torch.zeros(3, 12, dtype=torch.float64), *setting)
    assert theirs[1, :9].isnan().all() and ours[1, 5:9].isnan().all()
    assert torch.equal(ours[:, 5:].isnan(), theirs[:, 5:].isnan())
    torch.testing.assert_close(ours[:, :5], finite[:, :5], **_tol(torch.float64, finite))
