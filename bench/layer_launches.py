"""Kernel launches per decoder layer in a decode step: the plain PyTorch layer against the fused path on
Triton kernels (what CUDA runs), both on the Triton attention backend, counted on the host.

    python bench/layer_launches.py            # tiny-random on CPU (the Triton kernels in the interpreter)

A launch is an ATen operator that computes (views, reshapes of contiguous tensors and other metadata-only
operators are not counted) or one Triton kernel: of ``TritonFusedOps``, or the attention backend's K/V
write (which on the fused path also applies RoPE) and decode attention (one more, to merge KV splits,
when a step splits; this count is made on the CPU, where it does not). They are counted while a decoder
layer runs. On a GPU each counted operator is at least one kernel launch and its host-side dispatch,
which is what bounds a small-batch decode step there (issue 20: ~37 eager launches per layer on the 1B
shape).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

from kvpilot.engine import LLM, SamplingParams

#: operators that only make a new view or read metadata: no kernel runs
_NO_KERNEL = {
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "split",
    "split_with_sizes",
    "select",
    "unsqueeze",
    "squeeze",
    "t",
    "transpose",
    "permute",
    "expand",
    "as_strided",
    "alias",
    "detach",
    "unbind",
    "narrow",
    "empty",
    "empty_strided",
    "empty_like",
    "lift_fresh",
    "_to_copy_noop",
}


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # a cast to the dtype a tensor already has returns it: no kernel (in bf16 on a GPU it would be one)
        no_op_cast = name == "to" and args and out is args[0]
        if self.active and name not in _NO_KERNEL and not no_op_cast:
            self.ops[name] += 1
        return out


def count_decode_step(llm: LLM, fused_ops) -> tuple[Counter[str], int]:
    """Launches inside the decoder layers during one decode step, by operator, and the layer count."""
    engine, model = llm.engine, llm.engine.model
    model.fused_ops = fused_ops
    counter = _Counter()
    layer_cls = type(model.layers[0])
    originals = {name: getattr(layer_cls, name) for name in ("forward", "forward_native")}
    kernels = engine.backend.kernels(engine.device)
    backend_kernels = [(kernels.kv_write, "write_kv"), (kernels.decode, "paged_decode")]
    backend_originals = [getattr(module, name) for module, name in backend_kernels]

    def counted(original):
        def run(self, *args, **kwargs):
            counter.active = True
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.active = False

        return run

    def triton_launch(method, name):
        def launch(*args, **kwargs):
            if not counter.active:
                return method(*args, **kwargs)
            counter.ops[f"triton:{name}"] += 1
            counter.active = False  # the interpreter's own tensor copies are not the kernel's launches
            try:
                return method(*args, **kwargs)
            finally:
                counter.active = True

        return launch

    if fused_ops is not None:
        for name in ("add_rms_norm", "rope_", "silu_mul", "gelu_tanh_mul"):
            setattr(fused_ops, name, triton_launch(getattr(fused_ops, name), name))
    engine.add_request("count", list(range(5, 37)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the prompt
    for name, original in originals.items():
        setattr(layer_cls, name, counted(original))
    for (module, name), original in zip(backend_kernels, backend_originals, strict=True):
        setattr(module, name, triton_launch(original, name))
    try:
        with counter:
            engine.step()  # one decode token
    finally:
        for name, original in originals.items():
            setattr(layer_cls, name, original)
        for (module, name), original in zip(backend_kernels, backend_originals, strict=True):
            setattr(module, name, original)
    while engine.has_unfinished_requests():
        engine.step()
    return counter.ops, len(model.layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    args = parser.parse_args(argv)
    from kvpilot.engine.model.fused_triton import TritonFusedOps  # after TRITON_INTERPRET is decided

    llm = LLM(
        model=args.model,
        device="cpu",
        dtype="float32",
        native_cpu_ops="off",
        attention_backend="triton",
        num_kv_blocks=64,
    )
    rows = []
    for label, ops in (("plain PyTorch layer", None), ("fused path, Triton kernels", TritonFusedOps())):
        counts, layers = count_decode_step(llm, ops)
        per_layer = sum(counts.values()) / layers
        detail = ", ".join(f"{name} {n / layers:g}" for name, n in counts.most_common())
        rows.append((label, per_layer))
        print(f"{label:<28} {per_layer:5.1f} launches per layer ({detail})")
    print(f"ratio {rows[0][1] / rows[1][1]:.2f} (plain / fused)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the kernels run in the interpreter
    sys.exit(main())
