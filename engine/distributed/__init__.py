"""kvpilot.engine.distributed — tensor parallelism across the GPUs of one node (torch.distributed: NCCL
on CUDA, gloo on CPU; docs/architecture.md#tensor-parallelism).

Package map:
- ``groups``       the control (gloo) and model (NCCL/gloo) process groups of one engine, with timeouts
- ``sharding``     which heads, MLP columns and vocabulary rows a rank holds; the checkpoint sliced to them;
                   the checks that a model splits over ``tensor_parallel_size`` ranks
- ``layers``       row-parallel all-reduce, vocab-parallel embedding, the logits gather to rank 0
- ``quant_shards`` a rank's rows and block columns of GGUF blocks kept as stored
- ``step_message`` one step's flat inputs and KV block operations as rank 0 broadcasts them
- ``kv_replica``   every rank's KV cache under rank 0's blocks: recorded copies and swaps, replayed
- ``worker``       ranks 1..tp-1: a process that loads its shard and runs the steps rank 0 sends
- ``executor``     rank 0: starts and watches the workers, shuts them down, drives each step
"""
