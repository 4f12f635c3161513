"""An exponential moving average of a model's parameters: extra train state, placed, checkpointed and
restored with the rest, and evaluated beside the raw parameters.

    python -m job train --ema.decay 0.999      # any task; eval metrics gain ema_loss, ...

    ema = EMA(model, decay=0.999)   # a copy of the model whose Params follow the trained ones
    ema.update(model)               # after each optimizer update (the loop's step does this)
    ema.model(x)                    # the averaged model

The copy keeps the model's annotations, so every rule splits it as it splits the model.
"""

from __future__ import annotations

import jax
from flax import nnx


class EMA(nnx.Module):
    def __init__(self, model: nnx.Module, decay: float) -> None:
        self.decay = decay
        self.model = nnx.clone(model)

    def update(self, model: nnx.Module) -> None:
        """averaged = decay * averaged + (1 - decay) * the model's Params."""
        d = self.decay
        averaged = jax.tree.map(lambda a, p: d * a + (1.0 - d) * p, nnx.state(self.model, nnx.Param),
                                nnx.state(model, nnx.Param))
        nnx.update(self.model, averaged)


__all__ = ["EMA"]
