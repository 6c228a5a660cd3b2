"""Pipeline parallelism: the GPT's layers in stages, the schedules that feed them, and their timeline."""
