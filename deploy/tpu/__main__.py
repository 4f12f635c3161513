"""`python -m deploy.tpu`: create, run on and delete Cloud TPU pod slices (`make tpu-*`)."""

import sys

from deploy.tpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
