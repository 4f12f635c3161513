"""A user's task in their own package (docs/training.md, "Write your own task"): the classifier of mypkg/model.py
on the rows of mypkg/data.py, trained with the template's loop on every worker.

    make tpu-pod TPU_NAME=my-pod ZONE=us-central2-b ACCELERATOR=v4-16 \\
        ARGS='train --task mypkg.tasks:TASK --run-dir gs://my-bucket/clusters'
"""

from __future__ import annotations

import job.task
from mypkg.data import Clusters, DataConfig
from mypkg.model import Classifier, ModelConfig, cross_entropy

TASK = job.task.Task(name="clusters", model_config=ModelConfig, data_config=DataConfig,
                     build=lambda cfg, rngs: Classifier(cfg, rngs=rngs), loss=cross_entropy, source=Clusters,
                     shown=("loss", "accuracy"))
