"""Functions that run on every rank under pipeengine.launcher.launch; they assert, and launch re-raises."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.core.dtensors import whole
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch

RTOL, ATOL = 1e-5, 4e-5


def close(actual: torch.Tensor | float, expected: torch.Tensor | float, what: str) -> None:
    """Within the suite's float32 tolerance; a DTensor is compared whole (every rank of its mesh calls this)."""
    actual, expected = whole(torch.as_tensor(actual)).cpu(), whole(torch.as_tensor(expected)).cpu()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_grads(engine: PipelineEngine, reference: nn.Module, what: str) -> int:
    """Every local gradient equals the reference's under the same name, and every parameter of the reference is held
    by some rank (one missing everywhere would go unchecked); returns how many were checked here. Every rank calls
    it."""
    expected = dict(reference.named_parameters())
    held = {name for names in ranks.all_gather_object([n for n, _ in engine.named_parameters()]) for name in names}
    missing, unknown = sorted(set(expected) - held), sorted(held - set(expected))
    assert not missing and not unknown, f"{what}: held by no rank: {missing}, not the model's: {unknown}"
    count = 0
    for name, param in engine.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient on rank {ranks.rank()}"
        close(param.grad, expected[name].grad, f"{what}: grad of {name}")
        count += 1
    return count


def check_clipped(engine: PipelineEngine, reference: nn.Module, max_norm: float, what: str,
                  norm_type: float = 2.0) -> None:  # fmt: skip
    """clip_grad_norm_ across the engine's stages returns torch's total norm on the reference and clips alike."""
    total = engine.clip_grad_norm_(max_norm, norm_type=norm_type)
    close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type), f"{what}: norm")
    check_grads(engine, reference, f"{what}: clipped to {max_norm} ({norm_type}-norm)")


def check_eval(engine: PipelineEngine, reference: nn.Module, x: torch.Tensor, what: str) -> object:
    """eval_step's output on the last stage's rank equals the reference's forward; returns it (None elsewhere)."""
    out = engine.eval_step(x if engine.first else None)
    with torch.no_grad():
        expected = reference(x)
    if engine.last:
        close(out, expected, what)  # type: ignore[arg-type]
    return out


def parity(
    model_name: str,
    schedule: str,
    microbatches: list[int],
    sizes: list[int],
    steps: int = 3,
    chunks: int | None = None,
    device: str | None = None,
    checkpoint: str = "never",
) -> None:
    """Loss, gradients and parameters after several AdamW steps equal a single-process model.

    Batch sizes change from step to step; data is on every rank, but only the ends get it.
    """
    build, loss_fn = MODELS[model_name]
    for m in microbatches:
        model = build()
        reference = copy.deepcopy(model)
        engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule, chunks=chunks, device=device,
                                checkpoint=checkpoint)  # fmt: skip
        # eps=1e-6: the attention key bias has a mathematically zero gradient, i.e. ~1e-9 of rounding
        # noise that differs with summation order; AdamW's default eps=1e-8 would blow it up to ~lr
        # a rank may hold only parameter-free stages (e.g. 8 stages of an MLP with 5 Linear layers)
        local = list(engine.parameters())
        optimizer = torch.optim.AdamW(local, lr=1e-3, eps=1e-6) if local else None
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        checked = 0
        for step in range(steps):
            size = sizes[step % len(sizes)]
            x, y = batch(model_name, size, seed=step)
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
            expected = loss_fn(reference(x), y)
            expected.backward()
            what = f"{model_name} {schedule} m={m} step {step} batch {size}"
            close(loss, expected.item(), f"{what}: loss")
            checked += check_grads(engine, reference, what)
            step_both(optimizer, reference_optimizer)
        check_weights(engine, reference, f"{model_name} {schedule} m={m} after {steps} steps")
        assert checked > 0 or not any(True for _ in engine.parameters())


