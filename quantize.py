"""Weight-only quantization of a checkpoint: int8 per channel, or int4 per group (gpt-fast's
quantize.py).

    python scripts/convert/quantize_checkpoint.py --mode int8        # the default model -> \
        model_int8.pth beside it
    python scripts/convert/quantize_checkpoint.py --checkpoint \
        checkpoints/<org>/<model>/model.pth --mode int4 --groupsize 32
                                                                     # -> model_int4.g32.pth
    python generate.py --checkpoint checkpoints/<org>/<model>/model_int4.g32.pth --specache \
        --prompt "..."

Every Linear of the transformer blocks and the output head is quantized; the token embedding stays
in its dtype (a lookup reads one row per token, so it costs no bandwidth). A head tied to the
embedding gets its own quantized copy: the head is read whole every step (on SmolLM2 a fifth of the
weights), the lookup keeps the exact table, and the file grows by that copy.

- int8: symmetric per output channel, w ~ q * s with s = max|w| / 127 and q in [-127, 127].
- int4: asymmetric per group of `groupsize` input channels, w ~ q * s + z with z = the group's min,
  s = (max - min) / 15 and q in [0, 15], two codes a byte (specache/lowbit.py's packing, low nibble
  first). Scales and zeros are stored in fp32 and cast to the model's dtype on load.

The files store this plain layout, not a device's tile format, so one file serves every device.
At run time, on a CPU, a few rows (decode: up to 16) go through kernels/linear_cpu.c, which reads
each 1- or half-byte code once and widens it in registers, at about the machine's read bandwidth
(scripts/bench/bench_quant.py measures it against inductor's fused multiply-reduce and torch's
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`); many rows (prefill) dequantize the weight,
then multiply. Without that kernel, compiled code fuses the unpacking, scaling and the
multiply-reduce of `model.linear`, and eager code uses torch's kernels. `dequantize_int8` and
`dequantize_int4` are the plain references the tests hold the modules to.
"""

import re
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kernels import linear_cpu
from specache.lowbit import pack_bits, unpack_bits
from model import Linear, Transformer, linear

