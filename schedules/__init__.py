"""Pipeline schedules in pure Python: compile, lower, validate, simulate. Never imports torch."""

# the layers, each importing only those above it: ir (the instruction set, a schedule, its dataflow) <- proof
# (validation, deadlock) <- sim (simulation, memory model, timelines, plots) <- passes (lowering, gradient
# sync, forward-only) <- compilers (one file per schedule family, and the registry) <- cli
from schedules.compilers.controllable import v_half, v_min
from schedules.compilers.gpipe import gpipe
from schedules.compilers.interleaved import interleaved_1f1b
from schedules.compilers.one_f_one_b import one_f_one_b
from schedules.compilers.registry import (
    SCHEDULES,
    Registration,
    build_schedule,
    compile_schedule,
    register,
    registration,
)
from schedules.compilers.zb_h1 import zb_h1
from schedules.compilers.zb_v import zb_v
from schedules.ir.dataflow import Dataflow, Message, peer
from schedules.ir.instructions import Action, Batch, Instruction, Kind, Post, ops_of, parse
from schedules.ir.schedule import Schedule, ScheduleError
from schedules.passes.inference import forward_only
from schedules.passes.lowering import lower, lowered, receives_first
from schedules.passes.sync import tie_ranks, with_gradient_sync, with_tie_sync
from schedules.proof.validation import Semantics, validate
from schedules.sim.memory_model import Memory, state_bytes
from schedules.sim.plot import plot_timelines
from schedules.sim.simulation import Costs, replay, simulate
from schedules.sim.timeline import Span, Timeline

__all__ = [
    "Action",
    "Batch",
    "Costs",
    "Dataflow",
    "Instruction",
    "Kind",
    "Memory",
    "Message",
    "Post",
    "Registration",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "Semantics",
    "Span",
    "Timeline",
    "build_schedule",
    "compile_schedule",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "lowered",
    "one_f_one_b",
    "ops_of",
    "parse",
    "peer",
    "plot_timelines",
    "receives_first",
    "register",
    "registration",
    "replay",
    "simulate",
    "state_bytes",
    "tie_ranks",
    "v_half",
    "v_min",
    "validate",
    "with_gradient_sync",
    "with_tie_sync",
    "zb_h1",
    "zb_v",
]
