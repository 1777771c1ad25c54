"""kvpilot.engine.kv — the paged KV cache (docs/architecture.md#kv-lifecycle).

Package map:
- ``block_hash``  the prefix-cache hash chain of full blocks, salted per tenant (torch-free: the router
                  imports it)
- ``block_pool``  physical blocks: reference counts, the LRU free queue, the hash → cached-block map
- ``events``      the ordered, epoch-stamped log of cache changes behind ``/kv/events``
- ``kv_cache``    the preallocated per-layer K/V tensors and the host swap space
- ``kv_quant``    what ``kv_cache_dtype`` fp8/int8 stores (codes, scales) and the PyTorch reference of
                  its quantization
- ``checkpoint_scales`` a checkpoint's per-layer fp8 ``k_scale``/``v_scale``
- ``capacity``    KV arithmetic: bytes per token, blocks per budget, internal fragmentation
- ``manager``     ``KVCacheManager``: per-request block tables, prefix lookup, copy-on-write, admission
                  reservations, swap
- ``sequence_blocks`` ``SequenceBlocks``, the manager's one record per sequence, and the invariant checks
                  over all records
- ``block_table`` the block tables as one persistent int32 tensor, a row per slot, written as they change
"""
