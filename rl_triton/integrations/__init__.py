"""Framework integrations: each maps its framework's conventions onto rl_triton's estimators
and holds no math of its own."""
