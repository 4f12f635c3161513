"""Tasks written the way a user writes them: outside the job package, loaded by --task MODULE:ATTR."""
