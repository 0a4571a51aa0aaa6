"""pipeengine.dry_run (issue 60, item 1): ranks of a big layout built and stepped in this process, on torch's fake
backend and the meta device, with the user's own main; what the real run raises is raised, naming the rank; the
same main then runs for real on gloo ranks, equal to one process."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import pipeengine
from pipeengine import PipelineEngine, hf, launch
from schedules import build_schedule, state_bytes
from tests.pipeengine.parity import ATOL, RTOL, OneProcess, close

WIDTH = 16


def mlp(width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
    )


def batch(width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, width, generator=generator), torch.randn(8, width, generator=generator)


def train(
    out: str | None, dp: int, tp: int, steps: int = 2, checkpoints: str | None = None, width: int = WIDTH
) -> None:
    """The user's main, the same for the dry run and the real run: an MLP of blocks on dp x pp x tp, SGD steps;
    ``checkpoints``: resume from the latest there, if any, and save there after the steps."""
    plan = {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()} if tp > 1 else None
    engine = PipelineEngine(
        mlp(width),
        nn.functional.mse_loss,
        num_microbatches=2,
        partition="uniform",
        data_parallel=dp,
        tensor_parallel=tp,
        tp_plan=plan,
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    if checkpoints is not None and pipeengine.latest_checkpoint(checkpoints) is not None:
        engine.load(checkpoints, optimizer)
    x, y = batch(width)
    mine = slice(engine.dp_rank * x.shape[0] // dp, (engine.dp_rank + 1) * x.shape[0] // dp)  # this replica's rows
    x, y = x[mine], y[mine]
    losses = []
    for _ in range(steps):
        losses.append(engine.train_step(x if engine.first else None, y if engine.last else None))
        optimizer.step()
        optimizer.zero_grad()
    if checkpoints is not None:
        engine.save(checkpoints, optimizer)
    if out is not None:
        torch.save(
            {
                "losses": losses,
                "state": {
                    k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in engine.state_dict().items()
                },
            },
            Path(out) / f"rank{dist.get_rank()}.pt",
        )


def test_ranks_of_a_grid_are_built_and_stepped_with_a_report() -> None:
    before = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PIPEENGINE_DRY_RUN")}
    report = pipeengine.dry_run(train, 8, ranks=[3, 6], devices_per_node=4, args=(None, 2, 2))
    assert not dist.is_initialized() and {key: os.environ.get(key) for key in before} == before
    three, six = report.reports
    # the grid (dp2 x pp2 x tp2, tp innermost): rank 3 is dp 0, pp 1, tp 1; rank 6 dp 1, pp 1, tp 0
    assert (three.rank, three.coordinates, three.stages) == (3, (0, 1, 1), {1: (2, 4)})
    assert (six.rank, six.coordinates) == (6, (1, 1, 0))
    assert three.groups == {"pipeline": (1, 3), "data": (3, 7), "tensor": (2, 3)}
    assert six.groups == {"pipeline": (4, 6), "data": (2, 6), "tensor": (6, 7)}
    assert three.layers == ("2", "3")
    block = WIDTH * 4 * WIDTH * 2 + 4 * WIDTH + WIDTH  # two weights, two biases
    shard = WIDTH * 4 * WIDTH * 2 // 2 + 4 * WIDTH // 2 + WIDTH  # column-wise bias split, row-wise bias whole
    assert (three.parameters, three.parameters_whole) == (2 * shard, 4 * block)
    assert three.steps == six.steps == 2
    assert three.program.startswith("1f1b: 2 pipeline ranks' streams, 2 stages, 2 micro-batches")
    assert three.program.endswith("validated under NCCL's rendezvous semantics")
    # its predicted peak: its shards (float32) with their gradients and AdamW's two moments; activations not counted
    assert (three.peak_bytes, three.activations_measured) == (state_bytes(4 * 2 * shard), False)
    text = str(report)
    assert "rank 3 of 8 (dp 0, pp 1, tp 1): stage 1: layers 2-3" in text and "tensor [2, 3]" in text
    assert "partition by uniform: 2 stages" in text


def main_uneven_blocks() -> None:
    """Two stages of blocks of different hidden sizes (4 x WIDTH, then 3 x WIDTH) on pp2 x tp2."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, h), nn.GELU(), nn.Linear(h, WIDTH)) for h in (4 * WIDTH,) * 2 + (3 * WIDTH,) * 2
    ]
    plan = {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}
    engine = PipelineEngine(
        nn.Sequential(*blocks),
        nn.functional.mse_loss,
        num_microbatches=2,
        partition="uniform",
        tensor_parallel=2,
        tp_plan=plan,
    )
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)


