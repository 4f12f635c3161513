"""Cloud TPU pod slices through gcloud: `python -m deploy.tpu` (`make tpu-*`)."""
