"""GDN recurrent state slots: per GDN layer, one recurrent state and one conv window per slot.

A running sequence owns one slot index for its whole life; every op reads and writes its state
in place at that index. A slot is zeroed when it is handed out, which is the state of an empty
prefix.
"""

import torch

from deltaspec.errors import DeltaspecError


class GDNStateCache:
    """`state[layer]` [num_slots, Hv, Dk, Dv] and `conv[layer]` [num_slots, K-1, conv_dim]."""

    def __init__(self, num_layers: int, num_slots: int, num_v_heads: int, key_dim: int, value_dim: int,
                 conv_dim: int, conv_kernel: int, state_dtype: torch.dtype, conv_dtype: torch.dtype,
                 device: torch.device):
        self.state = [torch.zeros((num_slots, num_v_heads, key_dim, value_dim), dtype=state_dtype, device=device)
                      for _ in range(num_layers)]
        self.conv = [torch.zeros((num_slots, conv_kernel - 1, conv_dim), dtype=conv_dtype, device=device)
                     for _ in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

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

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.state, *self.conv))
