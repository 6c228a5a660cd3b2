"""Training: one loop for every strategy, the strategy registry, and the command line.

* :mod:`labkit.train.config`: :class:`TrainConfig`, a run described field by field.
* :mod:`labkit.train.strategies`: every strategy as one record (what it shards, its ZeRO stage,
  its communication per step, the options it takes, what it cannot do), a name that expands to one
  :class:`~labkit.parallel.layout.parallelism.Parallelism` (:func:`~labkit.train.strategies.expand`).
* :mod:`labkit.train.validate`: the one place a run is checked; it returns that parallelism resolved.
* :mod:`labkit.train.setup`, :mod:`labkit.train.deepspeed_setup`: how a strategy places the model
  (:func:`labkit.parallel.compose.place`), its optimizer and loss scaler.
* :mod:`labkit.train.loop`: :func:`train`, the loop, and :func:`~labkit.train.loop.train_step`, the
  step; :mod:`labkit.train.probe` and :mod:`labkit.train.figures`, what it measures;
  :mod:`labkit.train.result`, what it returns (:class:`TrainResult`);
  :mod:`labkit.train.resumable`, its checkpoints.
* :mod:`labkit.train.lr_schedule`: warmup and cosine decay.
* :mod:`labkit.train.noise_scale`: the gradient noise scale measured while the GPT trains;
  :mod:`labkit.train.batch_sweeps`, gradient accumulation and learning rate against the batch.
* :mod:`labkit.train.cli`: ``python -m labkit.train``.
"""
from labkit.train.config import TrainConfig
from labkit.train.loop import train, train_many
from labkit.train.result import RankFigures, TrainResult
from labkit.train.strategies import STRATEGIES, Strategy, strategy

__all__ = ["STRATEGIES", "RankFigures", "Strategy", "TrainConfig", "TrainResult", "main", "strategy", "train",
           "train_many"]


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.train`` (:func:`labkit.train.cli.main`)."""
    from labkit.train.cli import main as cli_main

    return cli_main(argv)
