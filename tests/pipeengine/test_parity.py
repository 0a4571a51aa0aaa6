"""A pipelined model trains exactly like one process running the whole batch.

In-process (loopback threads) for every schedule and size; on real gloo ranks for the
schedules that exercise gloo's program (receives first), its second group, and several chunks.
"""

import pytest

from pipeengine import PipelineEngine
from tests.pipeengine import ranks as world
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.parity import OneProcess, check_eval, check_grads, model_parity
from tests.pipeengine.ranks import on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


def microbatch_counts(schedule: str, ranks: int) -> list[int]:
    # 1, p and more than p; interleaved needs a multiple of p, DualPipeV at least 2p
    if schedule == "dualpipe-v":
        return [2 * ranks]
    return [ranks, 2 * ranks] if schedule == "interleaved" else [1, ranks, 2 * ranks]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@on_ranks(4, timeout=60, in_process=True)  # 2 ranks: every schedule with every feature in the composition matrix
def test_loss_gradients_and_weights_equal_single_process(schedule: str) -> None:
    """model_parity for each m, one optimizer step per batch size for the largest m; the others keep the first size
    (a new shape is inferred anew on the meta device, the costliest part of these tests)."""
    ranks = world.size()
    ms = microbatch_counts(schedule, ranks)
    unit = 2 * ranks  # every batch size splits evenly for every m above
    # a transformer stack with tuple boundaries (an MLP with a batch norm: every schedule in the composition matrix)
    sizes = [3 * unit, unit]  # with the largest m, the batch size changes between the two optimizer steps
    for m in ms:
        steps = sizes if m == ms[-1] else sizes[:1] * len(sizes)
        model_parity("transformer", schedule, [m], steps, steps=len(steps))


@pytest.mark.timeout(180)
@on_ranks(4, timeout=90)
def test_on_real_gloo_ranks_the_transport_trains_like_one_process() -> None:
    # 4 processes: receives-first streams, the second group for downward messages, one and two chunks per rank
    # (interleaved and every other schedule on gloo processes: the composition matrix, test_resume)
    for schedule in ["1f1b", "zb-v"]:
        model_parity("transformer", schedule, [4, 8], [8, 16], steps=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["zb-v"])  # accumulation and eval with every schedule: the composition matrix
@on_ranks(2, timeout=60, in_process=True)
def test_gradients_accumulate_and_eval_train_eval_leaves_no_state(schedule: str) -> None:
    """Gradients accumulate over train_steps until zeroed; eval, train, eval leaves no stale state."""
    model_name, m = "transformer", 4
    build, loss_fn = MODELS[model_name]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule)
    x0, y0 = batch(model_name, 2 * m, seed=10)
    x1, y1 = batch(model_name, 4 * m, seed=11)

    out = check_eval(engine, one, x0, "eval before training")
    if not engine.last:
        assert out is None

    for x, y in ((x0, y0), (x1, y1)):  # no zero_grad in between: gradients add up
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one.step([(x, y)])
    check_grads(engine, one, f"{model_name} {schedule} two accumulated steps")

    check_eval(engine, one, x1, "eval after training")
    check_grads(engine, one, "eval does not touch gradients")


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_parameter_names_are_the_sequentials_on_every_rank() -> None:
    """named_parameters and state_dict use the nn.Sequential's own names, and together cover the model."""
    build, loss_fn = MODELS["transformer"]
    model = build()
    full = set(dict(model.named_parameters()))
    state_keys = set(model.state_dict())
    engine = PipelineEngine(model, loss_fn, num_microbatches=world.size() * 2, schedule="interleaved")
    local = [name for name, _ in engine.named_parameters()]
    assert set(local) <= full and set(engine.state_dict()) <= state_keys
    gathered = world.all_gather_object(list(engine.state_dict()))
    assert sorted(k for keys in gathered for k in keys) == sorted(state_keys), "the ranks' state_dicts tile the model"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["mlp", "transformer"])
@on_ranks(1, timeout=60, in_process=True)
def test_one_rank_with_several_chunks_hands_tensors_over_locally(model: str) -> None:
    """Interleaved with several chunks per rank: on one rank (stages 0..2 all here), every boundary is a local
    handoff."""
    model_parity(model, "interleaved", [1, 3], [6, 3], chunks=3)
