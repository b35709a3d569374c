"""The documentation site builds with ``mkdocs build --strict`` (no broken link, no missing
reference), its API page covers every public name, and the code blocks of the README and the
getting-started page run."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# module file -> the module's public names (its __all__), each of which the API page must show
PUBLIC = {
    "rl_triton/__init__.py": "rl_triton",
    "rl_triton/integrations/sb3.py": "rl_triton.integrations.sb3",
    "rl_triton/integrations/torchrl.py": "rl_triton.integrations.torchrl",
    "rl_triton/integrations/rllib.py": "rl_triton.integrations.rllib",
    "rl_triton/integrations/cleanrl.py": "rl_triton.integrations.cleanrl",
    "rl_triton/integrations/rsl_rl.py": "rl_triton.integrations.rsl_rl",
    "rl_triton/integrations/skrl.py": "rl_triton.integrations.skrl",
    "rl_triton/integrations/rl_games.py": "rl_triton.integrations.rl_games",
    "rl_triton/integrations/verl.py": "rl_triton.integrations.verl",
    "rl_triton/integrations/trl.py": "rl_triton.integrations.trl",
    "rl_triton/integrations/openrlhf.py": "rl_triton.integrations.openrlhf",
    "rl_triton/integrations/pufferlib.py": "rl_triton.integrations.pufferlib",
    "rl_triton/testing/__init__.py": "rl_triton.testing",
    "rl_triton/testing/catalog.py": "rl_triton.testing.catalog",
    "rl_triton/testing/oracle.py": "rl_triton.testing.oracle",
}


def _all(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no __all__")


def _api_entries():
    """The objects the API page renders: ``::: name`` lines and the members listed under them."""
    entries, current = set(), None
    for line in open(os.path.join(ROOT, "docs", "api.md")):
        if line.startswith("::: "):
            current = line[4:].strip()
            entries.add(current)
        elif current and re.match(r"^\s+- \w+$", line):
            entries.add(f"{current}.{line.strip()[2:]}")
        elif line.strip() and not line.startswith(" "):
            current = None
    return entries


def test_api_page_lists_every_public_name():
    entries = _api_entries()
    for path, module in PUBLIC.items():
        for name in _all(path):
            qualified = f"{module}.{name}"
            if module == "rl_triton.testing":  # re-exports of catalog and its submodules
                continue
            assert qualified in entries, f"docs/api.md does not render {qualified}"


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings")),
                    reason="the docs packages are not installed (pip install -e '.[docs]')")
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                             os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "site" / "api" / "index.html").stat().st_size > 0


def _python_blocks(path):
    text = open(os.path.join(ROOT, path)).read()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "import rl_triton as rt" in b]


@pytest.mark.parametrize("path", ["README.md", "docs/index.md"])
def test_code_blocks_run(path):
    blocks = _python_blocks(path)
    assert blocks, f"no self-contained python block in {path}"
    for block in blocks:
        exec(compile(block, path, "exec"), {})


def test_torchrl_page_first_snippet_runs():
    """docs/torchrl.md's first block runs as written, and does what its comments say."""
    pytest.importorskip("torchrl")
    text = open(os.path.join(ROOT, "docs", "torchrl.md")).read()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace = {}
    exec(compile(block, "docs/torchrl.md", "exec"), namespace)
    rt_torchrl = namespace["rt_torchrl"]
    assert type(namespace["loss"].value_estimator) is rt_torchrl.GAE
    assert not rt_torchrl.is_patched()


def test_index_lists_every_example():
    """docs/index.md's table of examples has a row for every script in examples/."""
    text = open(os.path.join(ROOT, "docs", "index.md")).read()
    rows = set(re.findall(r"^\| `examples/(\w+\.py)` \|", text, re.M))
    scripts = {name for name in os.listdir(os.path.join(ROOT, "examples"))
               if name.endswith(".py") and 'if __name__ == "__main__":' in open(os.path.join(ROOT, "examples", name)).read()}
    assert scripts and scripts - rows == set(), f"docs/index.md's table lacks {sorted(scripts - rows)}"
    assert rows <= scripts, f"docs/index.md lists scripts that are not there: {sorted(rows - scripts)}"


def test_verl_page_installs_verl_in_its_own_environment():
    """docs/verl.md's install lines: a venv of its own, the CPU torch first, then the `verl`
    extra, which pins the verl the page is written against and which no extra that brings
    torchrl (verl's tensordict pin clashes with it) includes; .ci/run installs the same extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    page = open(os.path.join(ROOT, "docs", "verl.md")).read()
    (lines,) = [b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "verl]" in b]
    assert lines.splitlines() == ["python3 -m venv .venv-verl && . .venv-verl/bin/activate",
                                  "pip install torch==2.13.0",
                                  'pip install -e ".[cpu,verl]" torch==2.13.0']
    assert extras["verl"][0] == "verl==0.9.1" and "**verl 0.9.1**" in page
    for name, requirements in extras.items():
        if name != "verl":
            assert not any("verl" in r for r in requirements), name
    assert "-e .[cpu,verl,trl]" in open(os.path.join(ROOT, ".ci", "run")).read()


def _install_extras():
    """(file, extra) for every extra an install line names: `.[a,b]` and `rl-triton[a,b]` in the
    README, the docs pages, the examples, the package's messages and .ci/run (whose main-stage
    default is the variable CI_EXTRAS), and the extras the `all` extra pulls in."""
    paths = ["README.md", os.path.join(".ci", "run"), "pyproject.toml"]
    for folder, suffix in (("docs", ".md"), ("examples", ".py"), ("rl_triton", ".py"), ("benchmarks", ".py")):
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(suffix)]
    found = []
    for path in paths:
        text = open(os.path.join(ROOT, path)).read()
        groups = re.findall(r"(?:\.|rl-triton)\[([A-Za-z0-9_,.\- ]+)\]", text)
        groups += re.findall(r'CI_EXTRAS:-([^}"]+)\}', text)
        found += [(path, extra.strip()) for group in groups for extra in group.split(",")]
    return found


def test_install_lines_name_normalised_extras():
    """Every extra an install line names is one pyproject.toml defines, spelt in its normalised
    form (lower case, '-' between words): pip before 23.3 matches the written name against the
    metadata's normalised one, so `.[cpu,rsl_rl]` installed no rsl_rl there (only a warning,
    "does not provide the extra 'rsl_rl'")."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    normalised = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
    assert all(normalised.fullmatch(name) for name in extras), sorted(extras)
    found = _install_extras()
    named = {extra for _, extra in found}
    assert {"rsl-rl", "rl-games", "cpu", "gpu", "examples", "verl"} <= named, sorted(named)
    wrong = [(path, extra) for path, extra in found if extra not in extras]
    assert not wrong, f"install lines name extras pyproject.toml does not define: {wrong}"
