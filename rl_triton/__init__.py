"""rl_triton: reinforcement-learning credit assignment at memory-bandwidth speed.

Nine estimators and the generic affine scan behind them, each one fused scan on the best
backend for the tensors' device (Triton on CUDA, numba on CPU, plain torch otherwise).
"""

from .core.estimators import (
    arrival_gae,
    discounted_return,
    eligibility_trace,
    episodic_cumsum,
    gae,
    nstep_return,
    retrace,
    td_lambda_return,
    vtrace,
)
from .core import vml as _vml
from .core.groups import group_advantages
from .core.scan import affine_scan
from .core.sharded import Shards
from .core.whiten import masked_moments, masked_whiten

__all__ = [
    "arrival_gae",
    "affine_scan",
    "discounted_return",
    "eligibility_trace",
    "episodic_cumsum",
    "gae",
    "group_advantages",
    "masked_moments",
    "masked_whiten",
    "nstep_return",
    "retrace",
    "Shards",
    "td_lambda_return",
    "vtrace",
]
__version__ = "0.1.0"

_vml.warm()  # before the library computes anything: oneMKL's first-call race (rl_triton/core/vml.py)
