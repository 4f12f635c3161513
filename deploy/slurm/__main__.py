"""`python -m deploy.slurm`: submit the job to Slurm (`make submit-slurm`), or a sweep as one job array (SWEEP)."""

import sys

from deploy.slurm.array import main

if __name__ == "__main__":
    sys.exit(main())
