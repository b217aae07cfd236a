"""Data in and out: text corpora and batches, packed documents, tokenizers, TensorBoard files.

May import: ``core``, ``runtime``.
"""
