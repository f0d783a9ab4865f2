"""Multi-LoRA serving: adapters, slots and the batched low-rank products."""
