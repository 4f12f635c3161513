"""The runtime: joining the cluster (`job.initialize`, one class per environment), the local launcher's
process group, the checks before training, and what keeps a run alive or stops it loudly (preemption,
the hang watchdog, the compilation cache)."""
