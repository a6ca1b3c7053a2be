"""Every linear layer of the native model goes through `Linear`, so a faster kernel
(int8, int4, a packed-weight library...) can be swapped in at one place.

A kernel is an object with ``__call__(x [.., in]) -> [.., out]``; with no kernel set the
layer is plain ``F.linear`` over the stored weight.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel: LinearKernel | None = None  # set by `set_kernel`; None means dense

    def set_kernel(self, kernel: LinearKernel | None) -> None:
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def linear_group(layers: tuple[Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Apply several layers to the same input. Kernels that can share the work (quantizing the
    input once, one parallel loop) expose ``group(kernels, x)``; otherwise one call each."""
    kernels = [layer.kernel for layer in layers]
    kind = type(kernels[0])
    group = getattr(kind, "group", None)
    if (
        group is not None
        and all(type(k) is kind for k in kernels)
        and len({layer.in_features for layer in layers}) == 1
    ):
        return group(tuple(kernels), x)
    return [layer(x) for layer in layers]