def parity_models(models: list[str], schedule: str, microbatches: list[int], sizes: list[int]) -> None:
    """parity() for each model and m, one optimizer step per batch size for the largest m; the others keep
    the first size (a new shape is inferred anew on the meta device, the costliest part of these tests)."""
    for model_name in models:
        for m in microbatches:
            steps = sizes if m == microbatches[-1] else sizes[:1] * len(sizes)
            parity(model_name, schedule, [m], steps, steps=len(steps))


def parity_schedules(model_name: str, schedules: list[str], microbatches: list[int], sizes: list[int]) -> None:
    for schedule in schedules:
        parity(model_name, schedule, microbatches, sizes, steps=2)


def step_both(optimizer: torch.optim.Optimizer | None, reference: torch.optim.Optimizer) -> None:
    """Step and zero the engine's optimizer (a rank may have no parameters) and the reference's."""
    for opt in (optimizer, reference):
        if opt is not None:
            opt.step()
            opt.zero_grad()


def parity_on(
    device: str, model_name: str, schedule: str, microbatches: list[int], sizes: list[int], chunks: int | None = None
) -> None:
    """parity() with the engine on ``device`` and the reference on the CPU."""
    parity(model_name, schedule, microbatches, sizes, chunks=chunks, device=device)


def parity_chunks(model_name: str, chunks: int, microbatches: list[int], sizes: list[int]) -> None:
    """Interleaved with several chunks per rank: on one rank, every boundary is a local handoff."""
    parity(model_name, "interleaved", microbatches, sizes, chunks=chunks)


def accumulate_and_eval(model_name: str, schedule: str, m: int) -> None:
    """Gradients accumulate over train_steps until zeroed; eval, train, eval leaves no stale state."""
    build, loss_fn = MODELS[model_name]
    model = build()
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule)
    x0, y0 = batch(model_name, 2 * m, seed=10)
    x1, y1 = batch(model_name, 4 * m, seed=11)

    out = check_eval(engine, reference, x0, "eval before training")
    if not engine.last:
        assert out is None

    for x, y in ((x0, y0), (x1, y1)):  # no zero_grad in between: gradients add up
        engine.train_step(x if engine.first else None, y if engine.last else None)
        loss_fn(reference(x), y).backward()
    check_grads(engine, reference, f"{model_name} {schedule} two accumulated steps")

    check_eval(engine, reference, x1, "eval after training")
    check_grads(engine, reference, "eval does not touch gradients")


def names_are_the_models(schedule: str) -> None:
    """named_parameters and state_dict use the nn.Sequential's own names, and together cover the model."""
    build, loss_fn = MODELS["transformer"]
    model = build()
    full = set(dict(model.named_parameters()))
    state_keys = set(model.state_dict())
    engine = PipelineEngine(model, loss_fn, num_microbatches=ranks.size() * 2, schedule=schedule)
    local = [name for name, _ in engine.named_parameters()]
    assert set(local) <= full and set(engine.state_dict()) <= state_keys
    gathered = ranks.all_gather_object(list(engine.state_dict()))
    assert sorted(k for keys in gathered for k in keys) == sorted(state_keys), "the ranks' state_dicts tile the model"


def report_world(path: str) -> None:
    """Write this rank's view of the world to a file per rank."""
    import torch.distributed as dist

    with open(f"{path}.{dist.get_rank()}", "w") as out:
        out.write(f"{dist.get_rank()} {dist.get_world_size()} {dist.get_backend()} {torch.get_num_threads()}")


def report_world_late(path: str) -> None:
    """report_world from a thread still running when this returns, then " atexit" from an atexit handler."""
    import atexit
    import threading
    import time

    import torch.distributed as dist

    name = f"{path}.{dist.get_rank()}"
    line = f"{dist.get_rank()} {dist.get_world_size()} {dist.get_backend()} {torch.get_num_threads()}"

    def late() -> None:
        time.sleep(0.3)
        with open(name, "w") as out:
            out.write(line)

    def at_exit() -> None:
        with open(name, "a") as out:
            out.write(" atexit")

    threading.Thread(target=late).start()  # not a daemon: the rank's exit waits for it, as Python's does
    atexit.register(at_exit)


