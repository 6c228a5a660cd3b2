"""The parallel techniques, each on its own, applied to the plain GPT from outside.

* :mod:`labkit.parallel.data_parallel`: torch DDP, and data parallelism by hand (naive, bucketed).
* :mod:`labkit.parallel.fsdp`: FSDP2's ``fully_shard`` per block (ZeRO-3).
* :mod:`labkit.parallel.deepspeed_zero`: DeepSpeed ZeRO stages 1-3.
* :mod:`labkit.parallel.zero_scratch`: ZeRO-1 by hand.
* :mod:`labkit.parallel.tensor_parallel`: Megatron-LM's split, with DTensor and by hand.
* :mod:`labkit.parallel.pipeline_parallel`: pipeline stages, torch pipelining and by hand;
  :mod:`labkit.parallel.pipeline_timeline`, the bubble and activations in flight.
* :mod:`labkit.parallel.clipping`: gradient clipping over parameters split across ranks.
* :mod:`labkit.parallel.activation_checkpointing`: recomputation policies.
* :mod:`labkit.parallel.context_parallel` (ring attention), :mod:`labkit.parallel.ulysses` (all-to-all
  sequence parallelism), :mod:`labkit.parallel.cp_layout` (the zig-zag split):
  :mod:`labkit.parallel.context_parallel_torch` holds them against PyTorch's API on GPUs.
* :mod:`labkit.parallel.expert_parallel`: a mixture of experts' experts over ranks, all-to-all;
  :mod:`labkit.parallel.expert_nodes`, the experts across nodes: two hops, each token once per node.

How each becomes a strategy of the training loop is :mod:`labkit.train.strategies`.
"""
