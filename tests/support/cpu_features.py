"""What this host's CPU offers the C kernels, read from /proc/cpuinfo without building them."""

from __future__ import annotations

from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")
_FLAGS = set(_CPUINFO.read_text().split()) if _CPUINFO.exists() else set()

#: the int8-activation GEMM runs here: AVX-512 VNNI and BW (quant_vnni.c), or AVX2, FMA and F16C
#: (quant_vnni_avx2.c); ``activation_quantization='auto'`` then picks int8 for gguf/int8 weights
HAS_INT8_KERNEL = {"avx512_vnni", "avx512bw"} <= _FLAGS or {"avx2", "fma", "f16c"} <= _FLAGS
NO_INT8_KERNEL = "this CPU has neither AVX-512 VNNI nor AVX2 (no int8-activation kernel)"
