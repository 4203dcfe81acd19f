"""fp8 (e4m3) frozen base weights for LoRA training on Hopper/Ada GPUs (`train.base_precision = "fp8"`).

`Fp8Linear` holds a frozen Linear's weight as float8_e4m3fn with one fp32 scale per output
channel (1 byte per weight + 4 per row, against bf16's 2 per weight). Its forward and its input
gradient are fp8 matmuls (`torch._scaled_mm`): activations and gradients are quantized per row
on the fly, weights once at load. The weight gets no gradient; LoRA (peft) wraps it as it wraps
any `nn.Linear` (it is one), and its adapter stays in bf16/fp32 (`compute_dtype` tells peft so).

What stays in bf16 (`inside_repeated_blocks`): every layer outside the model's repeated blocks
(diffusers' `_repeated_blocks`: FLUX's double/single blocks, Qwen-Image's and Z-Image's blocks,
SDXL's BasicTransformerBlock) — the patch/text/time embedders, the final norm and `proj_out`.
They hold < 1 % of FLUX.1's 12 B weights, so fp8 would save nothing there, and they sit at the
model's input and output, where a 2-4 % per-output error is not averaged away by the residual
stream. Inside the blocks, Linears narrower than 256 or not a multiple of 16 wide
(`_scaled_mm`'s alignment) stay bf16 too. Norms, convs and embeddings are never Linears here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from stages.core.errors import ResourceError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_WIDTH = 256
# Below this many rows (the modulation Linears see one row per sample: batch 1-4) a matmul is a
# matrix-vector product bound by reading the weight, so it runs dequantized in bf16 instead.
MIN_FP8_ROWS = 16
MIN_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) have fp8 tensor cores

Keep = Callable[[str, nn.Linear], bool]


def require_fp8_device(device: torch.device, key: str = "train.base_precision") -> None:
    """fp8 matmuls need an Ada/Hopper-class GPU; anything else is an error, never a quiet fallback."""
    if device.type != "cuda":
        raise ResourceError(f"{key} = 'fp8' needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper), "
                            f"but this stage runs on {device.type}. Set {key} = 'nf4' (4-bit, least memory, "
                            f"CUDA) or 'bf16' (dense), or 'auto'.")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ResourceError(f"{key} = 'fp8' needs fp8 tensor cores (compute capability >= 8.9: Ada, Hopper), "
                            f"but '{name}' is {cap[0]}.{cap[1]}. Set {key} = 'nf4' (least memory) or 'bf16'.")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3 values and one fp32 scale per row (M, 1), so that x ~ q * scale."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (weight.float() * scale[:, None]).to(dtype)


def _fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a (M, K) row-major e4m3 times b (K, N) column-major e4m3, row-wise scales, bf16 out."""
    return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T with W = q * scale[:, None]; backward gives x's gradient only (W is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.x_dtype = x.dtype
        if x.shape[0] < MIN_FP8_ROWS:
            return x.to(torch.bfloat16) @ dequantize(weight, scale).t()
        xq, x_scale = quantize_rows(x)
        return _fp8_matmul(xq, x_scale, weight.t(), scale[None, :])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        weight, scale = ctx.saved_tensors
        if grad.shape[0] < MIN_FP8_ROWS:
            return (grad.to(torch.bfloat16) @ dequantize(weight, scale)).to(ctx.x_dtype), None, None
        # dx = g W = (g * scale) q: the per-output scale lies on the contraction axis, so it is
        # folded into the gradient before its per-row quantization. _scaled_mm wants its second
        # operand column-major: one transposed copy of q (1 byte per weight, freed at once).
        gq, g_scale = quantize_rows(grad.float() * scale[None, :])
        q_colmajor = weight.t().contiguous().t()
        ones = torch.ones(1, weight.shape[1], device=grad.device, dtype=torch.float32)
        return _fp8_matmul(gq, g_scale, q_colmajor, ones).to(ctx.x_dtype), None, None


