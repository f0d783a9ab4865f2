"""Native kernels and their typed Python faces, below every layer that calls them (attention
backends, the model's element-wise passes, the sampler)."""
