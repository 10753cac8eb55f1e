"""GDN recurrent state slots: per GDN layer, one recurrent state and one conv window per slot.

A running sequence owns one slot index for its whole life; every op reads and writes its state
in place at that index. A slot is zeroed when it is handed out, which is the state of an empty
prefix. `checkpoint_slots` more slots hold prefix checkpoints (`deltaspec.cache.prefix_cache`), and
one extra slot, `scratch_slot`, is never handed out: padding sequences of CUDA-graph buckets read
and write it. With speculative decoding each slot also has a replay log of `log_rows` rows per layer
(the inputs of rows being verified, `deltaspec.ops.gdn`): memory per sequence is one state plus
the log, whatever the draft length.
"""

import torch

from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.ops.gdn import GDNLog


class GDNStateCache:
    """`state[layer]` [num_slots, Hv, Dk, Dv], `conv[layer]` [num_slots, K-1, conv_dim], and with
    `log_rows` > 0 the replay logs `log[layer]` (GDNLog) and `conv_log[layer]` [num_slots, L, conv_dim]."""

    def __init__(self, config: ModelConfig, spec: CacheSpec):
        """The GDN layers of `config`, with `spec`'s running and checkpoint slots, dtypes and log rows."""
        num_layers, num_slots, checkpoint_slots = len(config.gdn_layer_ids), spec.streams, spec.checkpoint_slots
        num_k_heads, num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim, conv_kernel = config.gdn_conv_dim, config.linear_conv_kernel_dim
        state_dtype, conv_dtype, device, log_rows = spec.state_dtype, spec.dtype, spec.device, spec.log_rows
        self.checkpoint_slots = range(num_slots, num_slots + checkpoint_slots)
        self.scratch_slot = num_slots + checkpoint_slots
        running_slots = num_slots
        num_slots += checkpoint_slots + 1
        self.state = [
            torch.zeros((num_slots, num_v_heads, key_dim, value_dim), dtype=state_dtype, device=device)
            for _ in range(num_layers)
        ]
        self.conv = [
            torch.zeros((num_slots, conv_kernel - 1, conv_dim), dtype=conv_dtype, device=device)
            for _ in range(num_layers)
        ]
        log_dtype = torch.float64 if torch.float64 in (state_dtype, conv_dtype) else torch.float32

        def zeros(*shape, dtype=log_dtype):
            return torch.zeros((num_slots, log_rows, *shape), dtype=dtype, device=device)

        self.log = (
            [
                GDNLog(
                    k=zeros(num_k_heads, key_dim),
                    v=zeros(num_v_heads, value_dim),
                    g=zeros(num_v_heads),
                    beta=zeros(num_v_heads),
                )
                for _ in range(num_layers)
            ]
            if log_rows
            else [None] * num_layers
        )
        self.conv_log = (
            [zeros(conv_dim, dtype=conv_dtype) for _ in range(num_layers)] if log_rows else [None] * num_layers
        )
        self._free = list(range(running_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise DeltaspecError("All GDN state slots are in use; raise --max-num-seqs or run fewer sequences.")
        slot = self._free.pop()
        for state, conv in zip(self.state, self.conv):
            state[slot].zero_()
            conv[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy_slot(self, source: int, target: int) -> None:
        """Copy the recurrent state and conv window of slot `source` into slot `target`, every layer."""
        for state, conv in zip(self.state, self.conv):
            state[target].copy_(state[source])
            conv[target].copy_(conv[source])

    def bytes(self) -> int:
        logs = [t for log in self.log if log is not None for t in (log.k, log.v, log.g, log.beta)]
        logs += [t for t in self.conv_log if t is not None]
        return sum(t.numel() * t.element_size() for t in (*self.state, *self.conv, *logs))
