"""The course around the labs: what an instructor and a GPU node need, apart from the lab runner
(:mod:`labkit.labs`), which it uses.

* The JupyterHub: :mod:`~labkit.course.hub` (``python -m labkit.course.hub``), its spawner, homes,
  limits and state (``hub_*``).
* nbgrader: :mod:`~labkit.course.assignments` (assignments from the labs' exercise cells),
  :mod:`~labkit.course.student_labs`, :mod:`~labkit.course.submit`, :mod:`~labkit.course.collect`,
  :mod:`~labkit.course.feedback`, and the autograder's :mod:`~labkit.course.grading`,
  :mod:`~labkit.course.grading_config` and :mod:`~labkit.course.sandbox`.
* The GPU node check: :mod:`~labkit.course.gpu_check` (``make gpu-check``) and its items, budget and
  lab runs (``gpu_*``).
"""
