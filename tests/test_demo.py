"""The README's first command ends in ``python -m rl_triton``: the demo must run and agree."""

import os
import subprocess
import sys

import pytest
import torch

import rl_triton as rt
from rl_triton import demo
from rl_triton.demo import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_every_estimator_agrees():
    done = subprocess.run([sys.executable, "-m", "rl_triton", "--quick", "--repeats", "1", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "all results match the reference loop" in done.stdout
    assert "gae vs SB3 numpy loop" in done.stdout
    assert any(line.startswith("| masked_whiten ") and line.rstrip(" |").endswith("ok")
               for line in done.stdout.splitlines()), done.stdout  # checked against the float64 oracle
    # output that is not a terminal gets plain progress lines, one per run, not a redrawn bar
    assert "\r" not in done.stderr, done.stderr[-2000:]
    runs = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert runs and runs[0].startswith("[1/") and len(runs) == int(runs[0].split("/")[1].split("]")[0])


@pytest.mark.parametrize("device", ["tpu", "cuda:0", "meta", "cuda:x"])
def test_bad_device_is_one_line_naming_it(device, capsys):
    """A device the demo cannot use: exit status 2 and one line on stderr that names the device
    as given (cuda:0 on a machine without CUDA; tpu, which torch does not parse)."""
    if device.startswith("cuda") and torch.cuda.is_available() and device != "cuda:x":
        pytest.skip("this machine has CUDA")
    assert main(["--device", device, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith(f"error: --device {device}")


def test_demo_checks_arrival_gae_and_group_advantages_against_the_oracle(capsys):
    """The demo's rows for arrival_gae and group_advantages compare the library with the float64
    oracle (rl_triton.testing.oracle), and a wrong result there fails the demo."""
    assert main(["--quick", "--repeats", "1", "--device", "cpu", "--no-progress"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ")}
    for name in ("arrival_gae", "group_advantages"):
        assert "(float64 oracle)" in rows[name] and rows[name].rstrip(" |").endswith(" ok"), rows[name]


def test_demo_oracle_rows_catch_a_wrong_result(monkeypatch):
    shape = demo.Shape((16, 8), 0)
    calls = demo.oracle_calls(shape, torch.device("cpu"))
    for name, _, fast, expected in calls:
        assert demo.max_error(fast(), expected())[1], name
    true_group_advantages = rt.group_advantages
    monkeypatch.setattr(rt, "group_advantages", lambda *a, **k: true_group_advantages(*a, **k) * 1.01)
    (_, _, fast, expected), = [c for c in demo.oracle_calls(shape, torch.device("cpu")) if c[0] == "group_advantages"]
    assert not demo.max_error(fast(), expected())[1]


def test_a_mismatch_names_its_element_the_oracle_and_a_second_call(capsys, monkeypatch):
    """A row that differs beyond tolerance fails the demo, and a line after the table names the
    element that differs most, the float64 oracle's value there (so it says which side is wrong)
    and what a second call of each side gives (whether a side changes from call to call)."""
    true_vtrace = rt.vtrace
    calls = []

    def off_once(*args, **kwargs):  # the first fast call of the demo's vtrace row is off at one element
        out = true_vtrace(*args, **kwargs)
        if kwargs.get("backend") == "auto":
            calls.append(1)
            if len(calls) == 1:
                out[1][5, 3] += 0.5
        return out

    monkeypatch.setattr(rt, "vtrace", off_once)
    assert main(["--quick", "--repeats", "1", "--device", "cpu", "--no-progress"]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("mismatch: vtrace ")]
    problem = dict(demo.rollout_problems(demo.Shape((128, 64), 0), torch.device("cpu")))["vtrace"]
    expected = problem.expected()[1][5, 3]
    reference = problem.call("torch")[1][5, 3].item()
    fast, oracle, again = line.split("fast ")[1], line.split("float64 oracle ")[1], line.split("called again: ")[1]
    assert "output 1 at [5, 3]" in line
    assert abs(float(fast.split(",")[0]) - (reference + 0.5)) < 1e-4
    assert abs(float(oracle.split(";")[0]) - expected) < 1e-4
    assert abs(float(again.split("fast ")[1].split(",")[0]) - reference) < 1e-4
    assert abs(float(again.split("reference ")[1]) - reference) < 1e-4
