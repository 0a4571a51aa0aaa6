"""torch.compile'd stages under every schedule, split backward included: the engine equals one process running the
same compiled model, micro-batch by micro-batch (inductor on the CPU; real gloo processes)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine
from tests.pipeengine import ranks
from tests.pipeengine.gpt import (
    Block,
    count_tokens,
    headwise_gpt,
    one_process_loss,
    padded_batch,
    tied_gpt,
    token_sum,
    tp_batch,
    tp_plan,
    whole_token_sum,
)
from tests.pipeengine.parity import OneProcess, check_grads, check_weights, close, step_both, train_like_one_process
from tests.pipeengine.ranks import on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]
M = 4  # micro-batches: dualpipe-v needs 2 per rank


def gpt(tied: bool = False, blocks: int = 4) -> nn.Sequential:
    model = tied_gpt(blocks=blocks)
    if not tied:
        model[-1].out.weight = nn.Parameter(model[-1].out.weight.detach().clone())
    return model


def compiled_blocks(model: nn.Sequential, **options: object) -> nn.Sequential:
    """The user's compiled blocks: each transformer block torch.compile'd in place (inductor unless told)."""
    for layer in model:
        if isinstance(layer, Block):
            layer.compile(**options)  # type: ignore[arg-type]
    return model


def parity(
    schedule: str,
    options: dict[str, object] | None = None,
    tied: bool = False,
    steps: int = 2,
    summed: bool = False,
    trace: bool = False,
) -> None:
    """Loss, every gradient and the weights after AdamW equal one process running the same compiled blocks."""
    options = options or {}
    model = compiled_blocks(gpt(tied))
    # the one process runs micro-batch by micro-batch at the engine's shapes (a compiled region is specialized to
    # them), each loss weighted as the engine weights it
    one = OneProcess(model, token_sum if summed else one_process_loss)
    compiled_blocks(one.model)  # deepcopy keeps no compiled call: compile the copy too
    loss_options = {"loss_count": count_tokens} if summed else {}
    engine = PipelineEngine(
        model,
        token_sum if summed else one_process_loss,
        num_microbatches=M,
        schedule=schedule,
        **loss_options,
        **options,
    )  # type: ignore[arg-type]
    optimizers = torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2)
    what = f"compiled blocks, {schedule} {options} tied={tied}"
    for step in range(steps):
        x, y = padded_batch(2 * M, seed=step, microbatches=M)
        with engine.tracing() if trace and step else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        expected = one.step([(x, y)], microbatches=M, count=count_tokens if summed else None)
        close(loss, expected, f"{what} step {step}: loss")
        check_grads(engine, one, f"{what} step {step}")
        step_both(*optimizers)
    check_weights(engine, one, f"{what} after {steps} AdamW steps")
    if trace:
        timeline = engine.timeline()
        if ranks.rank() == 0:  # the compiled computes are in the timeline, with the memory they held
            assert timeline is not None and len([s for s in timeline.spans if s.is_compute]) >= 3 * M
            assert min(timeline.peak_memory) > 0


def every_schedule() -> None:
    for schedule in SCHEDULES:
        parity(schedule)


def every_layer_compiled(model: nn.Sequential, **options: object) -> nn.Sequential:
    """What compile=True does to each stage's layers, done to the one-process reference."""
    for layer in model:
        layer.compile(**options)  # type: ignore[arg-type]
    return model


