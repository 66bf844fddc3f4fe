"""Training: the ``vit-fast train`` loop, data sets, metrics and resumable checkpoints."""
