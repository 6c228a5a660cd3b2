"""The core every chapter stands on: the lab GPT, its data, devices and process groups, argument checks.

* :mod:`labkit.core.model`: the GPT every lab trains (no distributed code in it).
* :mod:`labkit.core.data`: byte-level batches that are a pure function of seed and step.
* :mod:`labkit.core.text`: a second corpus (torch.nn's Python source) and samples from the GPT.
* :mod:`labkit.core.devices`: which device a rank uses and which backend its collectives take.
* :mod:`labkit.core.checks`: one wording for every bad argument.
"""
