"""Testing support shipped with rl_triton, for its tests, benchmarks and demo.

- :mod:`rl_triton.testing.oracle`: the independent float64 reference, plain loops over numpy
  arrays written from docs/semantics.md;
- :mod:`rl_triton.testing.catalog`: problems for every public function (draw the inputs, call
  the library, and compute what the oracle says the call returns);
- :mod:`rl_triton.testing.lowering`: counts of what Triton emits for the engine's scan (imports
  triton; not imported here).
"""

from . import catalog, oracle
from .catalog import Problem, make, reference

__all__ = ["Problem", "catalog", "make", "oracle", "reference"]