def test_the_dry_runs_table_counts_each_layer_as_the_rank_that_built_it_holds_it() -> None:
    """Under tensor parallelism each rank knows its own layers' shards: the table counts a layer that some rank of the
    dry run built as that rank holds it (the second stage's blocks, built by rank 2 alone), and one no rank built and
    of no built layer's size whole, as the table's header says."""

    def stage_params(report: pipeengine.launcher.dry.DryRun) -> list[int]:
        rows = [line.split() for line in str(report).splitlines() if line.split()[:1] in (["0"], ["1"])]
        return [int(row[3].replace(",", "")) for row in rows]

    def block(hidden: int, split: int) -> int:  # two weights and their biases; the row-wise bias whole
        return (2 * WIDTH * hidden + hidden) // split + WIDTH

    assert stage_params(pipeengine.dry_run(main_uneven_blocks, 4, ranks=[0, 2])) == [
        2 * block(4 * WIDTH, 2),
        2 * block(3 * WIDTH, 2),
    ]
    assert stage_params(pipeengine.dry_run(main_uneven_blocks, 4, ranks=[0])) == [
        2 * block(4 * WIDTH, 2),
        2 * block(3 * WIDTH, 1),
    ]


def test_a_rank_predicted_over_the_memory_limit_is_refused_naming_it() -> None:
    peak = pipeengine.dry_run(train, 8, ranks=[3], args=(None, 2, 2)).reports[0].peak_bytes
    assert pipeengine.dry_run(train, 8, ranks=[3], args=(None, 2, 2), memory_limit=peak).reports[0].peak_bytes == peak
    with pytest.raises(
        ValueError,
        match=r"rank 3 of 8 \(stage 1\) is predicted to hold 0\.00 GiB at its peak "
        r"\(activations not counted\), over memory_limit=0\.00 GiB: spread",
    ):
        pipeengine.dry_run(train, 8, ranks=[3], args=(None, 2, 2), memory_limit=peak - 1)
    with pytest.raises(ValueError, match="memory_limit=-1: give the bytes"):
        pipeengine.dry_run(train, 8, memory_limit=-1)


def test_the_same_main_runs_for_real_on_four_gloo_ranks_equal_to_one_process(tmp_path: Path) -> None:
    pipeengine.dry_run(train, 4, ranks=[0, 3], args=(None, 2, 1))  # dp2 x pp2 on the meta device
    launch(train, 4, args=(str(tmp_path), 2, 1, 2, str(tmp_path / "checkpoints")), timeout=120)
    before = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    # the checkpoint of that run (dp2 x pp2) loads into a dry run of dp2 x pp2 x tp2 (its shapes and sharding checked,
    # no tensor's data read), whose save writes nothing; another model's is refused with the real load's message
    with _loads_no_data():
        pipeengine.dry_run(train, 8, ranks=[0, 7], args=(None, 2, 2, 1, str(tmp_path / "checkpoints")))
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == before
    with pytest.raises(
        ValueError,
        match=r"^rank 0: .*part-0.pt: '0.0.weight' is \[64, 16\] there, \[128, 32\] in "
        "this model: it is a checkpoint of another model",
    ):
        pipeengine.dry_run(train, 4, ranks=[3], args=(None, 2, 1, 1, str(tmp_path / "checkpoints"), 2 * WIDTH))
    one = OneProcess(mlp(), nn.functional.mse_loss)
    optimizer = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
    x, y = batch()
    losses = []
    for _ in range(2):
        losses.append(one.step([(x[:4], y[:4]), (x[4:], y[4:])], microbatches=2))  # two replicas, 2 micro-batches
        optimizer.step()
        optimizer.zero_grad()
    state: dict[str, torch.Tensor] = {}
    for rank in range(4):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["losses"] == pytest.approx(losses, rel=RTOL, abs=ATOL)
        state.update(saved["state"])
    for name, value in one.seq.state_dict().items():
        close(state[name], value, f"{name} after two steps")


