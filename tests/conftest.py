"""pytest configuration: hypothesis profiles, backend selection.

Profiles (environment variable RL_TRITON_HYPOTHESIS_PROFILE):
  ci (default)  derandomized, fixed example counts, no example database: deterministic
  quick         a tenth of the examples (local edit-run loops)
  thorough      ten times the examples, randomized (nightly / before a release)

The Triton backend runs on CPU only in the interpreter: TRITON_INTERPRET=1 must be in the
environment before rl_triton (and triton) are imported, i.e. before pytest starts.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

# read before anything imports triton / rl_triton
TRITON_INTERPRET_AT_STARTUP = os.environ.get("TRITON_INTERPRET") == "1"

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_SUPPRESS = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
    HealthCheck.large_base_example,
]
settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, suppress_health_check=_SUPPRESS,
    print_blob=False,
)
settings.register_profile(
    "quick", derandomize=True, deadline=None, database=None, suppress_health_check=_SUPPRESS,
)
settings.register_profile(
    "thorough", derandomize=False, deadline=None, suppress_health_check=_SUPPRESS,
    print_blob=True,
)
settings.load_profile(os.environ.get("RL_TRITON_HYPOTHESIS_PROFILE", "ci"))

torch.manual_seed(0)

BACKENDS = ["torch", "cpu", "triton"]


@functools.lru_cache(maxsize=None)
def triton_usable() -> bool:
    """Triton kernels can run here: CUDA, or the interpreter enabled before import."""
    if not (TRITON_INTERPRET_AT_STARTUP or torch.cuda.is_available()):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    import rl_triton

    try:
        a = torch.zeros(1, 2)
        rl_triton.affine_scan(a, a, backend="triton")
    except (ValueError, ImportError, RuntimeError, NotImplementedError):
        return False
    return True


def numba_usable() -> bool:
    return importlib.util.find_spec("numba") is not None


def require_backend(name: str):
    if name == "triton" and not triton_usable():
        pytest.skip("triton backend not usable here (set TRITON_INTERPRET=1 before import)")
    if name == "cpu" and not numba_usable():
        pytest.skip("numba not installed")


@pytest.fixture(params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture(params=["torch", "cpu"])
def cpu_backend(request):
    """The backends that run on CPU tensors without the Triton interpreter."""
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="session")
def rt():
    import rl_triton

    return rl_triton


@pytest.fixture(autouse=True)
def _no_plans_across_tests():
    """Each test starts without call plans (rl_triton/core/plans.py), so that a test changing a
    module setting with monkeypatch sees it take effect; tests/test_plans.py tests the plans."""
    from rl_triton.core import plans

    plans.clear()
    yield


def pytest_addoption(parser):
    parser.addoption("--fail-on-skip", action="store_true",
                     help="a test that skips fails instead (.ci/run's framework stages: the packages the "
                          "selected tests need are installed there, so a skip means they did not run)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.config.getoption("--fail-on-skip") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under --fail-on-skip: {reason}"
