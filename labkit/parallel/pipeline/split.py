"""How a pipeline cuts the model into stages, and what it cannot do: before any rank starts.

The schedules ``torch.distributed.pipelining`` runs (GPipe; 1F1B; the interleaved ones with any
number of stages a rank; the V-shaped zero-bubble ones with two), where each rank's stages are
(:class:`Split`), which layers each stage holds (:func:`stage_bounds`, torchtitan's uneven split),
and the one-line errors for a pipeline that cannot be built (:func:`check_pp`).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.checks import one_of, positive_int

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
IMPLS = ("torch", "scratch")
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb": 2, "zbv": 2, "dualpipev": 2}  # layer chunks per rank
# Zero-bubble schedules split a backward into its input gradient (B, on the critical path) and its
# weight gradient (W, deferred into what would be bubble): Qi et al. 2023, "Zero Bubble Pipeline
# Parallelism" (ZB-H1 interleaved; ZB-V), and DeepSeek-V3's DualPipe in its V-shaped form. The
# V-shaped ones place rank r's two chunks at stages r and 2 pp - 1 - r, so that the first and last
# stages share rank 0.
V_SHAPED = ("zbv", "dualpipev")
ZERO_BUBBLE = ("zb", "zbv", "dualpipev")


@dataclass(frozen=True)
class Split:
    """How a pipeline cuts the model into stages. ``stages_per_rank``: chunks a rank holds under the
    interleaved schedules (``interleaved``, ``zb``: any number from 2; 0 is the schedule's own,
    :data:`VIRTUAL`); 1F1B and GPipe hold one, the V-shaped ones exactly two. ``first_less`` and
    ``last_less``: layers fewer on the first and the last stage, which hold the embedding and the
    output layer (torchtitan's ``pipeline_parallel_first_stage_less_layers`` and
    ``..._last_stage_less_layers``; Llama 3 took one from each, Dubey et al. 2024 section 3.3.2)."""

    schedule: str = "1f1b"
    stages_per_rank: int = 0
    first_less: int = 0
    last_less: int = 0

    @property
    def v(self) -> int:
        return self.stages_per_rank if self.stages_per_rank and self.schedule in MULTI else VIRTUAL[self.schedule]

    def n_stages(self, pp: int) -> int:
        return pp * self.v

    def indices(self, rank: int, pp: int) -> list[int]:
        """The stages rank ``rank`` of ``pp`` holds: one; ``v`` interleaved (r, r + pp, ...); or two in
        a V (r and 2 pp - 1 - r)."""
        if self.schedule in V_SHAPED:
            return [rank, 2 * pp - 1 - rank]
        return [rank + k * pp for k in range(self.v)]

    def bounds(self, n_layer: int, pp: int) -> list[tuple[int, int]]:
        return stage_bounds(n_layer, self.n_stages(pp), self.first_less, self.last_less)


MULTI = ("interleaved", "zb")  # the schedules that take any number of stages per rank


def stage_indices(rank: int, pp: int, schedule: str) -> list[int]:
    """The pipeline stages rank ``rank`` of ``pp`` holds under ``schedule``'s own split (:class:`Split`)."""
    return Split(schedule).indices(rank, pp)


