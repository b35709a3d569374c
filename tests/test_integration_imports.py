"""An integration used without its framework raises one error, ``FrameworkNotInstalled`` (a
``ModuleNotFoundError``), from rl_triton's own frame, with one message: the integration, the
framework and the pip line that installs it (an extra of pyproject.toml where one exists).

Each case runs in a fresh interpreter in which every framework's top-level module is blocked
(``sys.modules[name] = None``, what Python does for a module that is not installed), so the
result does not depend on which frameworks this environment has."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKED = ["stable_baselines3", "torchrl", "tensordict", "ray", "rsl_rl", "skrl", "rl_games", "verl", "pufferlib",
           "openrlhf", "trl", "cleanrl", "skyrl", "nemo_rl", "slime", "areal"]

# integration -> (the framework's module, the install the message names, what triggers the
# import: "import" where importing the integration imports the framework, else the expressions
# that first need it; the integration module is `m`)
CASES = {
    "sb3": ("stable_baselines3", "extra sb3", ["import"]),
    "torchrl": ("torchrl", "extra torchrl", ["import"]),
    "rllib": ("ray", "extra rllib", ["import"]),
    "rsl_rl": ("rsl_rl", "extra rsl-rl", ["import"]),
    "skrl": ("skrl", "extra skrl", ["m.patch()", "m.PPO", "m.patched().__enter__()"]),
    "rl_games": ("rl_games", "extra rl-games", ["m.patch()", "m.A2CAgent"]),
    "verl": ("verl", "extra verl", ["m.patch()", "m.patched().__enter__()"]),
    "skyrl": ("skyrl", "extra skyrl", ["m.patch()", "m.patched().__enter__()"]),
    "nemo_rl": ("nemo_rl", "nemo-rl @ git+https://github.com/NVIDIA-NeMo/RL", ["m.patch()", "m.patched().__enter__()"]),
    "slime": ("slime", "slime @ git+https://github.com/THUDM/slime", ["m.patch()", "m.patched().__enter__()"]),
    "pufferlib": ("pufferlib", "pufferlib==3.0.0", ["m.patch()"]),
    "openrlhf": ("openrlhf", "openrlhf==0.11.*", ["m.patch()"]),
}
# these need no framework: their functions take plain tensors
NO_FRAMEWORK = ["cleanrl", "trl", "areal"]

_PROBE = r"""
import importlib, json, sys, sysconfig, traceback
stdlib = sysconfig.get_paths()["stdlib"]
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
results = {}
for integration, triggers in json.loads(sys.argv[2]).items():
    results[integration] = []
    for trigger in triggers:
        try:
            m = importlib.import_module("rl_triton.integrations." + integration)
            if trigger != "import":
                eval(trigger)
            results[integration].append(None)
        except BaseException as error:
            frames = traceback.extract_tb(error.__traceback__)
            results[integration].append({
                "type": type(error).__name__, "mro": [c.__name__ for c in type(error).__mro__],
                "name": getattr(error, "name", None), "message": str(error), "last_file": frames[-1].filename,
                "other_files": [f.filename for f in frames
                                if "rl_triton" not in f.filename and not f.filename.startswith((stdlib, "<"))]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probed():
    """integration -> one result per trigger (None where it ran), from one fresh interpreter."""
    triggers = {name: case[2] for name, case in CASES.items()}
    triggers.update({name: ["import"] for name in NO_FRAMEWORK})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    ran = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(BLOCKED), json.dumps(triggers)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.splitlines()[-1])


@pytest.mark.parametrize("integration", sorted(CASES))
def test_integration_without_its_framework_names_the_install(integration, probed):
    framework, install, triggers = CASES[integration]
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    if install.startswith("extra "):
        extra = install.split()[1]
        assert extra in extras, extra
        how = re.escape(f"pip install -e '.[{extra}]' (from the rl_triton repository root)")
    else:
        how = re.escape(f"pip install '{install}'")
    for trigger, result in zip(triggers, probed[integration]):
        assert result is not None, f"{trigger} ran without {framework}"
        assert result["type"] == "FrameworkNotInstalled" and "ModuleNotFoundError" in result["mro"], (trigger, result)
        assert result["name"] == framework, (trigger, result)
        assert re.fullmatch(rf"rl_triton\.integrations\.{integration}(\.patch\(\))? needs [^,]+, which is not "
                            rf"installed: {how}", result["message"]), (trigger, result["message"])
        # raised by rl_triton before any module of the framework is looked for: every frame is
        # rl_triton's or the standard library's (importlib, contextlib)
        assert result["last_file"].endswith(os.path.join("integrations", "_patching.py")), (trigger, result)
        assert result["other_files"] == [], (trigger, result)


@pytest.mark.parametrize("integration", NO_FRAMEWORK)
def test_integrations_without_a_framework_import_without_any(integration, probed):
    assert probed[integration] == [None]


def test_requires_framework_takes_one_install():
    from rl_triton.integrations._patching import requires_framework

    with pytest.raises(TypeError, match="exactly one of extra and requirement"):
        requires_framework("m", "x", "x")
    with pytest.raises(TypeError, match="exactly one of extra and requirement"):
        requires_framework("m", "x", "x", extra="a", requirement="b")
    assert requires_framework("m", "torch", "torch", extra="cpu") is None
