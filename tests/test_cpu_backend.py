"""The numba backend's own mechanics: which build runs, and the flag passes it makes.

Results against the oracle are covered for every backend in test_oracle_agreement.py; these
tests pin down what those cannot see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rl_triton.core import cpu

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason="needs numba")

_BUILD = textwrap.dedent("""
    import sys
    import numpy as np
    from rl_triton.core import cpu
    kernel = cpu._kernel("affine_scan", np.dtype(np.float64), sys.argv[1] == "parallel")
    print(sum(kernel.stats.cache_hits.values()))
""")


def test_serial_and_parallel_builds_have_their_own_cache_entries(tmp_path):
    """numba's disk cache keys a build by function name and signature, not by compile flags:
    without separate names the serial kernel loads the parallel build saved earlier (or the
    reverse), and small calls pay for the thread pool while large ones run on one core."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def cache_hits(variant: str) -> str:
        done = subprocess.run([sys.executable, "-c", _BUILD, variant], env=env, capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    assert cache_hits("parallel") == "0"  # compiled and saved
    assert cache_hits("serial") == "0"  # not the parallel build: compiled too
    assert cache_hits("serial") == "1"  # now found in the cache
    assert cache_hits("parallel") == "1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.int16,
                                   torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.bool])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_flag_bytes_and_binary_check(dtype, layout):
    """Flags of any dtype and layout become 0/1 bytes in place of nonzero; the 0/1 check sees
    every element."""
    mask = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)) < 0.3
    if layout == "strided":
        x = torch.ones(6, 80, dtype=dtype)[:, ::2]
        x.copy_(mask)
    else:
        x = (mask if layout == "contiguous" else mask.t().contiguous().t()).to(dtype)
    assert torch.equal(torch.from_numpy(cpu._flag_bytes(x).copy()), mask.to(torch.uint8))
    assert cpu.all_binary(x)
    if dtype != torch.bool:
        y = x.clone()
        y[5, 39] = 2
        assert not cpu.all_binary(y)
        if dtype.is_floating_point:
            y[5, 39] = 0.5
            assert not cpu.all_binary(y)