QUANTIZED_NAME = re.compile(r"model_(int8|int4)(?:\.g(\d+))?\.pth$")


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float -> int8 codes (out, in) and fp32 scales (out,)."""
    w = weight.float()
    scales = w.abs().amax(-1).clamp(min=1e-12) / 127
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def dequantize_int8(codes: Tensor, scales: Tensor) -> Tensor:
    return codes.float() * scales.float()[:, None]


def check_groupsize(in_features: int, groupsize: int) -> None:
    if in_features % groupsize or groupsize % 2:
        raise ValueError(
            f"int4 needs an even group size that divides every Linear's input width; "
            f"{in_features} is not a multiple of {groupsize}"
        )


def quantize_int4(weight: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out, in) float, in a multiple of groupsize -> packed codes (out, in/2) uint8, fp32 scales
    and
    zeros (out, in/groupsize)."""
    out_features, in_features = weight.shape
    check_groupsize(in_features, groupsize)
    w = weight.float().view(out_features, in_features // groupsize, groupsize)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_bits(codes.view(out_features, in_features), 4), scales, lo


def dequantize_int4(packed: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    out_features, groups = scales.shape
    in_features = packed.shape[1] * 2
    codes = unpack_bits(packed, 4, in_features).view(out_features, groups, in_features // groups)
    return (codes.float() * scales.float()[..., None] + zeros.float()[..., None]).view(
        out_features, in_features
    )


def few_rows_on_cpu(x: Tensor) -> bool:
    """Whether kernels/linear_cpu.c takes x: a CPU tensor of a few rows (decode), the kernel
    built."""
    return (
        x.device.type == "cpu"
        and x.shape[:-1].numel() <= linear_cpu.MAX_ROWS
        and linear_cpu.available()
    )


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 codes with one scale per output channel.

    On a CPU: kernels/linear_cpu.c for up to 16 rows (decode); for more (prefill) the dequantized
    weight and a matmul. Without that kernel, or on a GPU, the codes are cast and multiplied in the
    step, which inductor fuses into one pass over them; eager CPU code uses `_weight_int8pack_mm`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def bytes_read(self) -> int:
        """What one forward pass reads of the weights."""
        return sum(t.nbytes for t in (self.weight, self.scales, self.bias) if t is not None)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[:-1].numel()
        if few_rows_on_cpu(x):
            y = linear_cpu.quantized_linear(
                x.reshape(rows, -1).float(), self.weight, self.scales.float()
            )
            return self.add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))
        eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        if eager_cpu and rows <= 8:  # decode
            flat = x.reshape(-1, self.in_features)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales.to(x.dtype))
            y = y.reshape(*x.shape[:-1], self.out_features)
        # prefill, where _weight_int8pack_mm is slow: dequantize once, then multiply
        elif eager_cpu:
            y = F.linear(x, dequantize_int8(self.weight, self.scales).to(x.dtype))
        # the per-channel scale commutes with the sum over the input, so it applies to the output
        else:
            y = linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return self.add_bias(y)

    def add_bias(self, y: Tensor) -> Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Int4Linear(nn.Module):
    """A Linear whose weight is 4-bit codes with a scale and zero per group of input channels.

    On a CPU with kernels/linear_cpu.c, the stored layout stays: up to 16 rows (decode) go through
    the kernel, more (prefill) dequantize and multiply. Otherwise `pack()` (load_model calls it on
    the model's device) builds torch's packed int4 layout for `_weight_int4pack_mm_for_cpu` on a CPU
    or `_weight_int4pack_mm` on a GPU, which take bf16 activations and scales:
    w = (q - 8) * scale + (zero + 8 * scale); packing drops the stored layout, so that the weights
    are
    not held twice. Unpacked and without the kernel, the module dequantizes and multiplies (the
    reference path).
    """

    def __init__(
        self, in_features: int, out_features: int, groupsize: int, bias: bool = False, device=None
    ):
        super().__init__()
        check_groupsize(in_features, groupsize)
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        groups = in_features // groupsize
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, groups, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)

    def packable(self) -> bool:
        """The shapes torch's packed kernels take: out a multiple of 16 (CPU); on a GPU also in a
        multiple of 128 (8 inner k-tiles of 16)."""
        if self.weight.device.type == "cuda":
            return self.out_features % 16 == 0 and self.in_features % 128 == 0
        return self.out_features % 16 == 0

    def pack(self) -> None:
        """Build the device's packed layout from the stored codes (on a CPU or a CUDA GPU); a shape
        the packed kernels do not take stays on the reference path. On a CPU with
        kernels/linear_cpu.c, the stored layout stays, its scales and zeros in float32 as the kernel
        takes them."""
        if self.weight.device.type == "cpu" and linear_cpu.available():
            self.scales, self.zeros = (
                self.scales.float().contiguous(),
                self.zeros.float().contiguous(),
            )
            return
        if not self.packable():
            return
        codes = unpack_bits(self.weight, 4, self.in_features).to(torch.int32)
        # gpt-fast's layout: two codes a byte, the even one high
        if self.weight.device.type == "cuda":
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8
            )
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
        scales = self.scales.float()
        self.scales_and_zeros = (
            torch.stack([scales.t(), (self.zeros.float() + 8 * scales).t()], -1)
            .contiguous()
            .to(torch.bfloat16)
        )
        self.weight = self.scales = self.zeros = None

    def bytes_read(self) -> int:
        """What one forward pass reads of the weights."""
        tensors = (
            (self.weight, self.scales, self.zeros)
            if self.packed is None
            else (self.packed, self.scales_and_zeros)
        )
        return sum(t.nbytes for t in tensors + (self.bias,) if t is not None)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None and few_rows_on_cpu(x):
            y = linear_cpu.quantized_linear(
                x.reshape(-1, self.in_features).float(),
                self.weight,
                self.scales.float(),
                self.zeros.float(),
                self.groupsize,
            )
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        elif self.packed is None:
            y = linear(x, dequantize_int4(self.weight, self.scales, self.zeros).to(x.dtype))
        else:
            flat = torch.ops.gptfast.int4_matmul(
                x.reshape(-1, self.in_features), self.packed, self.groupsize, self.scales_and_zeros
            )
            y = flat.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