def raise_on(rank: int) -> None:
    if ranks.rank() == rank:
        raise KeyError(f"raised on purpose by rank {rank}")
    ranks.barrier()


def partition_agreement() -> None:
    """Rank 0 alone has the sample: it measures, all agree; default 'time' with it, 'parameters' without."""
    build, loss_fn = MODELS["transformer"]
    x, y = batch("transformer", 8, seed=0)
    engine = PipelineEngine(build(), loss_fn, num_microbatches=4, sample=x if ranks.rank() == 0 else None)
    assert engine.partition.method == "time" and engine.partition.costs.time is not None
    everyone = ranks.all_gather_object((engine.partition.bounds, engine.partition.costs.time))
    assert all(view == everyone[0] for view in everyone), everyone
    engine.train_step(x if engine.first else None, y if engine.last else None)  # and it trains
    assert PipelineEngine(build(), loss_fn, num_microbatches=4).partition.method == "parameters"
    explicit = PipelineEngine(build(), loss_fn, num_microbatches=4, partition=[3, 2, 2, 2])
    assert explicit.partition.bounds == [(0, 3), (3, 5), (5, 7), (7, 9)]
    try:
        PipelineEngine(build(), loss_fn, num_microbatches=4, partition="time")  # no sample anywhere
    except ValueError as error:
        assert "needs sample=" in str(error) or "could not measure" in str(error), error
    else:
        raise AssertionError("partition='time' without a sample was accepted")


def traced_steps(path: str, schedule: str, microbatches: int) -> None:
    """A warm-up step, then one traced train step and one traced eval step; rank 0 pickles the timelines."""
    import pickle

    torch.manual_seed(0)  # compute (~2 ms a stage per micro-batch) well above per-message overheads
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])
    engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=microbatches, schedule=schedule,
                            partition="uniform")  # fmt: skip
    x, y = torch.randn(64 * microbatches, 512), torch.randn(64 * microbatches, 512)
    engine.train_step(x, y)
    assert engine.timeline() is None  # not traced
    with engine.tracing():
        engine.train_step(x, y)
        train = engine.timeline()
        engine.eval_step(x)
        evaluation = engine.timeline()
    engine.train_step(x, y)
    assert engine.timeline() is evaluation  # tracing is off again: the last traced step stays
    if ranks.rank() == 0:
        with open(path, "wb") as out:
            pickle.dump((engine.schedule, train, evaluation), out)
    else:
        assert train is None and evaluation is None


def data_parallel_parity(model_name: str, schedule: str, data_parallel: int, m: int, size: int, steps: int = 3) -> None:
    """dp replicas of a pipeline equal one process trained on the union of the replicas' batches."""
    build, loss_fn = MODELS[model_name]
    model = build()
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule, data_parallel=data_parallel)
    assert (engine.dp_rank, engine.rank) == divmod(ranks.rank(), ranks.size() // data_parallel)
    local = list(engine.parameters())
    optimizer = torch.optim.AdamW(local, lr=1e-3, eps=1e-6) if local else None
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    what = f"{model_name} {schedule} dp={data_parallel}"
    train_replicas_like_one_process(
        engine, reference, (optimizer, reference_optimizer), loss_fn, steps, what,
        lambda step: [batch(model_name, size, seed=100 * step + replica) for replica in range(data_parallel)],
    )  # fmt: skip
    check_weights(engine, reference, f"{what} after {steps} steps")


def train_replicas_like_one_process(
    engine: PipelineEngine,
    reference: nn.Module,
    optimizers: tuple[torch.optim.Optimizer | None, torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    what: str,
    batches: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]],
) -> None:
    """Each step, ``batches(step)`` holds every replica's (x, y): this rank trains on its replica's, the reference
    on their union; the loss and every gradient must agree, then both optimizers step."""
    for step in range(steps):
        parts = batches(step)
        x, y = parts[engine.dp_rank]
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        union_x, union_y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        expected = loss_fn(reference(union_x), union_y)
        expected.backward()
        close(loss, expected.item(), f"{what} step {step}: loss")
        check_grads(engine, reference, f"{what} step {step}")
        step_both(*optimizers)


