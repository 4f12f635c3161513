"""A user's own package in their fork of the template, beside job/: what `make tpu-pod` must ship by itself."""
