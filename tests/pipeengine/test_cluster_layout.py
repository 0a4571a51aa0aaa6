"""A layout on a cluster priced by hand (issue 59, first step): per-op rooflines, tensor parallelism's all-reduces,
the replicas' all-reduce and the optimizer on one pipeline rank; the schedule's replay on two; memory refused past
the device's. Injected ops and links: no processes, nothing measured."""

from __future__ import annotations

import pytest

from pipeengine.planner.cluster import Hardware, all_gather, all_reduce, reduce_scatter
from pipeengine.planner.cluster.costs import Op
from pipeengine.planner.cluster.layout import Layout, Runtime, Transformer, estimate, price
from tests.pipeengine.hardware import LINK, injected


def machine(memory: float = 80e9) -> Hardware:
    return injected(memory)


def model(layers: int = 4, ends: list[Op] | None = None) -> Transformer:
    """Each block: a matmul of 1e12 FLOPs (10 ms at 100 TFLOP/s) forward, twice that backward, and an element-wise
    op moving 1e9 bytes (1 ms at 1 TB/s) each way, whatever tp and the micro-batch (the pricing scales nothing)."""

    def block(tp: int, micro_batch: int) -> list[Op]:
        return [
            Op("mm", "matmul", "forward", 10**12, 10**6),
            Op("gelu", "other", "forward", 0, 10**9),
            Op("mm", "matmul", "backward", 2 * 10**12, 10**6),
            Op("gelu", "other", "backward", 0, 10**9),
        ]

    def head(tp: int, micro_batch: int) -> list[Op]:
        return list(ends or [])

    return Transformer(layers, 1024, 8, 512, 1000, 1e9, block, head)


ACCUMULATE = 6 / 1e12  # seconds a parameter to add a micro-batch's fp16 gradient to the kept one (6 bytes at 1 TB/s)


def test_one_pipeline_rank_costs_its_blocks_their_all_reduces_the_replicas_and_the_optimizer() -> None:
    hw = machine()
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=2, num_microbatches=3, recompute=True)
    priced = price(model(), layout, hw)
    activation = 2 * 512 * 1024 * 2  # b s h, fp16
    tp_ar = all_reduce(activation, 2, LINK)
    forward = 0.011 + 2 * tp_ar  # 10 ms of matmul, 1 ms element-wise, two all-reduces
    backward = 0.021 + 2 * tp_ar + 0.011 + 2 * tp_ar  # its own, and the recomputed forward with its all-reduces
    # 3 micro-batches through 4 blocks, no bubble on one rank; the 2nd and 3rd add their gradients to the 1st's
    pipeline = 3 * 4 * (forward + backward) + 2 * 1e9 / 2 * ACCUMULATE
    replicas = all_reduce(1e9 / 2 * 2, 4, LINK)  # this rank's half of the parameters, fp16 gradients
    optimizer = 1e9 / 2 * 38 / 1e12
    assert priced.parts["pipeline"] == pytest.approx(pipeline)
    assert priced.parts["data-parallel sync"] == pytest.approx(replicas)
    assert priced.step_s == pytest.approx(pipeline + replicas + optimizer)
    assert priced.tokens_per_s == pytest.approx(2 * 3 * 4 * 512 / priced.step_s)
    assert not priced.refused


def test_two_pipeline_ranks_pay_the_schedules_bubble_and_the_messages() -> None:
    hw = machine()
    one = price(model(), Layout(tp=1, pp=1, dp=1, micro_batch=1, num_microbatches=4, recompute=False), hw)
    two = price(model(), Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=4, recompute=False), hw)
    stage = 2 * (0.011 + 0.021) + 1e9 / 2 * ACCUMULATE * 3 / 4  # 2 blocks a stage; 3 of 4 backwards accumulate
    message = 1e-9 + 512 * 1024 * 2 / 100e9  # one activation, point to point
    assert one.parts["pipeline"] == pytest.approx(4 * 4 * (0.011 + 0.021) + 3 * 1e9 * ACCUMULATE)
    assert two.parts["pipeline"] == pytest.approx((4 + 2 - 1) * (stage + 2 * message))  # 1F1B: (m + p - 1) slots


def test_a_layout_past_the_devices_memory_is_priced_and_refused_saying_how_much() -> None:
    priced = price(model(), Layout(tp=1, pp=1, dp=1, micro_batch=1, num_microbatches=1), machine(memory=10e9))
    assert priced.peak_bytes > 10e9  # 16 bytes a parameter: 16 GB of state alone
    assert priced.refused.startswith("needs 14.9 GiB a device, the device has 9.3 GiB")


def test_the_embedding_is_the_first_stages_and_the_head_and_loss_the_last() -> None:
    """The ends' ops by stage: the lookup (1 ms) and its backward on the first, the head's matmul (10 ms) on the
    last: the slowest stage, whose slot the estimate counts (m + p - 1) times, carries the head alone."""
    ends = [
        Op("aten.embedding.default", "other", "forward", 0, 10**9),
        Op("aten.embedding_dense_backward.default", "other", "backward", 0, 10**9),
        Op("aten.mm.default", "matmul", "forward", 10**12, 0),
    ]
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=4, recompute=False)
    bare = Runtime(accumulate_bytes=0.0)
    without = estimate(model(), layout, machine(), runtime=bare).parts["pipeline"]
    priced = estimate(model(ends=ends), layout, machine(), runtime=bare).parts["pipeline"]
    assert priced - without == pytest.approx((4 + 2 - 1) * 0.010)  # not (0.001 + 0.001 + 0.010) / 2 a slot


