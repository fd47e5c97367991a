"""A MinePolicy by duck typing (no minestudio): a GRU core, MineStudio's list-of-tensors state with
merge_state/split_state, a pi_head giving log-softmax (B, T, 1, n) per action key like VPT's, and a
value head. Its forward takes no `first`: the adapter's generic path must reset the state itself."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HID = 16


class FakePiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"buttons": nn.Linear(HID, 8641), "camera": nn.Linear(HID, 121)})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: torch.log_softmax(h(x), -1).unsqueeze(2) for k, h in self.heads.items()}


class FakeMinePolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, HID)
        self.rnn = nn.GRU(HID, HID, batch_first=True)
        self.pi_head = FakePiHead()
        self.value_head = nn.Linear(HID, 1)

    def initial_state(self, batch_size: int | None = None) -> list[torch.Tensor]:
        return [torch.zeros(batch_size or 1, HID)]

    def merge_state(self, states: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.cat([s[0] for s in states], 0)]

    def split_state(self, state: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
        return [[state[0][i:i + 1]] for i in range(n)]

    def forward(self, input: dict[str, Any], state_in: list[torch.Tensor] | None = None,
                **kwargs: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
        x = input["image"].float().mean((2, 3)) / 255.0
        B = x.shape[0]
        h0 = state_in[0] if state_in is not None else torch.zeros(B, HID)
        y, h = self.rnn(self.enc(x), h0.unsqueeze(0).contiguous())
        return {"pi_logits": self.pi_head(y), "vpred": self.value_head(y)}, [h[0]]


def policy_generator() -> FakeMinePolicy:
    torch.manual_seed(0)
    return FakeMinePolicy()