@contextlib.contextmanager
def _loads_no_data() -> Iterator[None]:
    """Every part file loaded inside maps to the meta device (a dry run's load reads the model's and optimizer's
    shapes, never their data; the small files of plain values beside them are read)."""
    real = torch.load
    maps: list[object] = []

    def spy(*args: object, **kwargs: object) -> object:
        if Path(str(args[0])).name.startswith("part-"):
            maps.append(kwargs.get("map_location"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    torch.load = spy  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = real
    assert maps and set(maps) == {"meta"}, maps


def test_a_1024_rank_llama_shaped_world_builds_and_steps_the_first_last_stage_and_last_ranks() -> None:
    transformers = pytest.importorskip("transformers")

    def main(tp: int, dp: int) -> None:
        config = transformers.LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
        )
        model = transformers.LlamaForCausalLM(config)
        engine = PipelineEngine(
            hf.sequential(model),
            hf.causal_lm_loss,
            num_microbatches=16,
            loss_count=hf.count_labels,
            partition="parameters",
            data_parallel=dp,
            tensor_parallel=tp,
            tp_plan=hf.tp_plan(model),
        )
        optimizer = torch.optim.AdamW(engine.parameters())
        tokens = torch.randint(0, config.vocab_size, (16, 4096))
        engine.train_step(tokens if engine.first else None, tokens if engine.last else None)
        optimizer.step()

    report = pipeengine.dry_run(main, 1024, ranks=[0, 120, 1023], args=(8, 8))  # dp8 x pp16 x tp8
    print(report)
    first, last_stage, last = report.reports
    assert [r.coordinates for r in report.reports] == [(0, 0, 0), (0, 15, 0), (7, 15, 7)]
    assert first.stages == {0: (0, 6)} and last_stage.stages == last.stages == {15: (76, 82)}  # embed, 80, final
    assert first.groups["pipeline"] == tuple(range(0, 128, 8)) and last.groups["tensor"] == tuple(range(1016, 1024))
    assert last.groups["data"] == tuple(range(127, 1024, 128))
    assert all(r.steps == 1 for r in report.reports)
    with torch.device("meta"):
        whole = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=8192,
                intermediate_size=28672,
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
                vocab_size=32000,
            )
        )
    assert first.parameters_whole == sum(p.numel() for p in whole.parameters())
    sharded = sum(
        p.numel() // 8 if name.endswith(("proj.weight",)) else p.numel()
        for i in range(5)
        for name, p in whole.model.layers[i].named_parameters()
    )
    assert first.parameters == whole.model.embed_tokens.weight.numel() + sharded


def main_interleaved() -> None:
    model = mlp()
    engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=6, schedule="interleaved")
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)


def main_cut_on_a_shard() -> None:
    model = nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.Linear(4 * WIDTH, WIDTH),
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.Linear(4 * WIDTH, WIDTH),
    )
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel(), "3": RowwiseParallel()}
    engine = PipelineEngine(
        model, nn.functional.mse_loss, num_microbatches=2, partition=[1, 3], tensor_parallel=2, tp_plan=plan
    )
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)


def test_what_the_real_run_refuses_is_refused_naming_the_rank() -> None:
    with pytest.raises(ValueError) as schedule:
        pipeengine.dry_run(main_interleaved, 16, ranks=[5], args=())
    with pytest.raises(ValueError) as direct:
        build_schedule("interleaved", 16, 6, chunks=None)
    assert str(schedule.value) == str(direct.value)  # the schedule compiler's own refusal
    assert "raised by rank 0 of 16" in "\n".join(schedule.value.__notes__)  # rank 0 runs first, for the record
    with pytest.raises(pipeengine.PipelineError, match="it looks like this rank's shard of the output") as cut:
        pipeengine.dry_run(main_cut_on_a_shard, 4, ranks=[2])
    assert "raised by rank 0 of 4" in "\n".join(cut.value.__notes__)


def test_a_tensor_parallel_degree_not_dividing_the_key_value_heads_is_refused_as_built() -> None:
    transformers = pytest.importorskip("transformers")

    def main() -> None:
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=100,
        )
        model = transformers.LlamaForCausalLM(config)
        PipelineEngine(
            hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, tensor_parallel=4, tp_plan=hf.tp_plan(model)
        )

    with pytest.raises(ValueError, match="its 8 attention heads and 2 key-value heads do not both divide by 4") as e:
        pipeengine.dry_run(main, 8, ranks=[7])
    assert "raised by rank 0 of 8" in "\n".join(e.value.__notes__)


def test_what_a_dry_run_is_given_wrong_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size=0: give the number of ranks"):
        pipeengine.dry_run(main_interleaved, 0)
    with pytest.raises(ValueError, match=r"ranks \[8\] are not ranks of a world of 8 \(0 to 7\)"):
        pipeengine.dry_run(main_interleaved, 8, ranks=[0, 8])
    with pytest.raises(ValueError, match="devices_per_node=0"):
        pipeengine.dry_run(main_interleaved, 8, devices_per_node=0)


