"""Training: the trainer, byte-level data, checkpoints, loss log."""
