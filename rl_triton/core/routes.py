"""The one declaration of a public function: which route a call takes.

``@routes.public(rule, outputs=n)`` on an estimator (or ``affine_scan``) sends a call with
``group=`` to the sharded route (rl_triton/core/sharded.py, split by ``rule``), one with
``cu_seqlens``/``max_seqlen`` to the packed route (rl_triton/core/packed.py, the padded call of the
same sequences) and every other call to the function's body through its signature's plan
(rl_triton/core/plans.py). The routes call the public function again, without the argument that
sent them there, so the body only ever sees one window of ``[R, T]`` rows. The sharded route
runs the body as a chunk of the split sequence by passing it ``_chunk`` (a ``plans.Chunk``: the
carry it starts from, where to write its edge map), which the body hands to its ``Call``: no
hidden state carries it.
"""

from __future__ import annotations

import functools
import inspect

from . import packed, plans, sharded
from .call import launch_bound


def public(rule: sharded.Rule | None, *, outputs: int = 1):
    """Declare a public function: ``rule`` says how it runs split across ranks (its scan
    direction, the boundary inputs a chunk reads, what it hands on; None: a function without
    ``group`` and ``cu_seqlens``, whose calls only take the plan's route); ``outputs`` is how many
    tensors it returns. The function keeps its signature and docstring."""
    if outputs not in (1, 2):
        raise ValueError(f"outputs must be 1 or 2, got {outputs!r}")

    def declare(fn):
        planned = plans.cached(fn, launch_bound)
        if rule is None:
            return planned
        signature = inspect.signature(fn)
        for name in ("group", "cu_seqlens", "max_seqlen", "time_dim", "out", "_chunk"):
            if signature.parameters.get(name, None) is None \
                    or signature.parameters[name].kind != inspect.Parameter.KEYWORD_ONLY:
                raise TypeError(f"{fn.__name__} must take the keyword-only argument {name!r} to be public")

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs.get("group") is None and kwargs.get("cu_seqlens") is None \
                    and kwargs.get("max_seqlen") is None:
                # a chunk of a split sequence takes the full path: its carries are its own
                return planned(*args, **kwargs) if kwargs.get("_chunk") is None else planned.full(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)  # Python's own TypeError for a bad call
            bound.apply_defaults()
            kw = bound.arguments
            if kw["group"] is not None:
                if rule.unsplit is not None:
                    raise NotImplementedError(f"{fn.__name__} takes no group=: {rule.unsplit}")
                if kw.pop("_chunk") is not None:
                    raise ValueError("a chunk of a split sequence takes no group")
                return sharded.run(call, kw, rule)
            reverse = rule.reverse if rule.reverse is not None else kw["reverse"]
            if not isinstance(reverse, bool):
                raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
            if kw.get("whiten", False) is not False and kw.get("mask") is None:
                raise ValueError("whiten with cu_seqlens needs a mask: the padded call would count the padding")
            return packed.run(call, kw, reverse=reverse, n_out=outputs)

        # the public signature leaves out ``_chunk``, the sharded route's argument (sharded.py)
        call.__signature__ = signature.replace(
            parameters=[p for name, p in signature.parameters.items() if name != "_chunk"])
        return call

    return declare
