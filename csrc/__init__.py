"""The CUDA kernel sources (.cu/.cuh), compiled at run time by NVRTC. Shipped inside the wheel as the package
``detcomm.csrc`` so detcomm.workspace.kernels finds them with importlib.resources; nothing here is Python."""
