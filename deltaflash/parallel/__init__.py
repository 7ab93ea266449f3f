"""Running one model over several devices: tensor parallelism (tensor.py)."""
