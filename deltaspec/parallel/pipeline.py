"""`Pipeline`: this process's pipeline stage — the consecutive decoder layers it holds, the neighbours it trades
activations with, and the messages of one pass.

The layers split as evenly as possible, as vLLM splits them by default: every stage holds `L // P` layers, and the
`L % P` left over go one each to the stages just before the last (the last also runs the final norm). Ranks are laid
out stage by stage, `world rank = stage * T + tensor-parallel rank`; a stage's T ranks form its tensor-parallel group,
and a rank's neighbours are the ranks of the same tensor-parallel rank in the stages before and after it.

A pass (`deltaspec.execution.pipeline_pass`) runs micro-batch by micro-batch: a stage receives a micro-batch's residual
stream [rows, hidden] from the stage before it (the first embeds the tokens instead), runs its layers, and sends the
stream on without waiting (`send`), so it can start the next micro-batch while the next stage works on this one. The
last stage norms the stream; its final hidden states of every row are then broadcast to the other stages (`finish`),
so that every rank computes the same logits and MTP drafts from them, exactly as one process would. `waited_s` and
`pass_s` add up, per rank, the time spent waiting on another stage and the time of whole passes (the bubble).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError

DECODER_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")  # a decoder layer's parameter (not the MTP head's)


def check_stages(num_layers: int, size: int) -> None:
    """Refuse a pipeline with more stages than the model has layers."""
    if size > num_layers:
        raise DeltaspecError(
            f"--pipeline-parallel-size {size} asks for more stages than the model has layers ({num_layers}); give at "
            f"most {num_layers}."
        )


def stage_layers(num_layers: int, size: int, index: int) -> range:
    """The layers stage `index` of `size` holds: `num_layers // size` each, one more for each of the
    `num_layers % size` stages just before the last (vLLM's default split)."""
    counts = [num_layers // size] * size
    for stage in range(size - 1 - num_layers % size, size - 1):
        counts[stage] += 1
    start = sum(counts[:index])
    return range(start, start + counts[index])


def stage_config(config: ModelConfig, layers: range) -> ModelConfig:
    """The architecture of the caches a stage holding `layers` keeps: those layers' types only (its KV pages, GDN
    state slots and replay logs are its own layers')."""
    if len(layers) == config.num_hidden_layers:
        return config
    return replace(
        config,
        num_hidden_layers=len(layers),
        layer_types=config.layer_types[layers.start : layers.stop],
        moe_layers=config.moe_layers[layers.start : layers.stop],
    )


def holds(layers: range, name: str) -> bool:
    """Whether a stage holding `layers` holds parameter `name`: every decoder layer's of `layers`, and whatever is
    not a decoder layer's (embedding, final norm, LM head, MTP head), which every stage holds."""
    match = DECODER_LAYER_RE.match(name)
    return match is None or int(match.group(1)) in layers


@dataclass
class Pipeline:
    """Stage `index` of `size` (`layers` says which layers it holds). `previous` / `following`: the world ranks it
    receives from and sends to (None at the ends); `last`: the world rank of the last stage whose results it takes,
    and `results` the group that carries them (this tensor-parallel rank's process of every stage)."""

    index: int = 0
    size: int = 1
    previous: int | None = None
    following: int | None = None
    last: int = 0
    results: object = None
    waited_s: float = 0.0  # waiting on another stage: for a micro-batch's activations, or for the step's results
    pass_s: float = 0.0  # whole pipelined passes
    pending: list = field(default_factory=list)  # sends not yet completed: (work, tensor kept alive until then)

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage holds of a model of `num_layers`."""
        return stage_layers(num_layers, self.size, self.index)

    @property
    def staged(self) -> bool:
        return self.size > 1

    @property
    def first_stage(self) -> bool:
        return self.index == 0

    @property
    def last_stage(self) -> bool:
        return self.index == self.size - 1

    def receive(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The residual stream [rows, width] of the next micro-batch, from the stage before."""
        stream = torch.empty((rows, width), dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(stream, src=self.previous)
        self.waited_s += time.perf_counter() - started
        return stream

    def send(self, stream: torch.Tensor) -> None:
        """A micro-batch's residual stream [rows, width] to the stage after, without waiting for it to arrive."""
        stream = stream.contiguous()
        self.pending.append((dist.isend(stream, dst=self.following), stream))

    def finish(self, hidden: torch.Tensor | None, rows: int, width: int, dtype, device) -> torch.Tensor:
        """The pass's final hidden states [rows, width] on every stage: the last stage's `hidden`, broadcast to the
        others (which pass None), once this stage's sends have gone."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        if hidden is None:
            hidden = torch.empty((rows, width), dtype=dtype, device=device)
        started = time.perf_counter()
        dist.broadcast(hidden, src=self.last, group=self.results)
        if not self.last_stage:
            self.waited_s += time.perf_counter() - started
        return hidden


WHOLE = Pipeline()  # one stage: every layer, nothing sent
