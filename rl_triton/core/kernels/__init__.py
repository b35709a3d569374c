"""Triton kernels: the GPU backend (one scan engine plus per-algorithm coefficient builders).

The engine arrives with the Triton issue; until then ``AVAILABLE`` is False and the
dispatcher never selects this backend.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
AVAILABLE = False
