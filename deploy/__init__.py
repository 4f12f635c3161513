"""Submission of the job to clusters: Slurm (submitit or sbatch) and Cloud TPU pods (gcloud).

Every external command goes through `deploy.runner.Runner`, so tests can
check the exact argv and `DRY_RUN=1` can print it instead of running it.
"""
