"""The core every chapter stands on: the lab GPT, its data, devices and process groups, argument checks.

* :mod:`labkit.core.model`: the GPT every lab trains (no distributed code in it); its mixture of experts
  in :mod:`labkit.core.moe`, with :mod:`labkit.core.moe_grouped` (dropless grouped GEMMs) and
  :mod:`labkit.core.moe_routing` (DeepSeek-V3's balancing bias and node-limited routing).
* :mod:`labkit.core.data`: byte-level batches that are a pure function of seed and step.
* :mod:`labkit.core.text`: a second corpus (torch.nn's Python source) and samples from the GPT.
* :mod:`labkit.core.devices`: which device a rank uses and which backend its collectives take.
* :mod:`labkit.core.checks`: one wording for every bad argument.
"""
