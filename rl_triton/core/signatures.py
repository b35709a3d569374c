"""Argument lists of the fused kernels, shared by the numba and Triton backends.

Estimators call ``run(name, *args, *outputs)`` on either backend with the arguments in this
order. Kinds: ``f1``/``f2``/``f3`` float tensors ``[R]``/``[R, T]``/``[R, T, A]`` (None when
absent; ``f2`` coefficients may be plain numbers), ``u2``/``u1`` flag tensors ``[R, T]``/``[R]`` of
any dtype (None when absent), ``s`` float, ``i`` mode integer, ``b`` bool. Outputs are ``f2``.
"""

KINDS = {
    # the flag group is always: terminated, done, truncated (u2), last done (u1)
    "gae": "f2 f2 f2 f1 u2 u2 u2 u1 f2 f2 i i",
    "td_lambda": "f2 f2 u2 u2 u2 u1 f2 f2 i",
    "discounted": "f2 f2 f1 u2 u2 u2 u1 f2 i",
    "vtrace": "f2 f2 f2 f1 f2 f2 u2 u2 u2 u1 f2 f2 s s s i i",
    "retrace": "f2 f2 f2 f2 f2 f3 f3 u2 u2 u2 u1 f2 f2 s i i",
    "forward_trace": "f2 u2 f2 f2 f1",
    "affine_scan": "f2 f2 f1 b",
}
N_OUT = {"gae": 2, "vtrace": 2}

# how next values are read: explicit array, or values[t+1] with bootstrap at t = T-1
NV_EXPLICIT, NV_IMPLIED = 0, 1
# how done is read: the done array; terminated | truncated; or observation-aligned, the done
# array holding episode starts (done[t] = starts[t+1], the last-done array at t = T-1), all of
# them terminations
DONE_ARRAY, DONE_TERM_OR_TRUNC, DONE_OBS_ALIGNED = 0, 1, 2


def kinds(name: str, outputs: str = "f2") -> list[str]:
    """Kinds of all arguments of kernel ``name``, the outputs (of kind ``outputs``) last."""
    return KINDS[name].split() + [outputs] * N_OUT.get(name, 1)
