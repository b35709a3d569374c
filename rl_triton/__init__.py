"""rl_triton: reinforcement-learning credit assignment at memory-bandwidth speed.

Eight estimators and the generic affine scan behind them, each one fused scan on the
best backend for the tensors' device (Triton on CUDA, numba on CPU, plain torch otherwise).
"""

from .core.estimators import (
    arrival_gae,
    discounted_return,
    eligibility_trace,
    episodic_cumsum,
    gae,
    retrace,
    td_lambda_return,
    vtrace,
)
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
    "retrace",
    "Shards",
    "td_lambda_return",
    "vtrace",
]
__version__ = "0.1.0"