def test_a_model_copied_in_main_is_on_the_meta_device() -> None:
    seen: list[torch.device] = []

    def main() -> None:
        seen.append(copy.deepcopy(mlp())[0][0].weight.device)

    pipeengine.dry_run(main, 2, ranks=[1])
    assert seen == [torch.device("meta")] * 2  # rank 0 for the record, then rank 1


def test_a_scalar_made_without_a_device_stays_on_the_cpu_as_an_optimizer_s_step_counter() -> None:
    """torch 2.11's AdamW makes its step counter as torch.tensor(0.0), no device (2.13's names the CPU): on the meta
    device its step's .item() failed. Every other tensor made in main is on the meta device."""
    seen: list[tuple[str, ...]] = []

    def main() -> None:
        engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2)
        optimizer = torch.optim.AdamW(engine.parameters())
        x, y = batch()
        engine.train_step(x if engine.first else None, y if engine.last else None)
        optimizer.step()
        steps = {state["step"].device.type for state in optimizer.state.values()}
        made = (
            torch.tensor(0.5),
            torch.tensor(3),
            torch.tensor([0.5]),
            torch.zeros(()),
            torch.tensor(1.0, device="meta"),
        )
        seen.append((*sorted(steps), *(t.device.type for t in made)))

    pipeengine.dry_run(main, 2, ranks=[1])
    assert seen == [("cpu", "cpu", "cpu", "meta", "meta", "meta")] * 2


def test_launch_runs_the_dry_run_its_environment_asks_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """PIPEENGINE_DRY_RUN_WORLD=8 PIPEENGINE_DRY_RUN_RANKS=3 python train.py: launch(main, 4, args) runs no rank and
    prints the dry run of rank 3 of 8, 4 a node (as torchrun --nproc-per-node 4 on 2 nodes would run it)."""
    monkeypatch.setenv("PIPEENGINE_DRY_RUN_WORLD", "8")
    monkeypatch.setenv("PIPEENGINE_DRY_RUN_RANKS", "3")
    launch(train, 4, args=(None, 2, 2))
    said = capsys.readouterr().out
    assert "dry run of 1 rank(s) of 8:" in said and "rank 3 of 8 (dp 0, pp 1, tp 1)" in said, said
    monkeypatch.setenv("PIPEENGINE_DRY_RUN_RANKS", "3,x")
    with pytest.raises(ValueError, match="PIPEENGINE_DRY_RUN_RANKS='3,x'.*give a whole number of ranks"):
        launch(train, 4, args=(None, 2, 2))


def main_compiled() -> None:
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, partition="uniform", compile=True)
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)
    layer = next(iter(engine.stages[engine.pp_rank].children()))
    assert layer._compiled_call_impl is not None  # traced by dynamo, differentiated by AOT autograd, on meta tensors


def test_compiled_stages_are_traced_on_the_meta_device() -> None:
    report = pipeengine.dry_run(main_compiled, 2, ranks=[0, 1])
    assert [r.steps for r in report.reports] == [1, 1]


def main_with_sample() -> None:
    x, y = batch()
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=4, partition="uniform", sample=x)
    engine.train_step(x if engine.first else None, y if engine.last else None)


def test_a_rank_s_peak_counts_the_activations_its_program_holds_measured_on_the_meta_device() -> None:
    """With sample=, the layers' saved activations are measured on the meta device (the ledger keys a meta storage by
    itself: every meta tensor's data is at address 0) as on the CPU; 1F1B's first of 2 ranks holds 2 micro-batches'
    at once, the last 1."""
    first, last = pipeengine.dry_run(main_with_sample, 2, ranks=[0, 1]).reports
    costs = pipeengine.measure(mlp(), batch()[0][:2])  # one micro-batch (8 rows / 4), on the CPU
    assert costs.activation_bytes is not None and all(costs.activation_bytes)
    for report, held, layers in ((first, 2, range(0, 2)), (last, 1, range(2, 4))):
        state = sum(state_bytes(costs.param_bytes[i]) for i in layers)
        assert report.activations_measured
        assert report.peak_bytes == state + held * sum(costs.activation_bytes[i] for i in layers)


