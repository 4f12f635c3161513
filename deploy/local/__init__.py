"""This machine through the local launcher, `python -m job.launch`: its doctor (`make doctor WHERE=local`) and
its sweeps (`make run-local SWEEP=...`)."""
