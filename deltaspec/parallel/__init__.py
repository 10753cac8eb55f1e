"""Tensor parallelism: one model across several processes (one per GPU), over torch.distributed."""
