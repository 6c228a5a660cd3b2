"""Planning a run: which layout fits and runs fastest, what it costs, and how to start it.

One model prices every choice: :mod:`~labkit.planning.step_model` (a step, term by term) and
:mod:`~labkit.planning.stage_memory` (every pipeline rank's bytes), both held against published runs.

* :mod:`labkit.planning.search`: every layout that fits a global batch, ranked (``python -m labkit.planning layouts``).
* :mod:`labkit.planning.choose`: the same search for a micro-batch per device, and the rule of thumb.
* :mod:`labkit.planning.plan`: one layout and how it runs; :mod:`labkit.planning.commands` the
  ``labkit.train`` flags and the torchrun or sbatch line that run it.
* :mod:`labkit.planning.pipeline_model`: stages, schedules, what each rank keeps in flight, the bubble.
* :mod:`labkit.planning.collectives` and :mod:`labkit.planning.hardware`: links, latencies, rates.
* :mod:`labkit.planning.published`: the published runs the models are held against.
* :mod:`labkit.planning.bounds`: when each parallelism is communication-bound, in closed form.
* :mod:`labkit.planning.layouts`: every DP x TP x PP layout with its memory, bubble and step.
* :mod:`labkit.planning.cost`: FLOPs, hours, dollars, preemptions and Young/Daly checkpoint intervals.
* :mod:`labkit.planning.accelerators`: the devices the tools know, with datasheet peaks and prices.
* :mod:`labkit.planning.finetune_choice`: API, LoRA/QLoRA or full training, answered and priced.
* :mod:`labkit.planning.batch`: the gradient noise scale and the critical batch (McCandlish et al.).
* :mod:`labkit.planning.memory_cli` and :mod:`labkit.planning.layouts_cli`: ``python -m labkit.planning memory``
  and ``python -m labkit.planning layouts``, the two subcommands of the planner's command line.
"""
