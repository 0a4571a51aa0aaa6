"""Pipeline schedules in pure Python: compile, lower, validate, simulate. Never imports torch."""

from schedules.controllable import v_half, v_min
from schedules.dataflow import Dataflow, Message, peer
from schedules.gpipe import gpipe
from schedules.inference import forward_only
from schedules.instructions import Action, Batch, Instruction, Kind, Post, ops_of, parse
from schedules.interleaved import interleaved_1f1b
from schedules.lowering import lower, lowered, receives_first
from schedules.memory import Memory, state_bytes
from schedules.one_f_one_b import one_f_one_b
from schedules.registry import SCHEDULES, Registration, build_schedule, compile_schedule, register, registration
from schedules.schedule import Schedule, ScheduleError
from schedules.simulation import Costs, replay, simulate
from schedules.sync import tie_ranks, with_gradient_sync, with_tie_sync
from schedules.timeline import Span, Timeline
from schedules.validation import Semantics, validate
from schedules.zero_bubble import zb_h1, zb_v

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
