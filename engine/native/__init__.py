"""kvpilot.engine.native — fused float32 CPU kernels in C, for the CPU decode/prefill hot loop.

Package map:
- ``cpu_ops.c`` the kernels: RMSNorm with the residual add fused in, RoPE in place, K/V scatter into
                the paged (HND) cache, SiLU-and-multiply, paged decode attention reading blocks in place
- ``build``     compiles ``cpu_ops.c`` once per host (``-O3 -march=native``) into the cache directory and
                loads it with ctypes; ``NativeBuildError`` when no compiler is found or the build fails
- ``ops``       ``NativeOps``: tensor wrappers that validate dtype/layout before calling C, and the PyTorch
                reference each kernel is tested against

Used by the model (``kvpilot.engine.model.llama``) and the torch attention backend when the engine runs
float32 on CPU with ``native_cpu_ops`` on (``auto``: when the build succeeds).
"""