def main_checkpointed(schedule: str = "1f1b") -> None:
    x, y = batch()
    engine = PipelineEngine(
        mlp(),
        nn.functional.mse_loss,
        num_microbatches=4,
        partition="uniform",
        sample=x,
        checkpoint="always",
        schedule=schedule,
    )
    engine.train_step(x if engine.first else None, y if engine.last else None)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_checkpointed_stage_holds_its_inputs_and_one_recomputation_at_its_peak(schedule: str) -> None:
    """1F1B (or ZB-H1, whose I recomputes) on 2 ranks, 4 micro-batches, every stage recomputed: rank 0 holds 2
    micro-batches' inputs (2 rows of WIDTH floats each) and, in a backward, one micro-batch's activations of its
    stage."""
    first = pipeengine.dry_run(main_checkpointed, 2, ranks=[0], args=(schedule,)).reports[0]
    costs = pipeengine.measure(mlp(), batch()[0][:2])
    state = sum(state_bytes(costs.param_bytes[i]) for i in range(2))
    activations = sum(costs.activation_bytes[i] for i in range(2))  # type: ignore[index]
    assert first.peak_bytes == state + 2 * (2 * WIDTH * 4) + activations


def main_features(directory: str) -> None:
    """bf16, a background save and a load of it in the same run."""
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, partition="uniform", precision="bf16")
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)
    saved = engine.save(directory, optimizer, background=True, step=7)
    assert saved.result().name == "checkpoint-1"  # type: ignore[union-attr]  (a Future, as a real background save)
    assert engine.load(directory, optimizer)["step"] == 7  # what the dry run's save would have written


def test_precision_a_background_save_and_its_load_run_as_for_real(tmp_path: Path) -> None:
    report = pipeengine.dry_run(main_features, 2, ranks=[0, 1], args=(str(tmp_path),))
    assert [r.steps for r in report.reports] == [1, 1] and not list(tmp_path.iterdir())  # nothing written


def main_tied() -> None:
    model = nn.Sequential(nn.Embedding(10, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 10, bias=False))
    model[2].weight = model[0].weight
    engine = PipelineEngine(model, nn.functional.cross_entropy, num_microbatches=2, partition=[2, 1])
    tokens = torch.randint(0, 10, (4,))
    engine.train_step(tokens if engine.first else None, tokens if engine.last else None)


def main_auto() -> None:
    x, y = batch()
    PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, schedule="auto", sample=x)


def main_fsdp() -> None:
    PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, data_parallel=2, fsdp=True)


def main_timed() -> None:
    x, y = batch()
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, sample=x)
    assert engine.partition.method == "parameters"


def test_what_a_dry_run_cannot_check_is_said_plainly() -> None:
    whole = pipeengine.dry_run(main_tied, 2, ranks=[1]).reports[0].parameters_whole
    assert whole == 10 * WIDTH + WIDTH * WIDTH + WIDTH  # the tied weight once
    with pytest.raises(ValueError, match="schedule='auto' measures the layers and this machine to choose a layout"):
        pipeengine.dry_run(main_auto, 2)
    with pytest.raises(ValueError, match="fsdp=True cannot be dry-run: FSDP2 will not train parameters on the meta"):
        pipeengine.dry_run(main_fsdp, 4)
    with pytest.warns(UserWarning, match="partition by time measures the layers on the device, and a dry run"):
        pipeengine.dry_run(main_timed, 2)
    with pytest.raises(ValueError, match=r"ranks=\[\]: name the ranks"):
        pipeengine.dry_run(main_timed, 2, ranks=[])


def main_for_cuda() -> None:
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, partition="uniform", device="cuda")
    x, y = batch()
    engine.train_step(x if engine.first else None, y if engine.last else None)
    assert engine.device == torch.device("meta")


def test_a_main_written_for_cuda_dry_runs_on_the_meta_device_here() -> None:
    assert [r.steps for r in pipeengine.dry_run(main_for_cuda, 2, ranks=[0, 1]).reports] == [1, 1]


def main_traced_clipped_evaluated() -> None:
    engine = PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, partition="uniform")
    x, y = batch()
    with engine.tracing():  # the clock pings keep their stamps on the CPU (Transport.control_device)
        engine.train_step(x if engine.first else None, y if engine.last else None)
    assert (engine.timeline() is not None) == (engine.pp_rank == 0)
    engine.clip_grad_norm_(1.0)
    out = engine.eval_step(x if engine.first else None)
    assert (out is None) if not engine.last else (out.shape == (8, WIDTH) and out.is_meta)  # type: ignore[union-attr]


def test_tracing_clipping_and_eval_run_in_a_dry_run() -> None:
    assert [r.steps for r in pipeengine.dry_run(main_traced_clipped_evaluated, 2, ranks=[0, 1]).reports] == [1, 1]
