"""The CUDA backend: Triton kernels (decode.py and prefill.py: attention, tiles.py: what both
read, write.py: quantize-on-write, tail.py / tail_write.py: the exact tail), their launchers
(launch.py) and the backend over them (backend.py). The kernels also run on CPU tensors under
TRITON_INTERPRET=1, where tests check them against the reference."""