def around_the_schedules() -> None:
    """Compiled blocks with activation checkpointing (one W pass then), a tie on one rank of a V and across ranks,
    a traced step, bf16; and compile=True compiling each layer of every stage itself."""
    parity("1f1b", {"checkpoint": "always"})
    parity("zb-h1", {"checkpoint": "always"}, steps=1)
    parity("zb-v", tied=True, steps=1)  # the embedding and the head on rank 0 of the V
    parity("1f1b", tied=True, summed=True, steps=1)  # across the two ranks, summed over the holders
    parity("zb-h1", trace=True)
    model = compiled_blocks(gpt())
    one = OneProcess(model, one_process_loss)
    compiled_blocks(one.model)
    engine = PipelineEngine(model, one_process_loss, num_microbatches=M, schedule="zb-v", precision="bf16")
    x, y = padded_batch(2 * M, seed=5, microbatches=M)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = one.step([(x, y)], microbatches=M, bounds=engine.bounds, dtype=torch.bfloat16)
    close(loss, expected, "bf16 compiled blocks: loss")
    check_grads(engine, one, "bf16 compiled blocks")
    model = gpt()  # compile=True: the engine compiles each layer; nothing compiled by the user
    one = OneProcess(model, one_process_loss)
    every_layer_compiled(one.model)
    engine = PipelineEngine(model, one_process_loss, num_microbatches=M, schedule="zb-h1", compile=True)
    assert all(
        getattr(layer, "_compiled_call_impl", None) is not None for stage in engine.stages.values() for layer in stage
    )
    x, y = padded_batch(2 * M, seed=6, microbatches=M)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(loss, one.step([(x, y)], microbatches=M), "compile=True: loss")
    check_grads(engine, one, "compile=True")


def with_tensor_parallel_and_fsdp() -> None:
    """compile after tensor parallelism (tp=2) and before FSDP (dp=2), as torchtitan orders them; two ranks each (a
    compiled region is compiled on every rank: the fewer, the cheaper). Dynamo and AOT autograd over the DTensors and
    FSDP's hooks, as compile= takes the user's options; inductor's code generation is every_schedule's."""
    backend = {"backend": "aot_eager"}
    for options, data_parallel in (({"tensor_parallel": 2, "tp_plan": tp_plan()}, 1), ({"fsdp": True}, 2)):
        model = headwise_gpt(blocks=2)
        one = OneProcess(model, one_process_loss)  # the token mean
        every_layer_compiled(one.model, **backend)
        engine = PipelineEngine(
            model,
            whole_token_sum,
            num_microbatches=2,
            loss_count=count_tokens,
            compile=backend,
            data_parallel=data_parallel,
            **options,
        )  # type: ignore[arg-type]
        optimizers = (torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2))
        what = f"compile={backend} {options} dp={data_parallel}"
        # micro-batches of 4 rows, the shapes compiled on both sides: one replica's batch is 8 rows
        train_like_one_process(
            engine,
            one,
            optimizers,
            1,
            what,
            lambda step, d=data_parallel: [tp_batch(8, seed=10 * step + r) for r in range(d)],  # type: ignore[misc]
        )
        check_weights(engine, one, what)


@pytest.mark.timeout(400)
@on_ranks(2, timeout=380)
def test_compiled_stages_under_every_schedule_and_every_feature_equal_one_process() -> None:
    """One world of two gloo ranks (each compiles a region once, then every case reuses it): every schedule with the
    user's compiled blocks; checkpointing, ties, tracing, bf16; compile=True alone; compile= (aot_eager) with tp=2
    and with fsdp=True."""
    every_schedule()
    around_the_schedules()
    with_tensor_parallel_and_fsdp()


