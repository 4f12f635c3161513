"""Submission to Slurm: `python -m deploy.slurm` (`make submit-slurm`), through submitit or `slurm/train.sbatch`."""
