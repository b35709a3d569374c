"""The premise of the engine's mirrored lanes, checked on the compiler's output: a reverse scan
over mirrored runs keeps its vector loads, needs no shared memory, and emits fewer warp shuffles
than ``associative_scan(reverse=True)`` (rl_triton/testing/lowering.py compiles both to sm_90 PTX;
no GPU needed, but not under the interpreter, so it runs in a subprocess without it; that
subprocess loads the module by its file path, which needs triton but not torch)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
triton = pytest.importorskip("triton")
# the kernels are written for triton >= 3.6 (the gpu extra); older ones (torch 2.6 brings 3.2)
# do not compile them
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip(f"triton {triton.__version__}: the kernels need triton >= 3.6", allow_module_level=True)

CODE = """
import importlib.util, json
spec = importlib.util.spec_from_file_location("lowering", "rl_triton/testing/lowering.py")
lowering = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowering)
print(json.dumps({mode: lowering.counts(1, 256, 1, mode) for mode in (0, 1)}))
"""


def test_mirrored_runs_keep_vector_loads_and_save_shuffles():
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("triton without a backend registry")
    if "nvidia" not in backends:
        pytest.skip("triton built without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    (rev_v4, rev_loads, rev_shfl, _), (v4, loads, shfl, shared) = counts["0"], counts["1"]
    assert v4 == loads == rev_loads and v4 > 0  # every load a 16-byte vector load
    assert shared == 0
    assert shfl < rev_shfl