def test_each_micro_batch_after_the_first_adds_its_gradients_to_the_kept_ones() -> None:
    """Runtime.accumulate_bytes a parameter at the memory's bandwidth, once for each of m - 1 micro-batches."""
    hw = machine()
    for m in (1, 4):
        layout = Layout(tp=2, pp=1, dp=1, micro_batch=1, num_microbatches=m, recompute=False)
        fused = price(model(), layout, hw, runtime=Runtime(accumulate_bytes=0.0)).parts["pipeline"]
        added = price(model(), layout, hw, runtime=Runtime(accumulate_bytes=6.0)).parts["pipeline"]
        assert added - fused == pytest.approx((m - 1) * 1e9 / 2 * ACCUMULATE)


def test_an_overlapped_all_reduce_shows_only_what_outlasts_the_last_backward_or_its_last_bucket() -> None:
    """torch's DDP (Runtime.overlap_grad_reduce): the replicas' all-reduce runs during the last micro-batch's
    backward; what the step still waits for is the rest, or the last bucket's all-reduce where the rest is less."""
    hw, bare = machine(), Runtime(accumulate_bytes=0.0)
    overlapped = Runtime(overlap_grad_reduce=True, bucket_bytes=1e6, accumulate_bytes=0.0)
    for layers in (1, 4):  # one block's backward (21 ms) is shorter than the all-reduce (30 ms); four are longer
        layout = Layout(tp=1, pp=1, dp=4, micro_batch=1, num_microbatches=2, recompute=False)
        whole = price(model(layers), layout, hw, runtime=bare).parts["data-parallel sync"]
        shown = price(model(layers), layout, hw, runtime=overlapped).parts["data-parallel sync"]
        assert whole == pytest.approx(all_reduce(2e9, 4, LINK)) == pytest.approx(0.03, rel=1e-6)
        assert shown == pytest.approx(max(all_reduce(1e6, 4, LINK), whole - layers * 0.021))
    assert shown == pytest.approx(all_reduce(1e6, 4, LINK))  # four blocks hide it all but the last bucket


def test_fsdp_gathers_the_weights_once_a_step_reduce_scatters_the_gradients_and_shards_the_state() -> None:
    """Each stage's fp16 weights all-gathered once a step and its gradients reduce-scattered once (pipeengine's FSDP2
    stages); the optimizer steps a shard; the fp32 master and moments (12 bytes a parameter) divided by dp, the whole
    fp16 weights and gradients (4 bytes) held."""
    hw, bare = machine(), Runtime(accumulate_bytes=0.0)
    copied = Layout(tp=2, pp=1, dp=4, micro_batch=1, num_microbatches=2, recompute=False)
    sharded = Layout(tp=2, pp=1, dp=4, micro_batch=1, num_microbatches=2, recompute=False, fsdp=True)
    one, fsdp = price(model(), copied, hw, runtime=bare), price(model(), sharded, hw, runtime=bare)
    gradients = 1e9 / 2 * 2  # this rank's half of the parameters, fp16
    assert fsdp.parts["data-parallel sync"] == pytest.approx(
        all_gather(gradients, 4, LINK) + reduce_scatter(gradients, 4, LINK)
    )
    assert fsdp.parts["pipeline"] == one.parts["pipeline"]
    assert fsdp.parts["optimizer"] == pytest.approx(one.parts["optimizer"] / 4)
    assert one.peak_bytes - fsdp.peak_bytes == pytest.approx(1e9 / 2 * (16 - 4 - 12 / 4))
    assert sharded.describe().endswith(" fsdp") and not copied.describe().endswith(" fsdp")


def split(layers: int = 4) -> Transformer:
    """model()'s block with its backward's matmul split: 1.2e12 FLOPs of I (12 ms), 0.8e12 of W (8 ms, marked)."""

    def block(tp: int, micro_batch: int) -> list[Op]:
        return [
            Op("mm", "matmul", "forward", 10**12, 10**6),
            Op("gelu", "other", "forward", 0, 10**9),
            Op("mm", "matmul", "backward", 12 * 10**11, 10**6),
            Op("gelu", "other", "backward", 0, 10**9),
            Op("mm", "matmul", "backward", 8 * 10**11, 10**6, weight=True),
        ]

    return Transformer(layers, 1024, 8, 512, 1000, 1e9, block, lambda tp, micro_batch: [])


def test_a_split_backward_defers_w_as_zero_bubble_places_it() -> None:
    """ZB-H1 on 2 ranks, 4 micro-batches of uniform stages: m slots and (p - 1) (F + I - W) of bubble, where 1F1B
    pays (p - 1) (F + I + W) (Qi et al. 2024, section 3); the estimate the search prunes by is that formula."""
    hw, bare = machine(), Runtime(accumulate_bytes=0.0)
    message = 1e-9 + 512 * 1024 * 2 / 100e9
    f, i, w = 2 * 0.011 + message, 2 * 0.013 + message, 2 * 0.008  # 2 blocks a stage; a message each way
    for schedule, bubble in (("1f1b", f + i + w), ("zb-h1", f + i - w)):
        layout = Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=4, schedule=schedule, recompute=False)
        replayed = price(split(), layout, hw, runtime=bare).parts["pipeline"]
        assert replayed == pytest.approx(4 * (f + i + w) + bubble)
        assert estimate(split(), layout, hw, runtime=bare).parts["pipeline"] == pytest.approx(replayed)
    v = Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=4, schedule="zb-v", chunks=2, recompute=False)
    assert price(split(), v, hw, runtime=bare).parts["pipeline"] < 4 * (f + i + w) + f + i - w  # V: less still
