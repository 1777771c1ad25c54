"""kvpilot.engine.model — the model: where its files come from and how it runs.

Package map:

Files (torch-free, except ``tiny``):
- ``registry``       model spec (``smollm2-135m``, ``tiny-random``, a ``.gguf`` path, an HF directory) →
                     local HF-format directory, converted/written once into the cache; ``model_fingerprint``
                     (the root of the prefix-cache block hash)
- ``gguf_convert``   GGUF (llama, qwen2/3, qwen2/3 MoE, phi3, gemma2/3) → config.json + float32 safetensors +
                     generation_config.json (dequantize, rename, undo llama's Q/K RoPE row permutation)
- ``gguf_config``    config.json / generation_config.json from a GGUF's metadata, per architecture
- ``gguf_families``  the config keys of Phi-3 (LongRoPE factors, partial rotary) and Gemma 2/3 GGUFs
                     (layer pattern, attention scale, local RoPE), as llama.cpp reads them
- ``gguf_names``     llama.cpp tensor names → HF names per family (fused Phi-3 tensors, Gemma's ``+ 1`` norms,
                     stacked and shared experts), and the tensors each family's file must hold
- ``gguf_weights``   a GGUF's projection and embedding weights kept in their blocks (``quantization=gguf``)
- ``gguf_tokenizer`` tokenizer.json / tokenizer_config.json from GGUF metadata: byte-level BPE (also for
                     ``tiny``), or SentencePiece through ``gguf_spm``
- ``gguf_spm``       SentencePiece BPE vocabularies (Gemma, Phi-3) as ``tokenizers`` BPE with byte fallback,
                     merges ranked by piece score, llama.cpp's space prefix
- ``tiny``           ``write_tiny_llama``: seeded random tiny Llama/Qwen2/Mistral + tokenizer for fast tests;
                     ``write_tiny_tokenizer`` for tiny models of the other families

Forward pass:
- ``arch``           ``ModelArchConfig``: the hyper-parameters the forward pass reads from config.json
- ``families``       what each dense family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) switches on in the
                     shared decoder: layer windows, q/k norm, Gemma norms, soft-caps, activation
- ``rope_config``    RoPE theta and scaling from either config form (``rope_scaling`` / ``rope_parameters``),
                     per layer type where the config nests them (Gemma 3)
- ``rope``           rotary position embedding tables (default, linear, dynamic NTK, Llama 3, YaRN, LongRoPE)
- ``layers``         the decoder layer (RMSNorm, GQA attention with optional q/k norm through the attention
                     backend, SwiGLU/GeGLU MLP, Gemma's sandwich norms), PyTorch and fused paths
- ``fused_triton``   ``TritonFusedOps``: the fused path's add + RMSNorm, in-place RoPE and gated activation
                     as Triton kernels (CUDA; the interpreter in tests)
- ``llama``          the model: embedding, per-layer-type rotary tables, the layers, final norm, LM head
- ``native_decode``  ``NativeDecodeStep``: a decode-only step's layers in one C call (the fused-C path's
                     kernels in its order, bound once), for dense llama-shaped models on native projections
- ``weights``        HF checkpoint tensors into the model (q/k/v and gate/up fused, or already fused: Phi-3)
- ``moe_arch``       ``MoEArch``: experts, top-k, renormalisation and sparse layers of Mixtral / Qwen2-MoE /
                     Qwen3-MoE configs, and the dense family each one's attention reads as
- ``moe_experts``    routing (softmax, top-k, renormalise) and the routed experts in PyTorch: the dense
                     reference, and the sorted CPU path (one GEMM pair per non-empty expert)
- ``moe``            ``SparseMoeBlock``: router + stacked experts (+ Qwen2-MoE's shared expert) replacing a
                     sparse layer's MLP; expert weights from either checkpoint naming
- ``moe_quant``      ``QuantExperts``: a GGUF's routed experts kept in their blocks (``quantization=gguf``),
                     the sorted path with each expert's GEMMs on ``QuantLinear``
- ``fused_moe_triton`` the fused-MoE Triton kernel (tokens sorted and padded by expert, grouped GEMMs),
                     used beside the Triton attention backend; imported only once ``TRITON_INTERPRET`` is set
- ``cpu_linear``     oneDNN-packed linear layers for float32 on CPU (the short, wide GEMMs of decoding)
- ``quant_formats``  ``QuantWeight`` (GGUF blocks or int8 rows, as the kernels read them): unpacking,
                     dequantization (K-quants in torch ops on any device), int8 quantization, fusing rows
- ``quant_linear``   ``QuantLinear`` / ``QuantEmbedding``: layers on quantized weights (the Triton GEMM with
                     ``linear_backend='triton'``, the CUDA default; else C kernels, sliced
                     dequantize-and-GEMM for long prefills, PyTorch ops without the native kernels)
- ``quant_triton``   the Triton W4A16/W6A16/W8A16 GEMM on the same bytes (Q4_0/Q4_1/Q8_0, Q4_K/Q6_K, int8)
                     that ``QuantLinear`` runs on CUDA; imported at its first call, once
                     ``TRITON_INTERPRET`` is set
- ``fp8_linear``     ``Fp8Weight`` (e4m3 + per-row/block scales), fp8 quantization and dequantization,
                     ``Fp8Linear`` (W8A16: e4m3 kept; the Triton GEMM, or dequantized per call)
- ``fp8_triton``     the Triton W8A16 GEMM on e4m3 bytes (decoded in registers, per-row/block scales) that
                     ``Fp8Linear`` runs with ``linear_backend='triton'``; imported at its first call
- ``fp8_checkpoint`` HF checkpoints' ``quantization_config``: fp8 (vLLM ``fp8``, compressed-tensors float8)
                     read dequantized or into ``Fp8Linear``; AWQ/GPTQ/int4 refused by name
- ``quantization``   the ``quantization`` engine argument resolved (auto/none/gguf/int8/fp8) and applied
                     to the model; weight bytes
- ``loader``         builds the model on its device from a resolved directory

The tokenizer and chat template live one level up, in ``kvpilot.engine.tokenizer`` (the router shares it).
"""
