"""Which pp ranks a ``torch.distributed.pipelining`` schedule gives the first and the last stage.

Pure logic over a schedule object (its stage-to-rank mapping); no communication. The loader
routes ``inputs`` to the first stage and ``labels`` to the last by its ``stage_style``
(:data:`~collective_loader.plan.mesh.StageStyle`); :func:`check_schedule` refuses a schedule that
puts them elsewhere, which would train on labels that are missing or belong to no input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collective_loader.plan.mesh import Place, StageStyle, last_stage_rank

if TYPE_CHECKING:  # torch's pipelining costs most of a second to import: only when a schedule is read
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle


def stage_style_of(schedule: PipelineScheduleSingle | PipelineScheduleMulti) -> StageStyle:
    """The stage style of a pipeline schedule: ``"loop"`` when its last stage is on pp rank
    ``pp - 1`` (every single-stage schedule: GPipe, 1F1B; Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble), ``"v"`` when it is on pp rank 0 (ZBVZeroBubble, DualPipeV).

    Raises ``ValueError`` for a mapping that is neither (a custom one), ``TypeError`` for an
    object that is not a schedule.

    Example (every pp rank builds its own schedule; each says the same)::

        schedule = ScheduleZBVZeroBubble([stage_a, stage_b], n_microbatches=4, loss_fn=loss_fn)
        stage_style_of(schedule)  # "v": pass CollectiveLoader(..., stage_style="v", schedule=schedule)
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    if isinstance(schedule, PipelineScheduleSingle):
        return "loop"  # one stage per rank, stage i on pp rank i
    if not isinstance(schedule, PipelineScheduleMulti):
        raise TypeError(f"schedule must be a torch.distributed.pipelining schedule, got {type(schedule).__qualname__}")
    first, last = _ends(schedule)
    pp = schedule.pp_group_size
    if first == 0 and last == pp - 1:
        return "loop"
    if first == 0 and last == 0:
        return "v"
    raise ValueError(
        f"the schedule puts the first stage on pp rank {first} and the last on pp rank {last} of {pp}; "
        "CollectiveLoader routes by stage_style 'loop' (first on 0, last on pp - 1) or 'v' (both on 0)"
    )


def check_schedule(schedule: PipelineScheduleSingle | PipelineScheduleMulti, place: Place) -> None:
    """Raise ``ValueError`` naming ``stage_style`` unless ``schedule`` (this rank's) puts the first
    and the last stage where ``place`` says they are: on this rank exactly when the loader
    delivers it ``inputs`` (first stage) and ``labels`` (last stage)."""
    style = stage_style_of(schedule)
    if style != place.stage_style and place.pp_size > 1:
        raise ValueError(
            f"the pipeline schedule ({type(schedule).__name__}) places its stages in a {style!r} but the loader was "
            f"built with stage_style={place.stage_style!r}: pp rank {last_stage_rank(place.pp_size, style)} would "
            f"compute the loss without labels; pass stage_style={style!r}"
        )
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if isinstance(schedule, PipelineScheduleMulti):
        first, last = _ends(schedule)
        pp_rank = schedule.rank  # this rank's place in the schedule's pp group
        if schedule.pp_group_size != place.pp_size or pp_rank != place.pp_rank:
            raise ValueError(
                f"the pipeline schedule puts this rank at pp rank {pp_rank} of {schedule.pp_group_size}, the mesh at "
                f"pp rank {place.pp_rank} of {place.pp_size}: build the schedule's stages on the mesh's pp dim"
            )
        assert (first == pp_rank) == place.is_first_stage and (last == pp_rank) == place.is_last_stage


def _ends(schedule: PipelineScheduleMulti) -> tuple[int, int]:
    ranks = schedule.stage_index_to_group_rank
    return ranks[0], ranks[len(ranks) - 1]
