"""The CPU attention backend (backend.py) and its prefill paths (chunks.py, split_prefill.py,
tail_prefill.py), over the native kernels of infer8/kernels/cpu/. The registry
(attention/__init__.py) chooses it; the model sees only the backend protocol."""
