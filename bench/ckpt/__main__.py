"""`python -m bench.ckpt [--quick]`, and `python -m bench.ckpt worker ...`: the save bench (bench.ckpt.save)."""

import sys

from bench.ckpt.save import main

if __name__ == "__main__":
    sys.exit(main())
