"""rl_triton core: semantics, validation, backend dispatch, autograd and the kernels."""
