"""A run's lasting record: checkpoints and where they are stored (a folder or a bucket), picking up
where a run stopped, and the provenance that lets a run be rerun bitwise."""
