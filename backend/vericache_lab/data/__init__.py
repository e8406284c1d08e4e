"""The data training and evaluation both read: the code corpus and its tokenizer (``corpus``), the synthetic
long-range tasks (``tasks``)."""