def clipping(schedule: str, data_parallel: int = 1) -> None:
    """clip_grad_norm_ across stages equals torch.nn.utils.clip_grad_norm_ on the whole model."""
    build, loss_fn = MODELS["transformer"]
    model = build()
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, schedule=schedule, data_parallel=data_parallel)
    x, y = batch("transformer", 8, seed=3)
    for norm_type, max_norm in ((2.0, 0.5), (float("inf"), 0.01), (1.0, 1e6)):
        engine.zero_grad()
        reference.zero_grad()
        engine.train_step(x if engine.first else None, y if engine.last else None)
        loss_fn(reference(x), y).backward()  # every replica had the same batch: the same mean
        check_clipped(engine, reference, max_norm, schedule, norm_type)


def train_and_save(directory: str, schedule: str, steps: int, data_parallel: int = 1) -> None:
    """Train the engine and a single-process reference in step; save both (the reference for the test)."""
    from pathlib import Path

    build, loss_fn = MODELS["transformer"]
    model = build()
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, schedule=schedule, data_parallel=data_parallel)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    for step in range(steps):
        x, y = batch("transformer", 8, seed=step)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        loss_fn(reference(x), y).backward()
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    engine.save(directory, optimizer)
    if ranks.rank() == 0:
        torch.save({"model": reference.state_dict(), "optimizer": reference_optimizer.state_dict()},
                   Path(directory) / "reference.pt")  # fmt: skip


def load_and_continue(directory: str, schedule: str, steps_done: int) -> None:
    """A different partition loads the checkpoint and continues exactly like the single-process reference."""
    from pathlib import Path

    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(seed=123), loss_fn, num_microbatches=4, schedule=schedule)  # other weights
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
    engine.load(directory, optimizer)
    saved = torch.load(Path(directory) / "reference.pt", weights_only=False)
    reference = build()
    reference.load_state_dict(saved["model"])
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    reference_optimizer.load_state_dict(saved["optimizer"])
    check_weights(engine, reference, "after load")
    x, y = batch("transformer", 8, seed=steps_done)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = loss_fn(reference(x), y)
    expected.backward()
    close(loss, expected.item(), "loss after load")
    optimizer.step()
    reference_optimizer.step()  # equal only if the AdamW moments were loaded too
    check_weights(engine, reference, "one step after load")


def check_weights(engine: PipelineEngine, reference: nn.Module, what: str) -> None:
    weights = dict(reference.named_parameters())
    for name, param in engine.named_parameters():
        close(param.detach(), weights[name].detach(), f"{what}: {name}")


def save_that_crashes(directory: str) -> None:
    """Rank 1 fails while writing its part of a second checkpoint."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(seed=7), loss_fn, num_microbatches=2, schedule="1f1b")
    if ranks.rank() == 1:
        original = torch.save

        def broken(obj: object, path: object) -> None:
            original(obj, path)  # the temporary file is written...
            raise OSError("disk full (planted)")  # ...and the rename never happens

        torch.save = broken  # type: ignore[assignment]
    engine.save(directory)


def load_foreign(directory: str) -> None:
    build, loss_fn = MODELS["mlp"]
    PipelineEngine(build(), loss_fn, num_microbatches=2).load(directory)


def step_then_trace(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step and an optimizer step (its state exists), gradients set to None, then one traced step."""
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()
    optimizer.zero_grad()
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
