"""Where two features meet: gradients accumulated over steps with a tie or a summed loss over
replicas, replicas' buffers, eval under FSDP, fp16 with sharded gradients, tracing a tensor-parallel stage, the
user's own profiler. Each against one process, on real gloo ranks where torch.distributed is needed."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, launch
from pipeengine.core.dtensors import whole
from schedules import Instruction
from tests.pipeengine import ranks
from tests.pipeengine.gpt import count_tokens, one_process_loss, padded_batch, tied_gpt, token_sum
from tests.pipeengine.models import MODELS, SEEDED, mlp, mse
from tests.pipeengine.models import batch as model_batch
from tests.pipeengine.parity import OneProcess, check_grads, check_weights, close, step_both
from tests.pipeengine.ranks import on_ranks


def accumulated(data_parallel: int, options: dict[str, object], summed: bool, tied: bool, steps: int = 2) -> None:
    """``steps`` train_steps with no zero_grad between: every gradient is the sum of each step's one-process
    gradient (as the README promises), then one AdamW step leaves the same weights."""
    model = tied_gpt(blocks=2)
    if not tied:  # its own head: nothing tied
        model[-1].out.weight = nn.Parameter(model[-1].out.weight.detach().clone())
    one = OneProcess(model, one_process_loss)
    m = 2
    loss_options = {"loss_count": count_tokens} if summed else {}
    engine = PipelineEngine(
        model,
        token_sum if summed else one_process_loss,
        num_microbatches=m,
        schedule="1f1b",
        data_parallel=data_parallel,
        **loss_options,
        **options,
    )  # type: ignore[arg-type]
    what = f"dp={data_parallel} {options} summed={summed} tied={tied}"
    for step in range(steps):
        parts = [padded_batch(2 * m, seed=10 * step + r, microbatches=m) for r in range(data_parallel)]
        x, y = parts[engine.dp_rank]
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        # summed: one process's token mean over the global batch; else the mean of the replicas' means of their
        # micro-batches' means
        expected = one.step(parts) if summed else one.step(parts, microbatches=m)
        close(loss, expected, f"{what} step {step}: loss")
        check_grads(engine, one, f"{what}: gradients accumulated over {step + 1} steps")
    optimizers = torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2)
    step_both(*optimizers)
    check_weights(engine, one, f"{what}: after AdamW on the accumulated gradients")


@pytest.mark.timeout(120)
@on_ranks(2, timeout=90)
def test_gradients_accumulate_over_steps_with_a_tie_across_ranks() -> None:
    accumulated(1, {}, summed=True, tied=True)  # a tie across two ranks
    accumulated(1, {}, summed=False, tied=True)


@pytest.mark.timeout(180)
@on_ranks(4, timeout=150)
def test_gradients_accumulate_over_steps_with_replicas_summed_tied_and_sharded() -> None:
    for options in ({}, {"fsdp": True}):
        accumulated(2, options, summed=True, tied=True)
        accumulated(2, options, summed=False, tied=True)
    accumulated(2, {}, summed=True, tied=False)  # the replicas' sum alone (loss_count)


def normed(seed: int = 0) -> nn.Sequential:
    """An MLP with batch norms: running statistics, buffers each replica updates from its own batch."""
    with SEEDED:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(8, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 4),
        )


def replicas_buffers(directory: str, fsdp: bool) -> None:
    """dp=2 x pp=2: after a step every replica holds replica 0's running statistics (as DDP's broadcast_buffers:
    what replica 0 computed from its own micro-batches), so eval_step agrees across replicas and a checkpoint keeps
    that one copy."""
    from pipeengine import consolidate

    model = normed()
    one = OneProcess(model, nn.functional.mse_loss)  # replica 0's statistics: its micro-batches, in order, training
    m = 2
    engine = PipelineEngine(
        model, nn.functional.mse_loss, num_microbatches=m, schedule="1f1b", data_parallel=2, fsdp=fsdp, partition=[2, 5]
    )
    parts = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(r)), torch.randn(8, 4)) for r in range(2)]
    x, y = parts[engine.dp_rank]
    engine.train_step(x if engine.first else None, y if engine.last else None)
    for chunk in parts[0][0].chunk(m):
        one.forward(chunk)
    state = {name: value for name, value in engine.state_dict().items() if "running" in name}
    assert state or not any(True for _ in engine.parameters()), "every stage here holds a batch norm"
    expected = one.seq.state_dict()
    for name, value in state.items():
        close(value, expected[name], f"fsdp={fsdp}: {name} on replica {engine.dp_rank}")
    engine.eval()
    one.seq.eval()
    probe = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    out = engine.eval_step(probe if engine.first else None)
    if engine.last:
        close(out, one.forward(probe), f"fsdp={fsdp}: eval on replica {engine.dp_rank}")  # type: ignore[arg-type]
    engine.save(directory)
    ranks.barrier()
    saved = consolidate(directory)
    for name in ("1.running_mean", "4.running_var", "4.num_batches_tracked"):
        close(saved[name].float(), expected[name].float(), f"fsdp={fsdp}: checkpointed {name}")


@pytest.mark.timeout(180)
@on_ranks(4, timeout=150)
def test_replicas_share_buffers_eval_frees_gathered_shards_and_fp16_unscales_shards(tmp_path: Path) -> None:
    for fsdp in (False, True):
        replicas_buffers(f"{tmp_path}/{fsdp}", fsdp)
    eval_between_sharded_steps()
    fp16_sharded()
    no_view_warnings()


def no_view_warnings() -> None:
    """FSDP2 under bf16 does not warn that a stage (or its last layer) returned a view: the engine takes that output
    and changes nothing in place."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(), loss_fn, num_microbatches=2, data_parallel=2, fsdp=True, precision="bf16")
    x, y = model_batch("transformer", 4, seed=engine.dp_rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.train_step(x if engine.first else None, y if engine.last else None)
    views = [str(w.message)[:80] for w in caught if "returned a view tensor" in str(w.message)]
    assert not views, views


def eval_between_sharded_steps() -> None:
    """fsdp=True (reshard_after_forward=False, the default): eval_step frees what it gathered; training, parameters()
    and eval go on like one process."""
    model = tied_gpt(blocks=2)
    model[-1].out.weight = nn.Parameter(model[-1].out.weight.detach().clone())
    one = OneProcess(model, one_process_loss)
    engine = PipelineEngine(model, one_process_loss, num_microbatches=2, data_parallel=2, fsdp=True)
    optimizers = torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2)
    for step in range(2):
        x, y = padded_batch(4, seed=step, microbatches=2)  # the same batch on both replicas: the mean is one's
        out = engine.eval_step(x if engine.first else None)
        expected = one.forward(x)
        if engine.last:
            close(out, expected, f"eval before step {step}")  # type: ignore[arg-type]
        sizes = {name: tuple(p.to_local().shape) for name, p in engine.named_parameters()}  # type: ignore[attr-defined]
        assert all(shape[0] <= (dict(one.seq.named_parameters())[n].shape[0] + 1) // 2 for n, shape in sizes.items()), (
            f"eval left parameters gathered: {sizes}"
        )
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        close(loss, one.step([(x, y)], microbatches=2), f"step {step} after eval: loss")
        check_grads(engine, one, f"step {step} after eval")
        step_both(*optimizers)
    check_weights(engine, one, "after eval, train, eval, train")


