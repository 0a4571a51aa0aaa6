"""Training with an engine: a step, its loss, the parameters, checkpoints, traced steps."""
