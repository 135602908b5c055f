"""Native CPU kernels: every C/C++ source under csrc/, the build helper (native_build.py), and one Python face per
kernel that takes tensors only. Nothing here imports the rest of the runtime but the cache folder."""
