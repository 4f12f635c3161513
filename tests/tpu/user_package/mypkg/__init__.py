"""A user's own package in their fork of the template, beside job/: a classifier task in three modules (the model,
its data, the task), which `make tpu-pod` must ship by itself for `--task mypkg.tasks:TASK`."""
