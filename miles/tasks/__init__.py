"""Synthetic tasks whose outputs can be checked exactly: data, a scorer and a pretrained base model each."""