def check_pp(pp: int, n_layer: int, microbatches: int, schedule: str, batch_size: int | None = None,
             impl: str = "torch", split: Split | None = None) -> None:
    """Clear errors for a pipeline that cannot be built; call before any communication. ``split``: the
    stages per rank and the first and last stage's layers (:class:`Split`; default the schedule's own)."""
    one_of("pp_schedule", schedule, PP_SCHEDULES, "pipeline schedules")
    one_of("impl", impl, IMPLS, "implementations")
    if impl == "scratch" and schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"pp_schedule={schedule!r} needs torch pipelining (strategy 'pp'); the hand-written "
                         "pipeline (strategy 'pp_scratch') has 'gpipe' and '1f1b'")
    positive_int("pp", pp)
    positive_int("microbatches", microbatches)
    split = split or Split(schedule)
    if split.stages_per_rank and schedule not in MULTI:
        raise ValueError(f"pp_stages_per_rank={split.stages_per_rank} applies to the schedules that hold any number "
                         f"of stages a rank ({', '.join(MULTI)}); pp_schedule={schedule!r} holds {VIRTUAL[schedule]}")
    if split.stages_per_rank and split.stages_per_rank < 2:
        raise ValueError(f"pp_stages_per_rank={split.stages_per_rank} must be at least 2 (or 0: the schedule's "
                         f"own {VIRTUAL[schedule]})")
    for name, value in (("pp_first_stage_less_layers", split.first_less), ("pp_last_stage_less_layers", split.last_less)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be a whole number of layers, 0 or more")
    stages = split.n_stages(pp)
    if stages > n_layer + split.first_less + split.last_less:
        raise ValueError(f"pp={pp} with pp_schedule={schedule!r} needs {stages} stages but the model has "
                         f"n_layer={n_layer} layers; use pp <= {n_layer // split.v} or more layers")
    split.bounds(n_layer, pp)  # the first and last stage can give up that many layers
    # torch's own rules, checked when it builds the schedule (after the ranks have started): 1F1B needs
    # microbatches >= stages; DualPipeV, whose V holds 2 pp stages, as many microbatches as stages
    # (ZB-V pads fewer itself; the interleaved ones need whole rounds, below). The others here need
    # microbatches >= pp too, or a stage has nothing to alternate.
    if schedule == "dualpipev" and microbatches < stages:
        raise ValueError(f"pp_schedule='dualpipev' needs at least as many microbatches as stages: --microbatches "
                         f"{microbatches} < {stages} (2 x pp={pp}); use --microbatches {stages} or more")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"pp_schedule={schedule!r} needs microbatches >= pp: microbatches={microbatches} < "
                         f"pp={pp} leaves a stage with nothing to alternate; use microbatches >= {pp} or 'gpipe'")
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved", "zb") and microbatches % rounds:
        # torch's ScheduleInterleaved1F1B runs the microbatches in rounds of about pp each
        valid = [m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0]
        raise ValueError(f"pp_schedule={schedule!r} needs microbatches divisible by its {rounds} rounds "
                         f"(microbatches // pp); microbatches={microbatches} with pp={pp} is not; valid "
                         f"microbatches up to {4 * pp}: {valid}")
    if batch_size is not None and batch_size % microbatches:
        valid = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"microbatches={microbatches} must divide batch_size={batch_size}; valid: {valid}")


def stage_bounds(n_layer: int, n_stages: int, first_less: int = 0, last_less: int = 0) -> list[tuple[int, int]]:
    """``[lo, hi)`` layers of each stage, split as torchtitan splits them: the embedding counts as
    ``first_less`` layers and the output layer as ``last_less``, the total shared as evenly as
    possible, earlier stages taking the remainder (``_generate_llm_fqn_per_model_part``). A stage may
    be left with the embedding or the output layer alone."""
    if n_stages == 1:
        return [(0, n_layer)]
    units = n_layer + first_less + last_less
    if n_stages > units:
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} layers; the model has n_layer={n_layer}"
                         + (f" (+{first_less + last_less} for the embedding and the output layer)" if units > n_layer
                            else ""))
    base, extra = divmod(units, n_stages)
    sizes = [base + (i < extra) for i in range(n_stages)]
    if first_less > sizes[0] or last_less > sizes[-1]:
        raise ValueError(f"pp_first_stage_less_layers={first_less} and pp_last_stage_less_layers={last_less} must "
                         f"be at most the {base} layers of a stage")
    sizes[0] -= first_less
    sizes[-1] -= last_less
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [(a, a + n) for a, n in zip(starts, sizes)]
