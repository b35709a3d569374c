"""``python -m rl_triton``: check and time every estimator on this machine (see rl_triton.demo)."""

import sys

from rl_triton.demo import main

if __name__ == "__main__":
    sys.exit(main())
