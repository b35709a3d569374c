""".ci/run's stages fail where a step of theirs fails: a pip line that fails, or that only warns
that the package does not provide an extra it was asked for (pip then installs the package
without that extra's requirements and exits 0), ends the stage before its tests run, and the
script exits non-zero. The interpreter is a stand-in (the PYTHON knob) that records its calls,
makes venvs of itself, and answers pip as the test says, so no package is installed."""

import os
import re
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [[ "$1" == "-m" && "$2" == "venv" ]]; then
    mkdir -p "$3/bin" && touch "$3/pyvenv.cfg" && cp "$0" "$3/bin/python"
    exit 0
fi
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
    [[ -n "$FAKE_PIP_SAYS" ]] && echo "$FAKE_PIP_SAYS" >&2
    exit "$FAKE_PIP_RC"
fi
if [[ "$1" == "-c" ]]; then
    echo "torch==2.6.0"
fi
exit 0
"""


def _run(tmp_path, stages, pip_rc, pip_says):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = dict(os.environ, PYTHON=str(python), CI_VENV=str(tmp_path / "venv"), CI_STAGES=stages,
               FAKE_LOG=str(log), FAKE_PIP_RC=str(pip_rc), FAKE_PIP_SAYS=pip_says)
    ran = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                         timeout=120)
    return ran, log.read_text()


@pytest.mark.parametrize("stages", ["oldest_torch", "frameworks"])
def test_a_failing_pip_line_fails_the_stage_before_its_tests(tmp_path, stages):
    ran, calls = _run(tmp_path, stages, 1, "ERROR: No matching distribution found for torch")
    assert ran.returncode != 0, ran.stdout
    assert f"{stages}" in ran.stdout and "FAILED (exit 1)" in ran.stdout, ran.stdout
    assert "-m pytest" not in calls, calls
    assert calls.count("-m pip install") == 1, calls  # the first pip line ended the stage


@pytest.mark.parametrize("stages", ["oldest_torch", "frameworks"])
def test_a_missing_extra_fails_the_stage_before_its_tests(tmp_path, stages):
    ran, calls = _run(tmp_path, stages, 0, "WARNING: rl-triton 0.1.0 does not provide the extra 'rsl_rl'")
    assert ran.returncode != 0, ran.stdout
    assert "FAILED (exit 3)" in ran.stdout, ran.stdout
    assert "does not provide the extra" in ran.stdout + ran.stderr
    assert "an extra it does not provide" in ran.stderr, ran.stderr
    assert "-m pytest" not in calls, calls


def test_the_stages_pass_where_every_step_does(tmp_path):
    ran, calls = _run(tmp_path, "oldest_torch", 0, "")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "oldest_torch" in ran.stdout and "passed" in ran.stdout, ran.stdout
    # the oldest torch pyproject.toml claims, first, then pinned again with the package
    installs = [line for line in calls.splitlines() if "-m pip install" in line]
    assert installs[0].endswith("torch==2.6"), installs
    assert "-e .[cpu]" in installs[1] and installs[1].endswith("torch==2.6"), installs
    (tests,) = [line for line in calls.splitlines() if "-m pytest" in line]
    assert "tests/test_known_values.py" in tests and "tests/test_distributed.py" not in tests, tests


def test_readme_names_every_stage():
    """README's paragraph on `.ci/run` describes each stage that CI_STAGES runs by default."""
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    (default,) = re.findall(r'CI_STAGES="\$\{CI_STAGES:-([^}]+)\}"', script)
    readme = open(os.path.join(ROOT, "README.md")).read()
    stages = default.split()
    assert "oldest_torch" in stages, stages
    assert f"`.ci/run` runs {['one', 'two', 'three', 'four', 'five'][len(stages) - 1]} stages" in readme
    for name in stages:
        assert f"`{name}`" in readme, name
