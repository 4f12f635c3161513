"""A run's lasting record: checkpoints and their config, picking up where a run stopped, and the
provenance that lets a run be rerun bitwise."""
