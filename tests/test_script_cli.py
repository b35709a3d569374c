"""The command lines of examples/ and benchmarks/: ``--help`` prints the script's whole docstring
and the options' defaults; the examples' ``--help`` works without their optional packages, and
a run without them ends in the install line, not a traceback (or, for an example that needs
none, runs)."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = {"sb3_common.py", "common.py", "peers.py"}  # imported by the scripts, no command line
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.py")) + glob.glob(
    os.path.join(ROOT, "benchmarks", "*.py")) if os.path.basename(p) not in HELPERS)
EXAMPLES = [p for p in SCRIPTS if os.sep + "examples" + os.sep in p]
# packages a script imports before parsing its command line (the benchmarks are tools for a set-up
# machine; only the examples promise a --help without their packages)
NEEDS = {"engine_ptx.py": ("triton",), "scan_ptx.py": ("triton",),
         "sb3_crossover.py": ("gymnasium", "stable_baselines3"), "torchrl_cpu.py": ("torchrl",),
         "rllib_cpu.py": ("ray",)}
OPTIONAL = ("gymnasium", "stable_baselines3", "sb3_contrib", "torchrl", "tensordict", "mujoco", "ale_py", "cv2",
            "matplotlib", "tqdm", "tensorboard", "transformers", "rsl_rl", "sample_factory")
# examples whose packages go in an environment of their own (their pins clash with the examples
# extra): the install line they give instead of the examples extra's
OWN_INSTALL = {"sample_factory_appo.py": "pip install -e '.[cpu,sample-factory]' matplotlib tqdm",
               "skyrl_token_ppo.py": "pip install -e '.[cpu,skyrl]' matplotlib tqdm"}

# runs a script as if the OPTIONAL packages were not installed: the path finder does not see them
_BLOCKED_RUN = """
import importlib.machinery, os, runpy, sys
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script.py` does
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(args, blocked=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), MPLBACKEND="Agg", COLUMNS="100")
    cmd = [sys.executable, *args] if not blocked else [sys.executable, "-c", _BLOCKED_RUN.format(blocked=blocked),
                                                       *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _first_paragraph(path):
    doc = open(path).read().split('"""')[1]
    return " ".join(doc.split("\n\n")[0].split())


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_help_shows_the_whole_docstring_and_defaults(path):
    for module in NEEDS.get(os.path.basename(path), ()):
        pytest.importorskip(module)
    result = _run([path, "--help"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert _first_paragraph(path) in " ".join(result.stdout.split())
    assert "(default: " in result.stdout
    if path in EXAMPLES:  # every example writes under runs/ unless told otherwise
        options = result.stdout[result.stdout.index("options:"):]
        out = re.search(r"^\s+--out \S+(.*?)\(default: ([^)]*)\)", options, re.M | re.S)
        assert out and out.group(2).split()[0].startswith("runs/"), options


# examples that need no optional package (matplotlib only adds a plot): a short run without them works
SELF_CONTAINED = {"distributed_gae.py": ["--steps", "2000", "--iterations", "1"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_without_optional_packages(path, tmp_path):
    short = SELF_CONTAINED.get(os.path.basename(path))
    if short is not None:
        ran = _run([path, *short, "--out", str(tmp_path)], blocked=OPTIONAL)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
        assert (tmp_path / "timings.csv").stat().st_size > 0
        return
    doc = open(path).read().split('"""')[1]
    install = OWN_INSTALL.get(os.path.basename(path), "pip install -e '.[examples]'")
    written = install.replace("'", '"')  # as the docstring and --help write it
    assert "\n    " + written + "\n" in doc, "the docstring gives the install line"
    helped = _run([path, "--help"], blocked=OPTIONAL)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert written in helped.stdout
    ran = _run([path, "--out", os.devnull], blocked=OPTIONAL)
    assert ran.returncode == 1, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert f"install with {install}" in ran.stderr, ran.stderr


def test_gpu_check_without_triton_names_the_extras():
    """benchmarks/gpu_check.py checks the Triton kernels: without triton it says so in one line
    that names the extras that bring it, and exits with status 2 (no traceback)."""
    ran = _run([os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--quick"], blocked=("triton",))
    assert ran.returncode == 2, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert len(ran.stderr.splitlines()) == 1, ran.stderr[-3000:]
    assert "needs triton" in ran.stderr and "'.[dev]'" in ran.stderr and "'.[gpu]'" in ran.stderr