class Fp8Linear(nn.Linear):
    """A frozen Linear with e4m3 weights and per-output-channel fp32 scales (see the module doc)."""

    compute_dtype = torch.bfloat16  # what peft reads for the adapter's dtype (as for bitsandbytes' Linear4bit)

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a dense weight
        self.out_features, self.in_features = weight.shape
        # buffers, not parameters: the optimizer and diffusers' `model.dtype` look at parameters only
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device | str) -> "Fp8Linear":
        """Quantize one Linear on `device` (only this layer's dense weight is there, briefly)."""
        dense = linear.weight.detach().to(device)
        q, scale = quantize_rows(dense)
        bias = None if linear.bias is None else linear.bias.detach().to(device, torch.bfloat16)
        return cls(q, scale.squeeze(1), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = _Fp8LinearFn.apply(rows, self.weight, self.weight_scale).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _apply(self, fn: Any, recurse: bool = True) -> "Fp8Linear":
        # `model.to(torch.bfloat16)` casts every floating buffer, fp8 ones too; fp8 -> bf16 -> fp8 is
        # exact, so the weight is put back to e4m3 and the scales to fp32 after any such cast.
        super()._apply(fn, recurse)
        self.weight = self.weight.to(FP8)
        self.weight_scale = self.weight_scale.float()
        return self

    def dense_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8=e4m3"


def fp8_supported() -> bool:
    """Whether this process's GPU has fp8 tensor cores (train.base_precision = "auto" tries fp8 only then)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= MIN_CAPABILITY


def fp8_bytes(module: nn.Module) -> int:
    """Bytes of the fp8 weights and their scales (out*in + 4*out per layer; biases not counted)."""
    return sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4
               for m in module.modules() if isinstance(m, Fp8Linear))


def fp8_eligible(linear: nn.Linear, min_width: int | None = None) -> bool:
    out_f, in_f = linear.weight.shape
    return min(out_f, in_f) >= (min_width or MIN_WIDTH) and out_f % 16 == 0 and in_f % 16 == 0


def inside_repeated_blocks(model: nn.Module) -> Keep:
    """The default `keep`: True (stay bf16) for Linears outside the model's repeated blocks."""
    block_types = set(getattr(model, "_repeated_blocks", None) or ())
    if not block_types:
        raise ValueError(f"{type(model).__name__} names no _repeated_blocks; pass quantize_denoiser_fp8 a keep rule")
    inside: set[str] = set()
    for name, module in model.named_modules():
        if type(module).__name__ in block_types:
            inside.update(f"{name}.{sub}" for sub, _ in module.named_modules() if sub)
    return lambda name, linear: name not in inside


def quantize_denoiser_fp8(model: nn.Module, keep: Keep, device: torch.device | str,
                          min_width: int | None = None, move: bool = True) -> nn.Module:
    """Replace every eligible Linear that `keep(name, linear)` rejects by an Fp8Linear, layer by layer
    on `device`, then move the rest there (`move`): the dense model never sits whole on the GPU. Works
    on a model with LoRA attached too (it replaces the wrapped `base_layer`)."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and fp8_eligible(child, min_width) and not keep(name, child):
                setattr(parent, child_name, Fp8Linear.from_linear(child, device))
    if move:
        model.to(device)
    model.requires_grad_(False)
    return model


def quantize_fp8_nf4(model: nn.Module, fp8_blocks: int, device: torch.device | str, double_quant: bool,
                     min_width: int | None = None) -> nn.Module:
    """A dense bf16 `model` in host memory made the base of a plan that holds only its first `fp8_blocks`
    repeated blocks (forward order, `blockswap.repeated_blocks`) in fp8, as `train.base_precision = "fp8"`
    would (their eligible Linears e4m3, the rest of them bf16), and everything else in nf4 as diffusers'
    bitsandbytes load makes it (the other blocks and the Linears outside the blocks: the modulation and
    embedders, bf16 under a whole fp8 base). The planner picks this where the whole fp8 base does not fit
    the budget (stages/core/memory/train.py): an nf4 block holds ~0.56 of an fp8 block's bytes, and FLUX.2 klein's
    whole fp8 step at 1024 px was 0.77-0.81x nf4's (0.201 s against 0.248-0.2625 s with cuDNN attention;
    docs/performance.md). Each layer is quantized on `device` in turn; the dense model never sits on it whole."""
    from stages.core import blockswap
    from stages.core.nf4_blocks import quantize_nf4_by_block

    first = blockswap.repeated_blocks(model)[:fp8_blocks]
    inside = {id(m) for b in first for m in b.modules()}
    # the fp8 blocks' Linears: Fp8Linear below, or bf16 where too narrow for fp8; nf4 leaves them as they are
    kept = [name for name, m in model.named_modules() if id(m) in inside and isinstance(m, nn.Linear)]
    quantize_denoiser_fp8(model, lambda name, linear: id(linear) not in inside, device, min_width, move=False)
    return quantize_nf4_by_block(model, double_quant, device, 0, keep=kept)


def load_fp8_nf4(cls: Any, src: Any, subfolder: str, device: torch.device, fp8_blocks: int, double_quant: bool) -> nn.Module:
    """Read the bf16 base into host memory (mapped pages for bf16 safetensors) and make it
    `quantize_fp8_nf4`'s mixed base on `device`."""
    require_fp8_device(device)
    model = src.load(cls, subfolder, torch_dtype=torch.bfloat16)
    return quantize_fp8_nf4(model, fp8_blocks, device, double_quant)


