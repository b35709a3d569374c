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
from helpers import run_python_block

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
    "rl_triton/integrations/skyrl.py": "rl_triton.integrations.skyrl",
    "rl_triton/integrations/nemo_rl.py": "rl_triton.integrations.nemo_rl",
    "rl_triton/integrations/slime.py": "rl_triton.integrations.slime",
    "rl_triton/integrations/areal.py": "rl_triton.integrations.areal",
    "rl_triton/integrations/openrlhf.py": "rl_triton.integrations.openrlhf",
    "rl_triton/integrations/pufferlib.py": "rl_triton.integrations.pufferlib",
    "rl_triton/integrations/tianshou.py": "rl_triton.integrations.tianshou",
    "rl_triton/integrations/sample_factory.py": "rl_triton.integrations.sample_factory",
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
    assert "-e .[cpu,verl,trl,skyrl]" in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="needs numba (the cpu extra)")
def test_first_call_compiles_and_is_cached_on_disk(tmp_path):
    """README and docs/index.md say that the first call of a signature compiles and that the
    compiled code is cached on disk: after a first process numba's cache holds the CPU kernel,
    and a second process loads it without writing the cache again."""
    for path in ("README.md", "docs/index.md"):
        text = " ".join(open(os.path.join(ROOT, path)).read().split())
        assert "**The first call compiles.**" in text and "cache the compiled code on disk" in text, path
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    code = "import torch, rl_triton as rt; rt.gae(torch.ones(3, 16), torch.ones(3, 16), backend='cpu')"

    def run():
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}

    first = run()
    assert any(p.suffix == ".nbi" for p in first) and any(p.suffix == ".nbc" for p in first), sorted(first)
    assert run() == first


# the modules whose public functions' docstrings must document every argument
DOCUMENTED = ["rl_triton"] + [f"rl_triton.integrations.{m}" for m in (
    "sb3", "torchrl", "rllib", "cleanrl", "rsl_rl", "skrl", "rl_games", "verl", "trl", "openrlhf", "pufferlib",
    "tianshou", "skyrl", "nemo_rl", "slime", "areal")]


