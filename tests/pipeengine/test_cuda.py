"""The CUDA path: NCCL on one GPU (one rank), and gloo ranks on CPU beside it. Skipped without a GPU."""

from pathlib import Path

import pytest
import torch

from tests.pipeengine.memory import traced_peak
from tests.pipeengine.parity import model_parity
from tests.pipeengine.ranks import on_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@on_ranks(1, timeout=120, device="cuda")  # a GPU (else skipped): NCCL
def test_one_cuda_rank_many_microbatches_on_streams(schedule: str) -> None:
    """model_parity with the engine on the GPU and the reference on the CPU."""
    model_parity("transformer", schedule, [4, 8], [8, 16], device="cuda")


@pytest.mark.timeout(300)
@on_ranks(1, device="cuda")
def test_one_cuda_rank_interleaved_chunks() -> None:
    model_parity("transformer", "interleaved", [2, 4], [8, 4], chunks=3, device="cuda")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@on_ranks(1, timeout=120, device="cuda")
def test_one_cuda_rank_predicts_its_measured_peak_memory(schedule: str, tmp_path: Path) -> None:
    import pickle

    traced_peak(schedule, "never", str(tmp_path / f"{schedule}.pickle"))  # without checkpointing
    measured, predicted, _, allocated, full = pickle.loads((tmp_path / f"{schedule}.pickle").read_bytes())
    assert abs(predicted[0] - measured[0]) <= 0.10 * measured[0], (predicted, measured)  # the ledger's lifetimes
    assert allocated is not None and abs(full[0] - allocated[0]) <= 0.10 * allocated[0], (full, allocated)


@pytest.mark.timeout(300)
@on_ranks(1, timeout=120, device="cuda")
def test_a_cuda_rank_saves_and_loads_and_a_damaged_checkpoint_changes_nothing(tmp_path: Path) -> None:
    """A CUDA rank saves after a step; a fresh engine of other weights loads it (whole, and then a damaged copy is
    refused leaving it as it was): weights and AdamW's state equal the saved ones."""
    from pipeengine import PipelineEngine
    from tests.pipeengine.models import batch, mlp, mse

    directory = str(tmp_path)
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, device="cuda")
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    x, y = batch("mlp", 4, seed=0)
    engine.train_step(x, y)
    optimizer.step()
    engine.save(directory, optimizer)
    fresh = PipelineEngine(mlp(seed=3), mse, num_microbatches=2, device="cuda")
    other = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load(directory, other)
    for (name, a), b in zip(engine.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert a.is_cuda and b.is_cuda and torch.equal(a, b), name
    saved, loaded = optimizer.state_dict()["state"], other.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)
    part = tmp_path / "checkpoint-1" / "part-0.pt"
    part.write_bytes(part.read_bytes()[:1000])
    before = {name: value.clone() for name, value in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"part-0\.pt cannot be read"):
        fresh.load(directory, other)
    assert all(torch.equal(before[name], value) for name, value in fresh.state_dict().items())


@pytest.mark.timeout(300)
def test_one_gpu_measures_a_hardware_description_the_planner_reads(tmp_path: Path) -> None:
    """--calibrate --hardware on this GPU (one process, no world): the matmuls (squares and a model's shape) and the
    copy measured against the preset's datasheet figures; the links kept, saying why; the file loads."""
    from pipeengine.planner.cli import main
    from pipeengine.planner.cluster import load

    out = tmp_path / "gpu.json"
    assert (
        main(
            ["--calibrate", "--hardware", "h100-sxm", "--out", str(out), "--shapes", "2048x8192x4096", "--repeats", "5"]
        )
        == 0
    )
    found = load(out)
    assert (
        found.sources["matmul_efficiency"].startswith("measured on ")
        and "2048x8192x4096" in found.sources["matmul_efficiency"]
    )
    assert found.sources["memory_bandwidth"].startswith("measured on ")
    assert found.sources["intra.bandwidth"].startswith("the preset's, not measured")
    print(
        f"\n{found.name}: matmul efficiency {found.matmul_efficiency:.3f}, "
        f"copy {found.memory_bandwidth / 1e9:.0f} GB/s\n{found.sources['matmul_efficiency']}"
    )
