"""`python -m deploy.slurm`: submit the job to Slurm (`make submit-slurm`)."""

import sys

from deploy.slurm.submit import main

if __name__ == "__main__":
    sys.exit(main())