def fp16_sharded() -> None:
    """precision="fp16" with fsdp=True: the scaler unscales the sharded gradients, agrees on overflow and steps."""
    model = tied_gpt(blocks=2)
    model[-1].out.weight = nn.Parameter(model[-1].out.weight.detach().clone())
    one = OneProcess(model, one_process_loss)
    m = 2
    engine = PipelineEngine(model, one_process_loss, num_microbatches=m, data_parallel=2, fsdp=True, precision="fp16")
    parts = [padded_batch(4, seed=20 + r, microbatches=m) for r in range(2)]
    x, y = parts[engine.dp_rank]
    engine.scaler.scale = scale = 2.0**8  # 2**16 overflows this model's fp16 logits' gradients (on any layout)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    union = [(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))]  # 2 m micro-batches, in order
    expected = one.step(union, microbatches=2 * m, bounds=engine.bounds, dtype=torch.float16, scale=scale)
    close(loss, expected, "fp16 fsdp: loss")
    assert engine.scaler.unscale_() is False
    check_grads(engine, one, "fp16 fsdp: unscaled")
    optimizers = torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2)
    assert engine.scaler.step(optimizers[0])
    engine.scaler.update()
    optimizers[1].step()
    check_weights(engine, one, "fp16 fsdp: after the scaler's step")


def rowwise_mlp(seed: int = 0) -> nn.Sequential:
    """Two column-then-row pairs and a head: cut after layer 2, stage 0 ends on RowwiseParallel (its output an
    asynchronous collective's tensor)."""
    with SEEDED:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(8, 16),
            nn.Tanh(),
            nn.Linear(16, 8),
            nn.Linear(8, 16),
            nn.Tanh(),
            nn.Linear(16, 8),
            nn.Linear(8, 4),
        )


