"""The second gloo group that carries messages to lower ranks: one per process group, made again after a new init."""

import datetime

import pytest
import torch
import torch.distributed as dist

from pipeengine.comm.gloo import second_group

WAIT = datetime.timedelta(seconds=30)


@pytest.mark.timeout(60)
def test_the_second_group_is_made_once_per_process_group_and_again_after_a_new_init() -> None:
    made = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            group = second_group((0,), WAIT)
            assert second_group((0,), WAIT) is group  # no second new_group
            assert dist.get_backend(group) == "gloo" and dist.get_process_group_ranks(group) == [0]
            value = torch.ones(3)
            dist.all_reduce(value, group=group)  # a live group
            assert value.tolist() == [1.0, 1.0, 1.0]
            made.append(group)
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]  # the first died with its world