def test_a_compiled_regions_weight_gradients_are_made_by_i_and_w_has_nothing_left() -> None:
    """Split backward over a compiled block (one autograd node for the whole region): I returns the input gradient
    and leaves the block's weight gradients whole in .grad, running a weight's post-accumulate hook there as
    autograd's accumulation would; W has nothing to run; both equal eager autograd's. The eager head behind it keeps
    its usual split: its weights wait for W."""
    from pipeengine.step.backward import backward_input, keep_compiled_graphs

    keep_compiled_graphs()
    torch.manual_seed(0)
    block, head = Block(), nn.Linear(16, 16)
    one = OneProcess(nn.Sequential(block, head))  # eager
    hooked = next(block.parameters())
    seen: list[torch.Tensor] = []
    hooked.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))  # type: ignore[union-attr]
    block.compile(backend="aot_eager")
    x = torch.randn(2, 6, 16, requires_grad=True)
    out = head(block(x))
    grad = torch.randn_like(out)
    params = [*block.parameters(), *head.parameters()]
    (input_grad,), weight_pass = backward_input((out,), (grad,), (x,), params)
    assert all(p.grad is not None for p in block.parameters()) and all(p.grad is None for p in head.parameters())
    assert len(seen) == 1 and torch.equal(seen[0], hooked.grad)  # type: ignore[arg-type]
    assert weight_pass.fallback is None and {id(p) for root in weight_pass.roots for p in root.params} == {
        id(p) for p in head.parameters()
    }
    weight_pass.run()
    close(input_grad, one.input_gradient(x, grad), "the input gradient")  # type: ignore[arg-type]
    for (name, mine), theirs in zip(nn.Sequential(block, head).named_parameters(), one.parameters(), strict=True):
        close(mine.grad, theirs.grad, f"{name}'s gradient")  # type: ignore[arg-type]


def test_shapes_are_inferred_from_the_uncompiled_layers_never_compiling_meta_tensors() -> None:
    """A compiler need not take meta tensors (inductor's partitioner does not): shape inference runs the modules a
    compiled layer wraps, whether torch.compile(layer) or layer.compile() made it, eagerly."""
    from pipeengine.core.specs import Boundary, TensorSpec, infer_boundaries, meta_copy

    seen: list[str] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        seen.extend(t.device.type for t in inputs if isinstance(t, torch.Tensor))
        if "meta" in seen:
            raise RuntimeError("this compiler does not take meta tensors")
        return graph.forward

    torch.manual_seed(0)
    wrapped, in_place = torch.compile(Block(), backend=backend), Block()
    in_place.compile(backend=backend)
    layers = [meta_copy(layer) for layer in (wrapped, in_place, nn.Linear(16, 4))]
    boundaries = infer_boundaries(
        layers, [(0, 1), (1, 3)], Boundary((TensorSpec((2, 6, 16), torch.float32, False),), False)
    )
    assert [str(b) for b in boundaries] == ["float32[2, 6, 16], requires grad", "float32[2, 6, 4], requires grad"]
    assert seen == []  # the compiler was never called
    wrapped(torch.randn(2, 6, 16))  # and the layers themselves still run compiled
    assert seen and "meta" not in seen


def test_the_ledgers_hooks_are_never_compiled_inside_a_compiled_layer() -> None:
    """Tracing counts what autograd saves by saved-tensor hooks, which autograd calls while a compiled layer runs:
    dynamo must not take them for the user's code (it compiled and recompiled them per shape to its limit, seconds a
    traced step). The same layer compiles the same frames watched by a ledger as not watched."""
    from torch._dynamo.utils import counters

    from pipeengine.observe.ledger import Ledger

    def frames(watched: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        one = OneProcess(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), nn.functional.mse_loss)
        one.model.compile(backend="aot_eager")  # dynamo runs torch's modules, and what they call, as they are: it is
        with Ledger().watching() if watched else contextlib.nullcontext():  # the hooks it would compile
            for rows in (2, 3, 2):
                one.step([(torch.randn(rows, 8, requires_grad=True), torch.randn(rows, 8))])
        return int(counters["frames"]["total"])

    assert frames(watched=True) == frames(watched=False)


def test_importing_pipeengine_leaves_dynamo_unimported() -> None:
    """Disabling the ledger's hooks for dynamo imports dynamo (1.6 s of CPU on every ``import pipeengine``, in each
    rank): done once a region can be compiled (dynamo is imported), never at import."""
    code = "import sys, pipeengine, pipeengine.tune; print(sorted(m for m in sys.modules if m.startswith('torch._dy')))"
    found = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        check=True,
    )
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


