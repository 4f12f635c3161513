"""The classify task's TASK: what the training loop needs to know about it (see job/task.py)."""

from __future__ import annotations

from job.task import Task
from job.tasks.classify import data, model


def _validate(model_cfg: model.ModelConfig, data_cfg: data.DataConfig, *, rule: str, model_axis: int) -> None:
    model.validate(model_cfg)
    data.validate(data_cfg)


TASK = Task(
    name="classify",
    model_config=model.ModelConfig,
    data_config=data.DataConfig,
    build=lambda cfg, rngs: model.Classifier(cfg, rngs=rngs),
    loss=model.loss_fn,
    source=lambda data_cfg, model_cfg: data.Spirals(data_cfg, features=model_cfg.features,
                                                    classes=model_cfg.classes),
    validate=_validate,
    shown=("loss", "accuracy"),
    weight="count",
)