def _args_section(doc: str) -> list:
    """The parameter names of a Google-style docstring's ``Args:`` section, in order."""
    names, inside = [], False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside = True
        elif inside and line.strip() and not line.startswith(" "):
            inside = False  # the next section
        elif inside and re.match(r"^    \S", line):
            match = re.match(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:", line)
            assert match, f"not an Args entry: {line!r}"
            names.append(match.group(1).lstrip("*"))
    return names


def _documented_callables(module_name: str):
    """(qualified name, docstring, parameters) for every public function of the module and
    every public class that defines its own ``__init__``: the names of ``__all__`` and the
    members docs/api.md renders for the module."""
    import inspect

    module = pytest.importorskip(module_name)
    names = list(getattr(module, "__all__", []))
    names += [e[len(module_name) + 1:] for e in _api_entries() if e.startswith(module_name + ".")
              and "." not in e[len(module_name) + 1:]]
    found = []
    for name in dict.fromkeys(names):
        obj = getattr(module, name, None)
        if inspect.isclass(obj):
            owner = next(k for k in obj.__mro__ if "__init__" in vars(k))
            if not owner.__module__.startswith("rl_triton"):
                continue  # the framework's own __init__
            doc, fn = (inspect.getdoc(obj) or "") + "\n" + (inspect.getdoc(obj.__init__) or ""), obj.__init__
        elif inspect.isfunction(obj) or inspect.isfunction(getattr(obj, "__wrapped__", None)):
            doc, fn = inspect.getdoc(obj) or "", obj
        else:
            continue  # a constant
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
        found.append((f"{module_name}.{name}", doc, params))
    return found


@pytest.mark.parametrize("module", DOCUMENTED)
def test_docstrings_describe_every_argument(module):
    """Every public function's docstring (a class's, for its ``__init__``) has an Args section
    with an entry for each of its parameters, and none for a name it does not take."""
    missing = []
    for name, doc, params in _documented_callables(module):
        listed = [n for n in _args_section(doc) if n not in ("self", "cls")]
        if set(listed) != set(params):
            missing.append(f"{name}: lacks {sorted(set(params) - set(listed))}, "
                           f"names {sorted(set(listed) - set(params))} it does not take")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("module", DOCUMENTED)
def test_docstring_arguments_in_signature_order(module):
    """The Args entries come in the order of the signature, once each, so that an argument shared
    by several functions (the flags, gamma, time_dim, backend, out, group, ...) is found where the
    signature puts it."""
    for name, doc, params in _documented_callables(module):
        listed = [n for n in _args_section(doc) if n not in ("self", "cls")]
        assert listed == [p for p in params if p in listed], f"{name}: Args in the order {listed}, signature {params}"


def test_documented_needs_a_text_for_every_argument():
    """``documented`` refuses a parameter without a text and a text for no parameter, so the
    built docstrings cannot fall behind the signatures."""
    from rl_triton.core.docstrings import ARGS, documented

    def f(rewards, *, gamma=0.99, brand_new=None):
        """Doc."""

    with pytest.raises(TypeError, match="brand_new"):
        documented()(f)
    with pytest.raises(TypeError, match="nonexistent"):
        documented(brand_new="text", nonexistent="text")(f)
    built = documented(brand_new="its text.")(f).__doc__
    assert _args_section(built) == ["rewards", "gamma", "brand_new"]
    assert " ".join(ARGS["gamma"].split()[:6]) in " ".join(built.split())


# framework page -> the module its first snippet needs (None: rl_triton alone). verl's, TRL's and
# SkyRL's pages: tests/test_verl.py, tests/test_trl.py and tests/test_skyrl.py, in the environment
# that has them.
PAGE_NEEDS = {"areal": None, "nemo_rl": None, "slime": None, "sb3": "stable_baselines3", "torchrl": "torchrl", "cleanrl": None, "rllib": "ray.rllib",
              "rsl_rl": "rsl_rl", "skrl": "skrl", "rl_games": "rl_games", "pufferlib": "pufferlib",
              "openrlhf": "openrlhf"}
# pufferlib.pufferl as far as patch() reads it (pufferlib 3.0.0 does not install on a CPU-only
# machine: docs/pufferlib.md); the same stand-in as tests/test_pufferlib.py's
STAND_INS = {"pufferlib": {"pufferlib/__init__.py": "", "pufferlib/pufferl.py": None}}
# OpenRLHF's RemoteExperienceMaker with the two methods patch() replaces, their 0.11 signatures
OPENRLHF_MAKER = """
class RemoteExperienceMaker:
    def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
        raise RuntimeError("OpenRLHF's own method ran")

    def get_cumulative_returns(self, rewards, action_mask, gamma):
        raise RuntimeError("OpenRLHF's own method ran")
"""
STAND_INS["openrlhf"] = {f"openrlhf/{p}__init__.py": "" for p in ("", "trainer/", "trainer/ppo_utils/")}
STAND_INS["openrlhf"]["openrlhf/trainer/ppo_utils/experience_maker.py"] = OPENRLHF_MAKER


@pytest.mark.parametrize("page", sorted(PAGE_NEEDS))
def test_framework_page_first_snippet_runs(page, tmp_path):
    """The first ```python block of each framework page runs as written in a fresh process. Where
    the framework is missing the test skips, except for PufferLib and OpenRLHF, whose snippets
    (patch and unpatch) run on a stand-in package of the structure patch() reads when the real
    one is not installed (PufferLib 3.0.0 does not install beside the other frameworks)."""
    module = PAGE_NEEDS[page]
    path = []
    # asked of a fresh process, as the snippet runs: this one's sys.path and sys.modules hold
    # other tests' stand-ins (and benchmarks/, whose pufferlib.py is no framework)
    found = module is not None and subprocess.run(
        [sys.executable, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module.split('.')[0]!r}) is None)"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True).returncode == 0
    if module is not None and not found:
        if page not in STAND_INS:
            pytest.skip(f"{module} is not installed")
        from test_pufferlib import PUFFERL

        for name, text in STAND_INS[page].items():
            (tmp_path / "stand_in" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "stand_in" / name).write_text(PUFFERL if text is None else text)
        path = [tmp_path / "stand_in"]
    work = tmp_path / "work"
    work.mkdir()
    done = run_python_block(f"docs/{page}.md", work, path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_rl_games_page_patch_block_runs(tmp_path):
    """docs/rl_games.md's second block (patch, unpatch, a patched block) imports what it uses."""
    pytest.importorskip("rl_games")
    done = run_python_block("docs/rl_games.md", tmp_path, index=1)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


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