def rowwise_plan() -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}


@pytest.mark.timeout(180)
@on_ranks(4, timeout=150)
def test_tensor_parallel_stages_trace_and_unscale_fp16_like_one_process() -> None:
    """pp=2 x tp=2: a traced step of a stage ending on RowwiseParallel trains like one process and yields a timeline
    with its memory; fp16's scaler unscales the sharded gradients and steps like one process."""
    mse = nn.functional.mse_loss
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    model = rowwise_mlp()
    one = OneProcess(model, mse)
    engine = PipelineEngine(model, mse, num_microbatches=2, tensor_parallel=2, tp_plan=rowwise_plan(), partition=[3, 4])
    optimizers = torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2)
    for traced in (False, True):
        with engine.tracing(optimizers[0]) if traced else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        close(loss, one.step([(x, y)], microbatches=2), f"traced={traced}: loss")
        check_grads(engine, one, f"tp=2, stage 0 ending on RowwiseParallel, traced={traced}")
        step_both(*optimizers)
    timeline = engine.timeline()
    if ranks.rank() == 0:
        assert timeline is not None
        assert {span.action.kind.name for span in timeline.spans if span.is_compute} >= {"FORWARD", "BACKWARD"}  # type: ignore[union-attr]
        assert min(timeline.peak_memory) > 0 and timeline.allocated_peak is not None
    model = rowwise_mlp()
    one = OneProcess(model, mse)
    engine = PipelineEngine(
        model, mse, num_microbatches=2, tensor_parallel=2, tp_plan=rowwise_plan(), partition=[3, 4], precision="fp16"
    )
    scale = engine.scaler.scale
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = one.step([(x, y)], microbatches=2, bounds=engine.bounds, dtype=torch.float16, scale=scale)
    # each tensor rank of a RowwiseParallel layer rounds its partial sum to fp16 before they are added, one process
    # rounds the whole sum: two such layers deep, a few of fp16's units (2**-10) apart, never float32's
    fp16 = {"rtol": 4 * 2.0**-10, "atol": 4 * 2.0**-10}
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(expected), **fp16, msg=lambda m: f"fp16 tp=2 loss: {m}")
    optimizers = torch.optim.SGD(engine.parameters(), lr=0.5), torch.optim.SGD(one.parameters(), lr=0.5)
    assert engine.scaler.step(optimizers[0])
    engine.scaler.update()
    expected_grads = dict(one.seq.named_parameters())
    for name, param in engine.named_parameters():
        torch.testing.assert_close(
            whole(param.grad),
            expected_grads[name].grad,
            **fp16,
            msg=lambda m, n=name: f"fp16 tp=2, {n}'s unscaled gradient: {m}",
        )
    optimizers[1].step()
    for name, param in engine.named_parameters():  # SGD: the weights move by lr times those gradients
        torch.testing.assert_close(
            whole(param.detach()),
            expected_grads[name].detach(),
            **fp16,
            msg=lambda m, n=name: f"fp16 tp=2, {n} after the scaler's step: {m}",
        )


