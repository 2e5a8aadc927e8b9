"""The devices a runner launches on: the `Device` interface (device.py), the CPU device that behaves like
a GPU (cpu_device.py) and CUDA (cuda_device.py), `make_device` (make.py), and what they share: host
copies, event waits, the CPU's thread count and batch invariance, the GPU memory budget."""
