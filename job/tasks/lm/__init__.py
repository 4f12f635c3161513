"""The example task: a small decoder-only transformer LM learning to reverse sequences (or a token file).

    python -m job train --steps 200 --model.layers 2 --data.global-batch 32
    python -m job train --data.source tokens.npy --model.vocab-size 256
    python -m job tokenize INPUT.txt OUTPUT.npy            # text -> byte-level token file
    python -m job tokenize INPUT.txt OUTPUT.npy --tokenizer tokenizer.json   # a tokenizer's ids (docs/tokenizers.md)

The folder to copy when you bring your own model: `model.py` (the network and
its loss), `data.py` (rows of a batch as a pure function of split, step and
row), and `task.py` (its `TASK`, which tells the loop about them).
"""