def load_fp8_denoiser(cls: Any, src: Any, subfolder: str, device: torch.device) -> nn.Module:
    """`train.base_precision = "fp8"`: stream the safetensors shards of a diffusers folder (local or in the
    hub cache) tensor by tensor onto `device`, quantizing each block Linear's weight there as it
    arrives (`load_fp8_streamed`: host memory holds one tensor at a time). A single-file checkpoint, or
    a folder whose keys need diffusers' conversion, is read whole in bf16 into host memory first and
    quantized one Linear at a time (FLUX.1: a 24 GB bf16 read for 12 GB of fp8 on the GPU)."""
    require_fp8_device(device)
    files = src.weight_files(subfolder)
    model = load_fp8_streamed(cls, files, src.component_config(subfolder), device) if files else None
    if model is not None:
        return model
    model = src.load(cls, subfolder, torch_dtype=torch.bfloat16)
    return quantize_denoiser_fp8(model, inside_repeated_blocks(model), device)


def streams(model: nn.Module, stored: dict[str, str]) -> bool:
    """Whether `load_fp8_streamed` can fill `model` (built from its config, on the meta device is enough)
    from safetensors files whose headers hold these keys (`model_source.stored_dtypes`): exactly its
    state dict's. False for a single file (no files), an unreadable header, or a checkpoint whose keys
    diffusers converts on load, which an fp8 load reads whole in bf16 first. The train planner asks the
    same (its fp8 plan's host memory)."""
    return bool(stored) and stored.keys() == set(model.state_dict())


def load_fp8_streamed(cls: Any, files: list[Any], config: dict[str, Any], device: torch.device | str,
                      min_width: int | None = None) -> nn.Module | None:
    """The model `cls.from_pretrained(torch_dtype=bf16)` then `quantize_denoiser_fp8` give, built on the
    meta device (accelerate's `init_empty_weights`, as diffusers builds it) and filled from `files` one
    tensor at a time: a block Linear's weight is cast to bf16 on `device` and quantized there, every other
    tensor is cast as diffusers casts it (bf16, fp32 in the class's `_keep_in_fp32_modules`) and put on
    `device`. None when the files' keys are not exactly the model's (a checkpoint that diffusers converts
    on load): the caller reads it the ordinary way."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    from stages.core.model_source import stored_dtypes

    with init_empty_weights():
        model = cls.from_config(config)
    if not streams(model, stored_dtypes(files)):
        return None
    modules = dict(model.named_modules())
    keep = inside_repeated_blocks(model)
    targets = {name for name, m in modules.items()
               if type(m) is nn.Linear and fp8_eligible(m, min_width) and not keep(name, m)}
    fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    pending: dict[str, dict[str, Any]] = {}  # a target Linear's quantized weight or bias, until both came
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for key in h.keys():
                module_name, _, leaf = key.rpartition(".")
                tensor = h.get_tensor(key)
                if module_name not in targets:
                    dtype = tensor.dtype  # (accelerate would cast to the meta model's fp32 without one)
                    if tensor.is_floating_point():
                        dtype = torch.float32 if any(m in key.split(".") for m in fp32) else torch.bfloat16
                    set_module_tensor_to_device(model, key, device, value=tensor, dtype=dtype)
                    continue
                slot = pending.setdefault(module_name, {})
                if leaf == "weight":
                    q, scale = quantize_rows(tensor.to(torch.bfloat16).to(device))
                    slot["weight"] = (q, scale.squeeze(1))
                else:
                    slot["bias"] = tensor.to(torch.bfloat16).to(device)
                if "weight" in slot and ("bias" in slot or modules[module_name].bias is None):
                    parent_name, _, child = module_name.rpartition(".")
                    setattr(modules[parent_name], child, Fp8Linear(*pending.pop(module_name)["weight"], slot.get("bias")))
    model.to(device)  # the buffers diffusers does not save (rope tables) were built on the CPU
    model.requires_grad_(False)
    return model.eval()


def text_encoder_keep(model: nn.Module) -> Keep:
    """For text encoders (no repeated-block list): keep what the model itself keeps in fp32
    (T5's `wo`, whose activations overflow bf16's range in T5 v1.1) and the output head."""
    fp32_names = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    return lambda name, linear: name.endswith("lm_head") or any(n in name.split(".") for n in fp32_names)
