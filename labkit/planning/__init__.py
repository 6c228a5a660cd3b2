"""Planning a run: which strategy fits, how to lay out DP x TP x PP, what it costs.

* :mod:`labkit.planning.choose`: the cheapest configuration whose memory fits, and the rule of thumb.
* :mod:`labkit.planning.layouts`: every DP x TP x PP layout with its memory and bubble.
* :mod:`labkit.planning.cost`: FLOPs, hours, dollars, preemptions and Young/Daly checkpoint intervals.
* :mod:`labkit.planning.accelerators`: the devices the tools know, with datasheet peaks.
* :mod:`labkit.planning.finetune_choice`: API, LoRA/QLoRA or full training, answered and priced.
* :mod:`labkit.planning.batch`: the gradient noise scale and the critical batch (McCandlish et al.).
* :mod:`labkit.planning.cli`: ``python -m labkit.memory``.
"""