@pytest.mark.timeout(120)
@on_ranks(2, timeout=90)
def test_the_users_profiler_records_the_engines_instructions_while_it_traces(tmp_path: Path) -> None:
    """The user's torch.profiler keeps recording while the engine traces (inside or around it): the engine does not
    start a profiler of its own then (it says so), every instruction shows as a range named as in the timeline, and
    the user's trace exports. Without engine tracing the ranges show too."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, schedule="1f1b")
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)  # warm: sizes measured unwatched
    cases = {
        "inside": lambda: (profile(), engine.tracing()),
        "around": lambda: (engine.tracing(), profile()),
        "untraced": lambda: (profile(), contextlib.nullcontext()),
    }
    said: list[str] = []
    for case, contexts in cases.items():
        outer, inner = contexts()
        with warnings.catch_warnings(record=True) as caught, outer as first, inner as second:
            warnings.simplefilter("always")
            engine.train_step(x if engine.first else None, y if engine.last else None)
        said += [str(w.message) for w in caught]
        prof = first if case != "around" else second
        names = {event.name for event in prof.events()}
        mine = {
            f"pipeengine/{op}"
            for op in engine.last_program.instructions[engine.rank]  # type: ignore[union-attr]
            if isinstance(op, Instruction)
        }
        assert mine <= names, f"{case}: the instructions {sorted(mine - names)} are not in the user's trace"
        assert len(names) > len(mine), f"{case}: the user's profiler recorded only our ranges: {sorted(names)}"
        prof.export_chrome_trace(f"{tmp_path}/{case}-{ranks.rank()}.json")
        timeline = engine.timeline()
        if case != "untraced" and ranks.rank() == 0:
            assert timeline is not None and timeline.allocated_peak is None  # not measured: one profiler at a time
            assert min(timeline.peak_memory) > 0  # the ledger's figures stand
    assert sum("a torch.profiler is open (yours)" in text for text in said) == 1, said  # said, once
    ranks.barrier()
    assert len(list(tmp_path.glob("*.json"))) == 6  # each rank exported each case's trace (it used to crash)


@pytest.mark.timeout(120)
@on_ranks(2, timeout=90)
def test_a_traced_step_inside_a_scheduled_profilers_warmup_leaves_it_alone() -> None:
    """A traced step while the user's scheduled profiler waits or warms up (kineto prepared, not recording): the engine
    starts no profiler of its own then (torch would crash when the user's turns active: SIGSEGV on every rank before),
    and the active step records the engine's ranges."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, trace=True)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    plan = torch.profiler.schedule(wait=1, warmup=1, active=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=plan) as prof:
        for _ in range(3):
            engine.train_step(x if engine.first else None, y if engine.last else None)
            prof.step()
    assert f"pipeengine/{engine.rank}F0" in {event.name for event in prof.events()}
    engine.train_step(x if engine.first else None, y if engine.last else None)  # closed: the allocator is watched
    timeline = engine.timeline()
    assert ranks.rank() != 0 or (timeline is not None and timeline.allocated_peak is not None)


@pytest.mark.timeout(120)
@on_ranks(2, timeout=90)
def test_a_traced_step_under_a_profiler_with_stacks_leaves_every_event_name_readable() -> None:
    """A traced step inside the user's profiler with record_shapes and with_stack: every event's name reads back, and
    the engine's ranges are among them. torch names a Python call by pointing into its code object: one freed before
    the names are read (a module's, imported while the profiler recorded) leaves garbage, shown where its memory is
    reused (filled with 0xff here, at random otherwise): so the engine imports nothing while the profiler records."""
    import sys

    engine = PipelineEngine(mlp(), mse, num_microbatches=2, trace=True)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)  # warm: sizes measured unwatched
    imported: list[str] = []
    recording = False

    def imports(event: str, args: tuple[object, ...]) -> None:
        if event == "import" and recording and args[0] not in sys.modules:
            imported.append(str(args[0]))

    sys.addaudithook(imports)  # for the rest of this rank's process
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=True
    ) as prof:
        recording = True
        engine.train_step(x if engine.first else None, y if engine.last else None)
        recording = False
    assert not imported, f"the step imported {imported} while the profiler recorded"
    junk = [b"\xff" * size for size in range(1, 256) for _ in range(64)]  # reuses what was freed: never UTF-8
    names = {event.name for event in prof.events()}  # UnicodeDecodeError before
    del junk
    mine = {
        f"pipeengine/{op}"
        for op in engine.last_program.instructions[engine.rank]  # type: ignore[union-attr]
        if isinstance(op, Instruction)
    }
    assert mine <= names, f"the instructions {sorted(mine - names)} are not in the user's trace"


def profile() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def scaler_twice() -> None:
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, precision="fp16")
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    engine.scaler.step(optimizer)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    engine.scaler.step(optimizer)  # no update() between: the second step would take still-scaled gradients


@pytest.mark.timeout(60)
def test_a_second_scaler_step_without_update_is_refused_as_torch_refuses_it() -> None:
    with pytest.raises(RuntimeError, match=r"engine.scaler.step\(\) has already been called since the last update\(\)"):
        launch(scaler_twice, 2, timeout=30, in_process=True)


@pytest.mark.timeout(60)
@on_ranks(2, timeout=30, in_process=True)
def test_activation_checkpointing_updates_running_statistics_once_per_micro_batch() -> None:
    """checkpoint="always" recomputes each forward in backward, in training mode: batch norm's running statistics
    are updated once per micro-batch, as one process updates them, not twice."""
    model = normed()
    one = OneProcess(model, nn.functional.mse_loss)
    engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=2, checkpoint="always", partition=[2, 5])
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    for chunk in x.chunk(2):
        one.forward(chunk)
    expected = one.seq.state_dict()
    for name, value in engine.state_dict().items():
        if "running" in name or "batches" in name:
            close(value.float(), expected[name].float(), f"checkpoint='always': {name}")
