"""Mixed precision: autocast per stage, and a loss scaler whose overflow check every rank agrees on.

Under precision="bf16" or "fp16", each stage's forward and the loss run in torch.autocast,
and floating tensors cross stage boundaries in that dtype (cast inside the graph, so the
gradient flows back through the cast): what crosses is known before the first send, and
half as large. fp16 also scales the loss; as torch.amp.GradScaler, but a step with an
inf/nan gradient on any rank is skipped on every rank::

    loss = engine.train_step(x, y)     # the last stage backpropagates loss * scale
    engine.scaler.unscale_()           # optional, e.g. before engine.clip_grad_norm_
    engine.scaler.step(optimizer)      # unscales if needed; skipped everywhere on overflow
    engine.scaler.update()             # halve the scale after an overflow, grow it after a run of good steps
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pipeengine.core.dtensors import local

__all__ = ["GradScaler"]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[object]:
    """torch.autocast for a stage in mixed precision (a stage in full precision enters nothing). On the meta device
    (a dry run), which autocast does not know, the CPU's, which leaves meta tensors uncast: a stage computes in
    float32 there (a dry run checks shapes), and its boundaries cross in the autocast dtype as on the device."""
    return torch.autocast("cpu" if device.type == "meta" else device.type, dtype=dtype)


class GradScaler:
    """Loss scaling for a pipeline (enabled under fp16; otherwise step() is optimizer.step())."""

    def __init__(
        self,
        parameters: Callable[[], Iterator[nn.Parameter]],
        enabled: bool,
        device: torch.device,
        agree: Callable[[torch.Tensor], None],
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self._parameters = parameters
        self._agree = agree  # in place: the maximum over every rank of the world
        self.enabled = enabled
        self.device = device
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._good_steps = 0
        self._found_inf: bool | None = None  # None: not unscaled this step
        self._stepped = False  # step() was called since the last update()

    def unscale_(self) -> bool:
        """Divide this rank's gradients by the scale; return whether any rank of the world saw inf/nan."""
        if not self.enabled or self._found_inf is not None:
            return bool(self._found_inf)
        inverse = 1.0 / self.scale
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        for param in self._parameters():
            if param.grad is not None:  # a DTensor's shard (tensor parallel, FSDP): each rank checks its own part
                grad = local(param.grad)
                grad.mul_(inverse)
                found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
        self._agree(found)  # every pipeline, every replica: all skip or none
        self._found_inf = bool(found.item())
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (once), then step the optimizer unless some gradient overflowed; True if it stepped. Once per
        update(), as torch.amp.GradScaler: a second step would take gradients the next train_step scaled again."""
        if self._stepped:
            raise RuntimeError(
                "engine.scaler.step() has already been called since the last update(): call engine.scaler.update() "
                "after each step (it also lets the next step unscale its own gradients)"
            )
        self._stepped = True
        if self.unscale_():
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow; grow after growth_interval good steps in a row."""
        if self.enabled:
            if self._found_inf:
                self.scale *= self.backoff_factor
                self._good_steps = 0
            else:
                self._good_steps += 1
                if self._good_steps == self.growth_interval:
                    self.scale *= self.growth_factor
                    self._good_steps = 0
        self._found_inf = None
        self._stepped = False

    def state_dict(self) -> dict[str, float | int]:
        """The scale and the good steps toward its growth, as torch.amp.GradScaler's (a checkpoint's extra)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._good_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if not self.enabled:  # no scaling here (not fp16): nothing to restore, as torch.amp.GradScaler
            return
        self.scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval, self._good_steps = int(state["growth_interval"]), int(state["_growth_tracker"])
