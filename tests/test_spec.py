"""The structure the library relies on: every algorithm of rl_triton/core/spec.py has a numba
kernel whose parameters are the spec's names and a Triton builder; the mode integers follow from
the inputs present; no import cycle inside rl_triton."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib

import pytest

from rl_triton.core import cpu, spec

PACKAGE = pathlib.Path(spec.__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(spec.ALGORITHMS) + list(spec.WINDOWED))
def test_numba_kernel_parameters_are_the_spec_names(name):
    algo = spec.ALGORITHMS.get(name) or spec.WINDOWED[name]
    kernels = [cpu.KERNELS[name]] + ([cpu.gae_row_blocks] if algo is spec.GAE else []) + (
        [cpu.nstep_return_blocks] if algo is spec.NSTEP_RETURN else [])
    for kernel in kernels:
        assert tuple(inspect.signature(kernel).parameters) == algo.names + algo.outputs + ("edge",), kernel.__name__


def test_episode_starts_kernels_take_gae_names():
    """SB3's and CleanRL's GAE kernels take a subset of GAE's arguments, under GAE's names
    (the episode starts in the done slot) and its outputs."""
    for kernel in (cpu.gae_episode_starts, cpu.gae_episode_starts_blocks):
        params = tuple(inspect.signature(kernel).parameters)
        assert params[-2:] == spec.GAE.outputs
        assert set(params[:-2]) - {"episode_starts"} <= set(spec.GAE.names)
        assert len(params) - 2 == len(cpu._EPISODE_STARTS_KINDS)


def test_every_algorithm_has_a_triton_builder():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    from rl_triton.core.kernels import builders

    assert set(builders.PARTS) == set(spec.ALGORITHMS)
    assert not set(builders.PARTS) & set(spec.WINDOWED)  # no windowed algorithm in the scan engine


def test_a_windowed_algorithm_has_no_carry_and_no_direction():
    for algo in spec.WINDOWED.values():
        assert algo.window and algo.reverse is None and "carry" not in algo.names
    with pytest.raises(ValueError, match="no carry and no direction"):
        spec.Algorithm("bad", (spec.Arg("x", "f2"), spec.Arg("carry", "f1")), ("y",), reverse=None, carry="",
                       window=True)


_NO_KL = dict(kl_mode=spec.KL_NONE)


@pytest.mark.parametrize("given,expected", [
    (dict(), dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_TERM_OR_TRUNC, **_NO_KL)),
    (dict(next_values=1, done=1), dict(nv_mode=spec.NV_EXPLICIT, done_mode=spec.DONE_ARRAY, **_NO_KL)),
    (dict(terminated=1, truncated=1), dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_TERM_OR_TRUNC, **_NO_KL)),
    (dict(done=1, last_done=1), dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_OBS_ALIGNED, **_NO_KL)),
    # the KL estimator from its coefficient's slot (1 + its index), KL_CLAMPED added with a clamp
    (dict(log_probs=1, kl_k1=0.1), dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_TERM_OR_TRUNC, kl_mode=1)),
    (dict(log_probs=1, kl_k3=0.1, kl_clamp=10.0),
     dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_TERM_OR_TRUNC, kl_mode=3 + spec.KL_CLAMPED)),
    (dict(log_probs=1, kl_abs=0.1), dict(nv_mode=spec.NV_IMPLIED, done_mode=spec.DONE_TERM_OR_TRUNC, kl_mode=4)),
])
def test_bind_derives_the_modes(given, expected):
    args = spec.GAE.bind(**given)
    assert {m: getattr(args, m) for m in spec.GAE.modes} == expected
    assert spec.RETRACE.bind(next_expected_q=1).ev_mode == spec.EV_GIVEN
    assert spec.RETRACE.bind(next_pi=1, next_q=1).ev_mode == spec.EV_PAIRS


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of rl_triton that ``path`` imports, at any depth of its code (lazy imports too)."""
    module = _name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rl_triton"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("rl_triton"):
                continue
            for alias in node.names:  # "from . import x" may name a submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    found.discard(module)
    return found


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_no_import_cycle_inside_the_package():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_name(path)] = _imports(path)
    state: dict[str, int] = {}

    def visit(node, trail):
        if state.get(node) == 1:
            cycle = trail[trail.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])