@torch.library.custom_op("gptfast::int4_matmul", mutates_args=())
def int4_matmul(x: Tensor, packed: Tensor, groupsize: int, scales_and_zeros: Tensor) -> Tensor:
    """x (M, K) @ the packed int4 weight (N, K).T -> (M, N) in x's dtype, through bf16 as torch's
    kernels want. One opaque op under torch.compile: inductor would otherwise fuse the cast to bf16
    into the CPU FlexAttention template before it, which it cannot build."""
    matmul = (
        torch.ops.aten._weight_int4pack_mm
        if x.is_cuda
        else torch.ops.aten._weight_int4pack_mm_for_cpu
    )
    return matmul(x.to(torch.bfloat16), packed, groupsize, scales_and_zeros).to(x.dtype)


@int4_matmul.register_fake
def _(x, packed, groupsize, scales_and_zeros):
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])


def pack_int4(model: nn.Module) -> None:
    """Pack every Int4Linear for the device it is on (after loading and moving the model)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.pack()


def quantized_linears(model: Transformer) -> list[tuple[str, nn.Module, str, Linear]]:
    """(state-dict key, parent, attribute, Linear) of every Linear that quantization replaces: all
    but the embedding."""
    found = []
    for prefix, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):
                found.append((f"{prefix}.{name}" if prefix else name, parent, name, child))
    return found


def replace_linears(
    model: Transformer,
    mode: str,
    groupsize: Optional[int] = None,
    state_dict: Optional[dict] = None,
) -> None:
    """Swap every Linear for its quantized form; quantize its weight into `state_dict` when given
    (else the new modules are empty, for loading a quantized file)."""
    for key, parent, name, layer in quantized_linears(model):
        has_bias = layer.bias is not None
        device = layer.weight.device
        if mode == "int8":
            new = Int8Linear(layer.in_features, layer.out_features, has_bias, device=device)
        else:
            new = Int4Linear(
                layer.in_features, layer.out_features, groupsize, has_bias, device=device
            )
        if state_dict is not None:
            if mode == "int8":
                state_dict[f"{key}.weight"], state_dict[f"{key}.scales"] = quantize_int8(
                    layer.weight.detach()
                )
            else:
                (
                    state_dict[f"{key}.weight"],
                    state_dict[f"{key}.scales"],
                    state_dict[f"{key}.zeros"],
                ) = quantize_int4(layer.weight.detach(), groupsize)
            if has_bias:
                state_dict[f"{key}.bias"] = layer.bias.detach().float()
        setattr(parent, name, new)


def quantized_state_dict(model: Transformer, mode: str, groupsize: Optional[int] = None) -> dict:
    """The checkpoint of `model` quantized (the model itself is modified: its Linears are
    replaced)."""
    state_dict = {"tok_embeddings.weight": model.tok_embeddings.weight.detach()}
    for name, tensor in model.state_dict().items():
        if "norm" in name:
            state_dict[name] = tensor
    replace_linears(model, mode, groupsize, state_dict)
    return state_dict


def parse_quantized_name(path: Path) -> Optional[tuple[str, Optional[int]]]:
    """('int8', None) for model_int8.pth, ('int4', 32) for model_int4.g32.pth, None otherwise."""
    match = QUANTIZED_NAME.search(path.name)
    if match is None:
        return None
    mode, groupsize = match.group(1), match.group(2)
    if (mode == "int4") != (groupsize is not None):
        return None
    return mode, None if groupsize is None else int(groupsize)


def output_name(mode: str, groupsize: Optional[int]) -> str:
    return "model_int8.pth" if mode == "int8" else f"model_int4.g{groupsize}.pth"
