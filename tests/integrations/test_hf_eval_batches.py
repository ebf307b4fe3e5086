"""``EvalMicroBatches``: how RecycleTrainer cuts an eval set into ``eval_batch`` steps."""

from __future__ import annotations

import pytest

from ds_recycle.integrations.hf_trainer import EvalMicroBatches


def cut(samples: int, pipelines: int, micro_batches: int, size: int) -> EvalMicroBatches:
    return EvalMicroBatches(list(range(samples)), pipelines, micro_batches, size, collate_fn=list)


@pytest.mark.parametrize(
    "samples,pipelines,micro_batches,size", [(32, 2, 4, 2), (37, 2, 4, 2), (14, 1, 2, 2), (50, 3, 2, 4)]
)
def test_every_sample_once_in_order_except_a_tail_shorter_than_a_micro_batch_per_pipeline(
    samples, pipelines, micro_batches, size
):
    batches = cut(samples, pipelines, micro_batches, size)
    seen = []
    for step, count in enumerate(batches.steps()):
        assert 0 < count <= micro_batches
        load = batches.source(step)
        for home in range(pipelines):
            for mb in range(count):
                micro_batch = load(home, mb)
                assert len(micro_batch) == size
                seen += micro_batch
    assert seen == list(range(batches.samples))
    assert batches.left_out == samples - batches.samples < pipelines * size


def test_a_shorter_last_step():
    batches = cut(14, 1, 2, 2)
    assert batches.steps() == [2, 2, 2, 1] and batches.left_out == 0
    assert cut(37, 2, 4, 2).steps() == [4, 4, 1] and cut(37, 2, 4, 2).left_out == 1
