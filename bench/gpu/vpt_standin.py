"""A stand-in for MineStudio's VPT-2x policy (OpenAI's foundation-model-2x), of the same shape and size,
for `make gpu-check`: MineStudio cannot travel to the GPU box (it pins numpy<2 and pulls its own CUDA
torch; with Ray it does not fit in the 64 MiB a command carries), so its VPTPolicy is not there.

What it shares with VPT-2x (MineStudio's minestudio/models/vpt/body.py with the foundation-model-2x
kwargs of bench/bench_trainer_memory.py), layer by layer:
- 128x128x3 frames through the IMPALA CNN in VPT's layout (channels 16-32-32 x width 8 = 128-256-256,
  2 blocks each, one-group GroupNorms, fan-in init: overworld.policies.impala), a 256-wide dense layer,
  then a 2048-wide one (VPT's ImgObsProcess);
- 4 residual transformer blocks of width 2048, 16 heads: LayerNorm, self-attention over the window and
  a memory of the previous 128 frames' keys and values (Transformer-XL style: the memory is the
  recurrent state, 8.4 MB per env as VPT's), "clipped causal" (every frame sees itself and the 127
  before it, never across an episode start), with VPT's content-dependent relative-position logits
  (10 basis functions over the 128 distances, mixed per head by a linear layer of the input) and
  VPT's 1/d attention scale; then a pointwise MLP 2048 -> 8192 -> 2048; both residual;
- a last 2048 dense layer with LayerNorm, a final LayerNorm, MineStudio's action heads (buttons 8641
  and camera 121 choices) and a scalar value head.
Trainable parameters: 248,495,291, exactly VPT-2x's as MineStudio builds it (its VPTPolicy has 3 more,
the value normaliser's frozen statistics, which Overworld keeps as buffers). The arithmetic per frame
is VPT-2x's (same layers, same widths); the attention kernels are PyTorch's, not VPT's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from overworld.policies.base import Policy, PolicyOutput, State
from overworld.policies.impala import NormedUnit, impala_encoder

BASIS = 10  # VPT's relative-attention basis functions


@dataclass(frozen=True)
class Shape:
    image: int = 128
    channels: tuple[int, ...] = (128, 256, 256)
    dense: int = 256
    hidden: int = 2048
    blocks: int = 4
    heads: int = 16
    memory: int = 128  # VPT-2x: attention_memory_size 256 - timesteps 128
    pointwise_ratio: int = 4
    actions: tuple[tuple[str, int], ...] = (("buttons", 8641), ("camera", 121))


VPT_2X = Shape()
# A small one of the same structure: the dry run, the tests.
TINY = Shape(image=32, channels=(4, 8, 8), dense=16, hidden=32, blocks=2, heads=2, memory=8, pointwise_ratio=2,
             actions=(("buttons", 11), ("camera", 5)))


def window_mask(first: torch.Tensor, valid: torch.Tensor, memory: int) -> torch.Tensor:
    """(B, T, M + T) bool: which keys (the M memory frames, then the window's T) each frame of the window
    may attend to: itself and the `memory - 1` frames before it, none before an episode start.
    first: (B, T) bool; valid: (B, M) bool, memory frames of the episode the window starts in."""
    B, T = first.shape
    M = valid.shape[1]
    episode = first.long().cumsum(1)  # episode number of each window frame, 0 = the memory's
    q = torch.arange(T, device=first.device).view(T, 1) + M  # absolute positions
    k = torch.arange(M + T, device=first.device).view(1, M + T)
    band = (k <= q) & (k > q - memory)  # (T, M + T)
    key_episode = torch.cat([torch.zeros(B, M, dtype=torch.long, device=first.device), episode], 1)
    key_ok = torch.cat([valid, torch.ones(B, T, dtype=torch.bool, device=first.device)], 1)
    same = key_episode.unsqueeze(1) == episode.unsqueeze(2)  # (B, T, M + T)
    return band.unsqueeze(0) & same & key_ok.unsqueeze(1)


class XLBlock(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        e, self.heads, self.memory = shape.hidden, shape.heads, shape.memory
        self.pre_norm = nn.LayerNorm(e)
        self.q = nn.Linear(e, e)
        self.k = nn.Linear(e, e, bias=False)
        self.v = nn.Linear(e, e, bias=False)
        self.proj = nn.Linear(e, e)
        self.rel_coef = nn.Linear(e, BASIS * shape.heads)  # per frame, per head: a mix of the basis
        self.rel_basis = nn.Parameter(torch.randn(BASIS, shape.memory) * 0.2)  # over distances 0..M-1
        self.mlp_in = NormedUnit(e, e * shape.pointwise_ratio, "layer", 1.0, conv=False)
        self.mlp_out = nn.Linear(e * shape.pointwise_ratio, e)
        for layer in (self.proj, self.mlp_out):
            nn.init.zeros_(layer.bias)
            layer.weight.data.mul_(0.5)

    def forward(self, x: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, E = x.shape
        H, M = self.heads, mem_k.shape[1]
        h = self.pre_norm(x)
        k_new, v_new = self.k(h), self.v(h)
        keys, values = torch.cat([mem_k.to(k_new.dtype), k_new], 1), torch.cat([mem_v.to(v_new.dtype), v_new], 1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, -1, H, E // H).transpose(1, 2)  # (B, H, L, d)

        # relative-position logits: for frame t and key j at distance t + M - j
        coef = self.rel_coef(h).view(B, T, H, BASIS).permute(0, 2, 1, 3)  # (B, H, T, n)
        by_distance = coef @ self.rel_basis.to(coef.dtype)  # (B, H, T, M)
        distance = (torch.arange(T, device=x.device).view(T, 1) + M - torch.arange(M + T, device=x.device).view(1, -1))
        rel = by_distance.gather(-1, distance.clamp(0, self.memory - 1).expand(B, H, T, M + T))
        bias = rel.masked_fill(~mask.unsqueeze(1), float("-inf"))
        attn = F.scaled_dot_product_attention(heads(self.q(h)), heads(keys), heads(values), attn_mask=bias,
                                              scale=1.0 / (E // H))  # VPT's muP factor 1/d
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, E))
        x = x + self.mlp_out(self.mlp_in(x))
        return x, keys[:, -M:], values[:, -M:]


class VPTStandIn(Policy):
    def __init__(self, shape: Shape = VPT_2X) -> None:
        super().__init__()
        self.shape = shape
        self.encoder = impala_encoder((3, shape.image, shape.image), list(shape.channels), 2, shape.hidden,
                                      dense=shape.dense, norm=True)
        self.blocks = nn.ModuleList([XLBlock(shape) for _ in range(shape.blocks)])
        self.last = NormedUnit(shape.hidden, shape.hidden, "layer", 1.0, conv=False)
        self.final_norm = nn.LayerNorm(shape.hidden)
        self.policy_head = nn.ModuleDict({k: nn.Linear(shape.hidden, n) for k, n in shape.actions})
        self.value_head = nn.Linear(shape.hidden, 1)
        for head in (*self.policy_head.values(), self.value_head):
            nn.init.orthogonal_(head.weight, 0.01)
            nn.init.zeros_(head.bias)

    def initial_state(self, batch_size: int) -> State:
        device = self.value_head.weight.device
        s, M = self.shape, self.shape.memory
        state = {"valid": torch.zeros(batch_size, M, dtype=torch.bool, device=device)}
        for i in range(s.blocks):
            state[f"k{i}"] = torch.zeros(batch_size, M, s.hidden, device=device)
            state[f"v{i}"] = torch.zeros(batch_size, M, s.hidden, device=device)
        return state

    def forward(self, obs: dict[str, torch.Tensor], state: State, first: torch.Tensor) -> tuple[PolicyOutput, State]:
        image = obs["image"]
        B, T = image.shape[:2]
        x = image.reshape(B * T, *image.shape[2:]).permute(0, 3, 1, 2).float() / 255.0
        x = self.encoder(x).reshape(B, T, -1)
        valid = state["valid"]
        mask = window_mask(first, valid, self.shape.memory)
        new_state: State = {}
        for i, block in enumerate(self.blocks):
            x, new_state[f"k{i}"], new_state[f"v{i}"] = block(x, state[f"k{i}"], state[f"v{i}"], mask)
        # memory frames stay usable while no episode started after them
        episode = first.long().cumsum(1)
        alive = torch.cat([valid & (episode[:, -1:] == 0), episode == episode[:, -1:]], 1)
        new_state["valid"] = alive[:, -self.shape.memory:]
        new_state = {k: v.float() if k != "valid" else v for k, v in new_state.items()}
        x = self.final_norm(self.last(F.relu(x)))
        logits = {k: head(x) for k, head in self.policy_head.items()}
        return PolicyOutput(logits, self.value_head(x).squeeze(-1)), new_state

    def value_head_modules(self) -> list[nn.Module]:
        return [self.value_head]

    def encoder_modules(self) -> list[nn.Module]:
        return [self.encoder]


def count_parameters(shape: Shape = VPT_2X) -> int:
    """Trainable parameters, counted without allocating them (the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in VPTStandIn(shape).parameters() if p.requires_grad)
