"""The checkpointer's error, importable without DCP (the command line catches it before DCP loads)."""


class CheckpointError(RuntimeError):
    """A save failed (the previous checkpoint is intact), or a checkpoint is unusable."""
