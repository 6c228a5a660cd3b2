"""Where the memory goes: the calculator, and measurements that hold it to account.

* :mod:`labkit.memory.calculator`: model states under ZeRO 0-3 and activations per layer
  (Rajbhandari et al. 2020; Korthikanti et al. 2022), per device, for any model shape.
* :mod:`labkit.memory.architecture` and :mod:`labkit.memory.hf_config`: any transformer's shape (a
  preset, a Hugging Face ``config.json``, or its dimensions), its parameters counted exactly.
* :mod:`labkit.memory.finetune`: full, LoRA and QLoRA fine-tuning's bytes per device by kind;
  :mod:`labkit.memory.lora` and :mod:`labkit.memory.qlora`, the adapters themselves, from scratch
  and with ``peft``, on a frozen base in 16 bits or 4-bit NF4.
* :mod:`labkit.memory.zero_crosscheck`: the ZeRO formula against DeepSpeed's own estimators.
* :mod:`labkit.memory.probe`: what a live model, optimizer and forward pass really hold;
  :mod:`labkit.memory.finetune_probe`, the same by kind for full, LoRA and QLoRA fine-tuning;
  :mod:`labkit.memory.finetune_runs`, the fine-tuning lab's runs side by side and the calculator
  held against them.
* :mod:`labkit.memory.deepspeed_states`: DeepSpeed's ZeRO model states, to the byte.
* :mod:`labkit.memory.recompute`: what activation checkpointing saves and costs, measured.

``python -m labkit.planning memory`` prints the per-device bytes of a configuration in a terminal
(:mod:`labkit.planning.memory_cli`). The calculator's names are importable from here.
"""
from labkit.memory.calculator import (
                                      BYTES_PER_PARAM,
                                      GB,
                                      MODELS,
                                      RECOMPUTE,
                                      STAGES,
                                      MemoryEstimate,
                                      ModelShape,
                                      ModelStates,
                                      activation_bytes_per_layer,
                                      autocast_extra_bytes_per_layer,
                                      estimate_memory,
                                      model_shape,
                                      model_state_breakdown,
                                      zero_model_state_bytes,
)
from labkit.memory.finetune import FINETUNE, FinetuneEstimate, estimate_finetune, lora_params
from labkit.memory.zero_crosscheck import cross_check_zero

__all__ = ["FINETUNE", "FinetuneEstimate", "estimate_finetune", "lora_params", "cross_check_zero", "BYTES_PER_PARAM", "GB", "MODELS", "RECOMPUTE", "STAGES", "MemoryEstimate", "ModelShape", "ModelStates",
           "activation_bytes_per_layer", "autocast_extra_bytes_per_layer", "estimate_memory", "model_shape",
           "model_state_breakdown", "zero_model_state_bytes"]
