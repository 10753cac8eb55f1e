"""`PipelinePass`: one pass of a pipeline stage over a schedule, micro-batch by micro-batch
(`deltaspec.parallel.pipeline` holds the stage and its messages).

The schedule's sequences are cut, in order, into up to `micro_batches` groups of about equal rows (0: automatic, one
per stage where each group gets at least `AUTO_MICRO_BATCH_ROWS` rows, else one group: a micro-batch of few rows reads
every weight of the stage as the whole batch would, for a share of its rows, and costs about as much). For each group
the stage builds the group's batch, takes its residual stream (the first stage embeds the tokens; the others receive it
from the stage before), runs its layers and sends the stream on without waiting, so that stage s works on micro-batch
m + 1 while stage s + 1 works on m. The step needs its result only after the last micro-batch: the last stage's final
hidden states of every row, which it broadcasts to the other stages, so that every rank goes on from the same hidden
states as one process would. A micro-batch is a batch like any other (its sequences' own slots, pages, logs and
verify rows), so each stage's caches see exactly the passes one process would run, group by group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deltaspec.cache.model_caches import ModelCaches
from deltaspec.execution.batch import Scheduled, build_batch
from deltaspec.model.hybrid import HybridModel
from deltaspec.parallel.pipeline import Pipeline

AUTO_MICRO_BATCH_ROWS = 64  # the skinny products' last row bucket: fewer rows are bound by the weights' reads


def micro_batches(schedule: list[Scheduled], count: int) -> list[list[Scheduled]]:
    """`schedule` cut in order into at most `count` non-empty groups of sequences, of about equal rows each."""
    count = max(1, min(count, len(schedule)))
    total = sum(item.num_rows for item in schedule)
    groups: list[list[Scheduled]] = [[]]
    done = 0
    for index, item in enumerate(schedule):
        left = len(schedule) - index  # sequences not yet placed, this one included
        cut = done >= total * len(groups) / count or left == count - len(groups)  # or the rest must each open one
        if groups[-1] and len(groups) < count and cut:
            groups.append([])
        groups[-1].append(item)
        done += item.num_rows
    return groups


@dataclass
class PipelinePass:
    """This rank's stage (`pipeline`) and how many micro-batches a pass is cut into (0: automatic)."""

    pipeline: Pipeline
    micro_batches: int

    def run(
        self, model: HybridModel, caches: ModelCaches, schedule: list[Scheduled], block_size: int, device: torch.device
    ) -> torch.Tensor:
        """The final hidden states [T, hidden] of every row of `schedule`, on every stage."""
        started = time.perf_counter()
        stage, width, dtype = self.pipeline, model.config.hidden_size, model.rotary.dtype
        outputs, rows = [], 0
        count = self.micro_batches or min(stage.size, sum(item.num_rows for item in schedule) // AUTO_MICRO_BATCH_ROWS)
        for group in micro_batches(schedule, count):
            batch = build_batch(group, block_size, device)
            stream = None if stage.first_stage else stage.receive(batch.num_rows, width, dtype, device)
            hidden, _ = model.run(batch, caches, stream)  # [group rows, hidden]
            if stage.last_stage:
                outputs.append(hidden)
            else:
                stage.send(hidden)
            rows += batch.num_rows
        hidden = stage.finish(torch.cat(outputs) if outputs else None, rows, width, dtype, device)
        stage.pass_s += time.perf_counter() - started
        return hidden
