"""The ledger: memory measured as the simulator's model counts it (schedules.sim.memory_model), by tensor storage.

A Ledger sees what autograd saves for backward (saved-tensor hooks, on CPU and CUDA) and is
shown what the engine itself holds: the inputs and outputs a stage keeps for its backward,
received buffers, gradients waiting to be sent or taken, what a split backward keeps for W.
Each storage counts once and parameters never (they are the step-long state). StageSizes is
what one stage holds per micro-batch, as measured (pipeengine.train.tracing) or profiled
(pipeengine.construction.measure) under a ledger.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.core.dtensors import local

__all__: list[str] = []


def storage(tensor: torch.Tensor) -> tuple[int, int]:
    """A tensor's storage: (its address, its bytes); what the ledger counts once (a DTensor's: its shard's). On the
    meta device, where every storage's data is at 0, the address of the storage itself (a dry run's measure)."""
    storage = local(tensor, wait=False).untyped_storage()  # sampling must not wait: the step runs as untraced
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr(), storage.nbytes()


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass(slots=True)
class Saved:
    """A storage autograd saved: its bytes, and how many saved tensors hold it now."""

    bytes: int
    holders: int = 0


class Ledger:
    """The bytes alive of the tensors autograd saved (while a step runs under watching()) and of those shown."""

    def __init__(
        self, ignore: Iterable[torch.Tensor] = (), ignore_live: Callable[[], Iterable[torch.Tensor]] | None = None
    ) -> None:
        self.ignore = {storage(t)[0] for t in ignore if t.numel()}
        self.ignore_live = ignore_live  # tensors whose storage moves (FSDP's gathered parameters): looked up when saved
        self.saved: dict[int, Saved] = {}  # storage -> its bytes and the holders alive
        self.lock = threading.Lock()
        self._disabled: tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]] | None = None

    def _pack(self, tensor: torch.Tensor) -> object:
        if not tensor.numel():
            return tensor
        key, size = storage(tensor)
        if key in self.ignore or (
            self.ignore_live is not None and key in {storage(t)[0] for t in self.ignore_live() if t.numel()}
        ):
            return tensor
        with self.lock:
            entry = self.saved.setdefault(key, Saved(size))
            entry.holders += 1
        held = _Held(tensor.detach())  # the same storage without its grad_fn: a saved output would hold its
        weakref.finalize(held, self._release, key)  # own node, a cycle through autograd that is never freed
        return held

    def _release(self, key: int) -> None:
        with self.lock:
            entry = self.saved[key]
            entry.holders -= 1
            if not entry.holders:
                del self.saved[key]

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count what autograd saves in the block (hooks are per thread: the calling thread's computes)."""
        with torch.autograd.graph.saved_tensors_hooks(*self._hooks()):
            yield

    def _hooks(self) -> tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]]:
        """The hooks are autograd's to call inside a compiled region, not dynamo's to trace (it would compile them as
        the user's code, and recompile them for every shape, to its limit): disabled for dynamo once it is imported.
        Before, nothing can be compiled, and disabling them would import it (1.6 s on every ``import pipeengine``)."""
        if "torch._dynamo" not in sys.modules:
            return self._pack, self._unpack
        if self._disabled is None:
            self._disabled = torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack)
        return self._disabled

    def bytes(self, shown: Iterable[torch.Tensor]) -> int:
        """Bytes of every storage alive: saved by autograd, or among ``shown``; each storage once."""
        with self.lock:
            sizes = {key: entry.bytes for key, entry in self.saved.items()}
        for tensor in shown:
            if tensor.numel():
                key, size = storage(tensor)
                if key not in self.ignore:
                    sizes[key] = size
        return sum(sizes.values())

    def holds(self, key: int, shown: Iterable[torch.Tensor]) -> bool:
        """Whether a storage (its data_ptr) is alive as this ledger counts: saved by autograd, or among ``shown``."""
        with self.lock:
            if key in self.saved:
                return True
        return any(t.numel() and storage(t)[0] == key for t in shown)

    def ignoring(self, tensors: Iterable[torch.Tensor]) -> None:
        self.ignore |= {storage(t)[0] for t in tensors if t.numel()}


@dataclass(frozen=True)
class StageSizes:
    """What one stage holds per micro-batch (bytes), measured: the simulator's Memory, for one stage."""

    state: float
    activation: float
    after_input: float
    boundary: float
    gradient: float
    output_after_input: bool = True  # a split backward's I leaves the output held until W
    input_after_input: bool = True
    # as the allocator sees the computes (0 where it cannot be watched): the most each holds above its start level,
    # F, B, I, W (the gradients it makes for the parameters excluded: the state counts them)
    transients: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    first_transient: float = 0.0  # the same for the stage's first B (or W), which finds no gradient to add to
    sync: float = 0.0  # the flat buffers of the stage's gradient all-reduce, from the AR to the step's end
    grads_late: float = 0.0  # of the state, the gradients that were None when the step began (made by its first B/W)
    optimizer: float = 0.0  # the optimizer step's temporaries over the stage's parameters
    gathered: float = 0.0  # FSDP: the stage's parameters gathered whole (from its first F to its AR)
    gathered_grads: float = 0.0  # FSDP: its whole gradients (from its first B or W to its AR)
    reduce_held: float = 0.0  # FSDP: what its AR leaves held to the step's end (a unit's reduce-scatter input)
    reduce_transient: float = 0.0  # FSDP: the most its AR holds above its start
    gather_transient: float = 0.0  # FSDP: the most its first compute holds above the parameters it gathers


def optimizer_copies(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]) -> float:
    """How many copies of its parameters an optimizer keeps (AdamW: 2), from its state; 2 without one yet."""
    params = list(params)
    size = sum(local(p).numel() * p.element_size() for p in params)
    if optimizer is None or not size:
        return 2.0
    held = 0
    for param in params:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                held += local(value).numel() * value.element_size()
    return held / size if held else 2.0
