"""Native CPU kernels: every C/C++ source under csrc/, the build helper (native_build.py), and one Python face per
kernel that takes tensors only and declares the kernel's C entry points once (its BINDING: names, ctypes types,
limits, status texts and argument structs). Nothing here imports the rest of the runtime but the cache folder."""
