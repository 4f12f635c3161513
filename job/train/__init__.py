"""The training loop and its parts, the files a fork reads: the task interface, the config, the state,
the jitted steps, the batches, evaluation, the optimizer, and a run after training."""
