"""The parallel techniques, each on its own, applied to the plain GPT from outside, and the one
function that composes them.

* :mod:`labkit.parallel.layout`: what a layout is: six degrees with torchtitan's meanings
  (:mod:`~labkit.parallel.layout.degrees`), the one device mesh and its process groups
  (:mod:`~labkit.parallel.layout.mesh`, :mod:`~labkit.parallel.layout.mesh_nodes`), what a layout
  cannot do with a model (:mod:`~labkit.parallel.layout.checks`) and what a rank holds under it
  (:mod:`~labkit.parallel.layout.sizes`).
* :mod:`labkit.parallel.compose`: places the GPT on the mesh, every technique in one order;
  :mod:`labkit.parallel.placed`, what one rank then trains.
* :mod:`labkit.parallel.data_parallel`: torch DDP, and data parallelism by hand (naive, bucketed).
* :mod:`labkit.parallel.fsdp`: FSDP2's ``fully_shard`` per block (ZeRO-3).
* :mod:`labkit.parallel.deepspeed_zero`: DeepSpeed ZeRO stages 1-3.
* :mod:`labkit.parallel.zero_scratch`: ZeRO-1 by hand.
* :mod:`labkit.parallel.tensor_parallel`: Megatron-LM's split, with DTensor and by hand.
* :mod:`labkit.parallel.pipeline`: the stages, torch pipelining and by hand
  (:mod:`~labkit.parallel.pipeline.stages`, :mod:`~labkit.parallel.pipeline.split`,
  :mod:`~labkit.parallel.pipeline.runner`), and :mod:`~labkit.parallel.pipeline.timeline`, the bubble
  and the activations in flight.
* :mod:`labkit.parallel.context`: ring attention (:mod:`~labkit.parallel.context.ring`), the zig-zag
  split (:mod:`~labkit.parallel.context.layout`), the online softmax they share with FlashAttention,
  all-to-all sequence parallelism (:mod:`~labkit.parallel.context.ulysses`), and
  :mod:`~labkit.parallel.context.torch_cp`, which holds them against PyTorch's API.
* :mod:`labkit.parallel.experts`: a mixture of experts' experts over ranks by all-to-all
  (:mod:`~labkit.parallel.experts.placement`), and across nodes, each token once per node
  (:mod:`~labkit.parallel.experts.nodes`).
* :mod:`labkit.parallel.clipping`: gradient clipping over parameters split across ranks.
* :mod:`labkit.parallel.activation_checkpointing`: recomputation policies.
* :mod:`labkit.parallel.loss_scaling`: fp16's dynamic loss scale.

How each becomes a strategy of the training loop is :mod:`labkit.train.strategies`.
"""
