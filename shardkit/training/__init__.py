"""Training: the step (gradients, accumulation, the optimizer and the non-finite guard), the
``Trainer`` that compiles it, losses, checkpoints (orbax, atomic, checksummed) and pretrained
weights.

May import: ``core``, ``runtime``, ``io``, ``parallel``, ``models``, ``analysis``.
"""
