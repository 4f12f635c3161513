"""A second example task, deliberately unlike the LM: classify points of generated spirals with an MLP.

    python -m job train --task classify --steps 300 --run-dir runs/classify
    make run-local ARGS='train --task classify --run-dir runs/classify'

Float features and one integer label per row, no sequence axis: the loop,
checkpoints, resume and topology invariance are the ones the LM uses.
"""
