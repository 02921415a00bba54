"""GPU kernels and their toolchain (TileLang). Optional: nothing here is imported unless a CUDA
tensor reaches an op in invariant mode, and ``tilelang`` itself only when a kernel is built."""
