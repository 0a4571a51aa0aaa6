"""The program cache: the streams a rank's transport runs, made and proved once per kind of step.

Programs.get(train, no_gradient)   the program of a training step whose ``no_gradient`` boundaries carry no
                                   gradient (inferred per batch), or of an eval step; validated under the
                                   transport's semantics before the first step that runs it
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeengine.comm.base import Transport
from schedules import Schedule, forward_only, lower, validate, with_gradient_sync, with_tie_sync

__all__ = ["Programs"]


@dataclass
class Programs:
    """The streams a rank's transport runs, made and validated once per kind of step."""

    schedule: Schedule  # lowered, without gradient sync
    transport: Transport
    sync: bool  # add the data-parallel gradient all-reduces
    _made: dict[tuple[bool, frozenset[int]], Schedule] = field(default_factory=dict)

    def get(self, train: bool, no_gradient: frozenset[int] = frozenset()) -> Schedule:
        """The program of a training step whose ``no_gradient`` boundaries need no gradient, or of an eval step."""
        key = (train, no_gradient if train else frozenset())
        program = self._made.get(key)
        if program is None:
            declared = sorted(self.schedule.no_gradient - no_gradient) if train else []
            if declared:  # the schedule says no gradient crosses where one must: a stage would silently not train
                b = declared[0]
                raise ValueError(
                    f"the schedule says boundary {b} (between stages {b} and {b + 1}) carries no gradient (its "
                    f"no_gradient, a 'no-gradient' line in a schedule file), but stage {b + 1}'s input needs one: "
                    f"stages up to {b} would never get a gradient. Remove boundary {b} from it, or freeze those stages "
                    "(requires_grad=False before building the engine): gradient-free boundaries are inferred"
                )
            if not train:
                base = forward_only(self.schedule)
            else:
                base = lower(self.schedule.without_gradient(no_gradient)) if no_gradient else self.schedule
                base = with_tie_sync(with_gradient_sync(base) if self.sync else base)
            program = self.transport.program(base)
            validate(program, self.transport.semantics)  # the streams that will run, under their transport's rules
            self._made[key] = program
        return program