def test_compile_true_compiles_torchs_own_layers_in_place() -> None:
    """compile=True compiles each layer in place, an nn.Linear or an nn.Sequential of torch's layers too (torch
    2.13's nn.Module.compile runs those eagerly: pytorch/pytorch#150915); the names and the state stay the model's.
    (The user's blocks: test_compiled_stages_under_every_schedule_and_every_feature_equal_one_process.)"""
    from pipeengine.construction.transform import compile_layers

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.GELU(), nn.Linear(16, 16)))
    eager = {name: value.clone() for name, value in stage.state_dict().items()}
    compile_layers(stage, {"backend": "aot_eager"})
    assert list(stage.state_dict()) == list(eager)
    x = torch.randn(2, 6, 8, requires_grad=True)
    for layer in stage:
        x = layer(x)
        assert type(x.grad_fn).__name__ == "CompiledFunctionBackward", f"{type(layer).__name__} ran eagerly"


def test_compile_true_compiles_a_subclass_of_a_torch_layer_that_keeps_torchs_forward() -> None:
    """A user's subclass of nn.Linear that keeps torch's forward is torch's code to dynamo as nn.Linear is: compiled
    in place too (nn.Module.compile would run it eagerly, silently), its calls going through the user's backend."""
    from pipeengine.construction.transform import compile_layers

    class Projection(nn.Linear):
        pass

    graphs: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(len(inputs))
        return graph.forward

    layer = Projection(4, 2)
    compile_layers(nn.Sequential(layer), {"backend": backend})
    layer(torch.randn(3, 4))
    assert graphs, "the subclass of nn.Linear ran eagerly: the backend never saw it"


@pytest.mark.timeout(120)
@on_ranks(2, timeout=100, in_process=True)
def test_compile_options_reach_torch_compile_the_users_backend_compiles_every_layer() -> None:
    """compile={"backend": fn}: the user's options are torch.compile's, not its defaults: the backend (a Python
    function) compiles each layer of every stage, and training equals one process. Two in-process ranks; every layer
    of each stage compiled through the user's backend, none by another."""
    graphs: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(len(inputs))
        return graph.forward

    torch.manual_seed(0)  # the in-process ranks build their models one at a time: the same model
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    one = OneProcess(model, nn.functional.mse_loss)
    engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=2, compile={"backend": backend})
    generator = torch.Generator().manual_seed(1)  # the ranks share torch's default generator: their own, the same
    x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 2, generator=generator)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    layers = sum(len(stage) for stage in engine.stages.values())
    assert len(graphs) >= layers, f"rank {ranks.rank()}: the backend compiled {len(graphs)} graphs of {layers} layers"
    close(loss, one.step([(x, y)], microbatches=2), "compile={'backend': backend}: loss")
    check_grads(engine, one, "compile={'backend': backend}")


def test_a_warm_profile_of_a_compiled_layer_warms_a_compiled_copy_with_its_own_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """profile_layers(warm=True, compile=...): the copy run before each timed compute is compiled as the layer is,
    and its compiled call runs its own weights (a copy made after compiling in place drops the compiled call)."""
    from pipeengine.planner import measure

    copies: list[nn.Module] = []
    warming = measure._warming

    def kept(flush, twin, value, first):  # type: ignore[no-untyped-def]
        copies.append(twin)
        return warming(flush, twin, value, first)

    monkeypatch.setattr(measure, "_warming", kept)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    profile = measure.profile_layers(
        model, torch.randn(4, 4), 2, repeats=1, device=torch.device("cpu"), compile={"backend": "eager"}, warm=True
    )
    assert len(copies) == 2 and len(profile.forward) == 2
    for twin, layer in zip(copies, model, strict=True):
        assert getattr(twin, "_compiled_call_impl", None) is not None
        assert not any(p.data_ptr() == q.data_ptr() for p in twin.parameters() for q in layer.parameters())
        x = torch.randn(3, 4)
        with torch.no_grad():
            for p in twin.parameters():
                p.zero_()
            assert not twin(x).any() and layer(x).any()  # the copy's call ran its own (zeroed) weights
