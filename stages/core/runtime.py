"""Device, dtypes and global torch state for one stage process.

`stage_runtime(...)` is a context manager that sets TF32 / cuDNN flags for the stage and restores
the previous values when it ends, guards against the cuDNN-attention backward crash seen on the
H200 image, and measures peak VRAM.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from stages.core.errors import ResourceError
from stages.core.lazy import lazy_module

torch = lazy_module("torch")  # imported at first use: `status` and a no-op `run` need no torch


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # compute dtype of frozen weights and activations
    notes: list[str] = field(default_factory=list)  # what the runtime decided, for events

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class HostLoad(Runtime):
    """Where train loads a base of which the plan swaps `swapped_blocks` blocks (which ones:
    `swap_layout`, blockswap.swapped_positions): host memory (`device` is the CPU); `target` is the GPU
    it trains on (an nf4 base is quantized there block by block, stages/core/nf4_blocks.py)."""

    target: torch.device = field(default_factory=lambda: torch.device("cpu"))
    swapped_blocks: int = 0
    swap_layout: str = "last"


@dataclass
class MixedLoad(Runtime):
    """Where train loads an fp8 base of which the plan keeps only the first `fp8_blocks` repeated blocks in
    fp8 and the rest in nf4, to fit its budget (stages/core/fp8.py `quantize_fp8_nf4`)."""

    fp8_blocks: int = 0


@dataclass
class OffloadLoad(Runtime):
    """Where encode-captions loads a text encoder whose weights do not all fit its budget (layer
    offload, stages/families/text_encoders.py): `device` runs every layer but holds only
    `device_bytes` of weights (transformers' `device_map="auto"` + `max_memory`); accelerate keeps the
    rest in CPU memory and copies each offloaded layer's weights in for its forward."""

    device_bytes: int = 0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ResourceError("device = 'cuda' but torch sees no CUDA GPU (check `nvidia-smi` and that torch is a "
                            "CUDA build); set device = 'auto' or 'cpu'")
    return torch.device(name)


# What "auto" means per role, on CUDA (on CPU every role is fp32), where no memory plan chose
# (on CUDA each stage's plan resolves "auto" first, stages/core/memory/): the precision that plan
# tries first, bf16 for every role (memory.AUTO_BASE_PRECISIONS says why for the denoiser).
AUTO_ON_CUDA = {"denoiser": "bf16", "text_encoder": "bf16", "vae": "bf16"}


def device_type(name: str) -> str:
    """`pick_device(name).type` ("cpu", "cuda"), without importing torch where a process has not: "cpu" where no
    NVIDIA GPU can be seen (no driver, or CUDA_VISIBLE_DEVICES empty) or torch is a CPU build, else "cuda". So
    `status` and a no-op `run` learn their device without torch's import. A process that has imported torch asks
    it; a stage that finds no usable GPU after all says so when it picks its device."""
    import sys

    if name == "cpu" or (name == "auto" and not nvidia_gpu_possible()):
        return "cpu"
    if "torch" not in sys.modules and nvidia_gpu_possible():
        if torch_cuda_version() is not None:
            return "cuda"
        if name == "auto":
            return "cpu"
    return pick_device(name).type


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for, as `torch.version.cuda` gives it, read from its
    version.py without importing torch (None: a CPU build, or no torch found)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def nvidia_gpu_possible() -> bool:
    """Whether torch could see a CUDA GPU here: the NVIDIA driver lists a GPU (/proc/driver/nvidia/gpus, or a
    /dev/nvidia0 device) and CUDA_VISIBLE_DEVICES does not hide them all. False means torch.cuda.is_available()
    is False; True needs torch to tell."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = "/proc/driver/nvidia/gpus"
    return (os.path.isdir(gpus) and bool(os.listdir(gpus))) or os.path.exists("/dev/nvidia0")


def resolve_precision(precision: str, device: torch.device | str, role: str) -> str:
    """The one place "auto" becomes a concrete precision name, for `role` in AUTO_ON_CUDA (`device`: a
    torch.device or its type)."""
    if precision != "auto":
        return precision
    kind = device if isinstance(device, str) else device.type
    return AUTO_ON_CUDA[role] if kind == "cuda" else "fp32"


def precision_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Dense compute dtype for a precision name ('auto': bf16 on CUDA, fp32 on CPU)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "nf4": torch.bfloat16, "fp8": torch.bfloat16}[precision]


def _flags() -> dict[str, Any]:
    return {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
    }


def _set_flags(flags: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cuda.enable_cudnn_sdp(flags["cudnn_sdp"])


ATTENTION_NOTE = ("attention: flash or memory-efficient SDPA (cuDNN's is off in train; runtime.cudnn_attention = true "
                  "allows it, faster on Hopper)")


CUDNN_OPT_IN_NOTE = ("attention: cuDNN SDPA allowed (runtime.cudnn_attention = true), each output gradient in one "
                     "layout; if a step dies or the loss turns NaN, set runtime.cudnn_attention = false and resume")


def attention_notice(cudnn_attention: bool, capability: tuple[int, int] | None) -> str | None:
    """The info line train shows about attention: only where cuDNN's SDPA is off (the default) on a GPU
    where PyTorch would pick it (compute capability 9.0 and up); `capability` None: not on CUDA."""
    if cudnn_attention or capability is None or capability[0] < 9:
        return None
    return ATTENTION_NOTE


def translate_cudnn_crash(error: BaseException, cfg: Any, stage: str) -> Exception | None:
    """A CUDA error in train with runtime.cudnn_attention = true as one line that names the setting: cuDNN's
    attention is the known cause on this stack (FLUX.1 Kontext at 1024 px died in its first steps at every
    base, bench/results/peers-kontext-1024-b1-cudnn.json). None for any other error or setting: a CUDA error
    without the opt-in stays a bug with its traceback."""
    import sys

    from stages.core.errors import ResourceError

    torch_mod = sys.modules.get("torch")
    accelerator_error = getattr(torch_mod, "AcceleratorError", ()) if torch_mod is not None else ()
    crashed = isinstance(error, accelerator_error) or isinstance(error, RuntimeError) and "CUDA error" in str(error)
    if stage != "train" or not crashed or not getattr(getattr(cfg, "runtime", None), "cudnn_attention", False):
        return None
    from stages.core.config import command

    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ResourceError(
        f"train: a step died in a CUDA error ({first}) with runtime.cudnn_attention = true; cuDNN's attention has "
        f"crashed this way on this stack (FLUX.1 Kontext at 1024 px, before its backward got one gradient layout): "
        f"set runtime.cudnn_attention = false and resume with `{command(cfg, 'train', '--resume', '--set', 'runtime.cudnn_attention=false')}` "
        f"(checkpoints written before the error are kept)")


def global_flags() -> dict[str, Any]:
    """The global torch settings a stage may change (the restore test compares these)."""
    return _flags()


@functools.cache
def _one_grad_layout() -> Any:
    """An autograd Function (made on first use: its base class is torch's): identity on an attention output
    (B, H, S, D) whose backward hands the gradient on laid out as (B, S, H, D) in memory, the layout diffusers'
    attention output already has (a copy only where the gradient arrives otherwise, e.g. as a slice)."""

    class OneGradLayout(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad.transpose(1, 2).contiguous().transpose(1, 2)

    return OneGradLayout


def cudnn_safe_sdpa(sdpa: Any) -> Any:
    """`F.scaled_dot_product_attention` whose output gradient always reaches the backward in one layout.

    torch caches cuDNN's attention backward graph by the query/key/value shapes and strides only
    (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams), and with cuDNN >= 9.5.1 passes the output gradient on
    with whatever strides it has; the cached graph keeps the strides of the gradient it was built with.
    In FLUX.1 (and Kontext) the double- and single-stream blocks call attention with the same query/key/value
    layout, but a single-stream block concatenates the attention output with its MLP's before `proj_out`,
    so its gradient arrives as a slice (row stride 15,360 instead of 3,072). The backward runs the single
    blocks first: the graph is built for the slice and then reads the double blocks' dense gradients with
    the slice's strides, past their end: by this reading the illegal memory access FLUX.1 Kontext died of at
    8,704 tokens (bench/cudnn_flux_probe.py runs it with and without this). FLUX.2's single blocks take their
    value from a fused projection, a different cache key, which is why klein ran."""

    def safe(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = sdpa(*args, **kwargs)
        return _one_grad_layout().apply(out) if out.requires_grad and out.dim() == 4 else out

    return safe


@contextlib.contextmanager
def torch_flags(enable_tf32: bool, cudnn_benchmark: bool, disable_cudnn_attention: bool) -> Iterator[list[str]]:
    """Set the stage's global torch flags; restore the previous values on exit (even on error)."""
    saved = _flags()
    notes = []
    new = dict(saved)
    if enable_tf32:
        new.update(matmul_tf32=True, cudnn_tf32=True, float32_matmul_precision="high")
    new["cudnn_benchmark"] = cudnn_benchmark
    if disable_cudnn_attention:
        # torch 2.11 + cu130 on H200: cuDNN attention crashed in the backward pass of a FLUX LoRA
        # (illegal memory access / mha_graph.execute). Flash and memory-efficient SDPA are fine.
        new["cudnn_sdp"] = False
        notes.append(ATTENTION_NOTE)
    else:
        notes.append(CUDNN_OPT_IN_NOTE)
    _set_flags(new)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not disable_cudnn_attention:  # diffusers looks it up at each call: the stage's attention takes the guard
        torch.nn.functional.scaled_dot_product_attention = cudnn_safe_sdpa(sdpa)
    try:
        yield notes
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        _set_flags(saved)


def require_cuda_for_nf4(key: str, value: str, rt: Runtime) -> None:
    """nf4 on a machine without CUDA is an error, not a silent fallback: the user asked for 4-bit
    weights (memory), and fp32 on CPU would need ~8x the memory they planned for."""
    if value == "nf4" and not rt.is_cuda:
        raise ResourceError(f"{key} = 'nf4' needs a CUDA GPU (bitsandbytes 4-bit weights), but this stage runs on "
                        f"{rt.device.type}. Set {key} = 'auto' (bf16 on CUDA, fp32 on CPU) or 'fp32'.")


def has_accelerate() -> bool:
    """Whether the optional `accelerate` package is installed (transformers' and diffusers' `device_map`)."""
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def require_accelerate(what: str) -> None:
    """Layer offload goes through accelerate's dispatch (transformers' `device_map`): without it, say
    so before anything loads."""
    if not has_accelerate():
        raise ResourceError(f"{what} needs the 'accelerate' package, which is not installed: `pip install accelerate`, "
                            f"or give the stage more GPU memory (a larger --vram / gpu.vram_budget_gb) so nothing is offloaded")


def make_runtime(device: str, precision: str) -> Runtime:
    dev = pick_device(device)
    return Runtime(dev, precision_dtype(precision, dev))


def reset_peak(rt: Runtime) -> None:
    if rt.is_cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)


def peak_vram_gb(rt: Runtime, with_total: bool = True) -> dict[str, float]:
    """The stage's peaks in GB: what torch allocated and reserved and, on a GPU (`with_total`: a stage's summary,
    not each step), the process's context outside the allocator and the total as nvidia-smi counts it
    (reserved + context: what a `--vram` number budgets)."""
    if not rt.is_cuda:
        return {"allocated": 0.0, "reserved": 0.0}
    from stages.core.memory.budget import process_total_gb

    peaks = {"allocated": round(torch.cuda.max_memory_allocated(rt.device) / 2**30, 3),
             "reserved": round(torch.cuda.max_memory_reserved(rt.device) / 2**30, 3)}
    total = process_total_gb(rt.device) if with_total else None
    if total is not None:
        peaks["context"], peaks["total"] = round(total[0], 3), total[1]
    return peaks


def alloc_retries(rt: Runtime) -> int:
    """How often the caching allocator hit the memory cap, freed its cache and retried (0 on CPU)."""
    return int(torch.cuda.memory_stats(rt.device).get("num_alloc_retries", 0)) if rt.is_cuda else 0


# Library messages a user of this tool cannot act on, silenced at the logger that emits them.
QUIET_LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    # the optional `kernels` package (a faster CPU 4-bit gemm); bitsandbytes' own CPU path runs instead
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # ... which, with `kernels` installed (transformers >= 5.25 requires it) and the Hub offline, says it skips the
    # kernel repository's publisher check (the kernel is then not loaded: the same CPU path runs)
    "kernels._internals.hf_hub": ("Skipping publisher trust check for",),
    # image processors of pipelines we never run on images; the PIL fallback is what we would use
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back",),
    "transformers.modeling_utils": ("`torch_dtype` is deprecated",),
    # encode-captions tokenizes untruncated to count tokens, then truncates (and warns itself)
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer",),
    # Flux2Pipeline's own prompt encoding (sample) passes padding options to apply_chat_template as **kwargs
    "transformers.processing_utils": ("Kwargs passed to `processor.__call__` have to be in `processor_kwargs`",),
    # an exported FLUX/SDXL LoRA trains only the denoiser, so the text encoders have no keys by design
    "diffusers.loaders.lora_base": ("No LoRA keys associated to",),
    "diffusers.loaders.peft": ("No LoRA keys associated to",),
    "diffusers.loaders.lora_pipeline": ("No LoRA keys associated to",),
    # runtime.keep_attention's checkpoint policy under torch.compile (it saves the attention ops' outputs; the blocks
    # it checkpoints modify no tensor in place: tests/stages/test_trainer_paths.py compares its gradients to full checkpointing's)
    "torch._higher_order_ops.wrap": ("Detected that context_fn is passed to torch.utils.checkpoint under torch.compile",),
}
# (message regex, category, module regex) of Python warnings silenced the same way.
QUIET_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`torch_dtype` is deprecated", FutureWarning, r"diffusers\."),
    # the sample stage adds the trained adapter beside the base pipeline's; that is the point
    (r"Already found a `peft_config` attribute", UserWarning, r"peft\."),
)


@dataclass(frozen=True)
class LibraryNotices:
    """Library messages a family's pipelines print that are no news: logger name -> message fragments, and
    (message regex, warning class name, module regex) of Python warnings (declared in the family's folder)."""

    messages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    warnings: tuple[tuple[str, str, str], ...] = ()


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def verbose_requested() -> bool:
    """`--verbose` (the CLI sets LORAPIPE_VERBOSE=1) or LORAPIPE_DEBUG=1."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("LORAPIPE_VERBOSE", "LORAPIPE_DEBUG"))


def quiet_libraries(verbose: bool | None = None, notices: "LibraryNotices | None" = None) -> None:
    """Silence the libraries' messages listed above and their loading bars, at their sources (the
    loggers, warning filters and progress switches of bitsandbytes, transformers, diffusers, peft,
    huggingface_hub and autograd), and the families' own `notices` (stages.families.library_notices:
    what their pipelines print that is no news); `verbose` (default: `verbose_requested()`) restores them all."""
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    verbose = verbose_requested() if verbose is None else verbose
    messages, quiet_warnings = dict(QUIET_LOG_MESSAGES), list(QUIET_WARNINGS)
    for name, fragments in (notices.messages if notices else {}).items():
        messages[name] = messages.get(name, ()) + tuple(fragments)
    quiet_warnings += [(m, getattr(builtins, category), module) for m, category, module in (notices.warnings if notices else ())]
    for name, fragments in messages.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropMessages)]:
            logger.removeFilter(old)
        if not verbose:
            logger.addFilter(_DropMessages(fragments))
    patterns = {message for message, _, _ in quiet_warnings}
    warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] is not None and f[1].pattern in patterns)]
    for message, category, module in () if verbose else quiet_warnings:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    bars = [(diffusers_logging.enable_progress_bar, diffusers_logging.disable_progress_bar),
            (transformers_logging.enable_progress_bar, transformers_logging.disable_progress_bar),
            (hub_utils.enable_progress_bars, hub_utils.disable_progress_bars)]
    for enable, disable in bars:
        (enable if verbose else disable)()
    # GPU: LoRA grads made on the compute stream, accumulated on the default one (harmless here)
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(verbose)


def library_class(model: Any) -> str:
    """The diffusers/transformers class a model is: a project subclass (one that only adds a training
    forward, stages/families/qwen_image_21/denoiser.py) reports the library class it extends."""
    for cls in type(model).__mro__:
        if cls.__module__.split(".")[0] in ("diffusers", "transformers"):
            return cls.__name__
    return type(model).__name__


def install_model_trace(stage: str, notices: LibraryNotices | None = None) -> None:
    """Called at each stage's start: quiets the libraries and the families' `notices` (`quiet_libraries`), and if
    LORAPIPE_TRACE_MODELS names a folder, records every diffusers/transformers model class this
    process constructs into <folder>/<stage>.json at exit (the stage-isolation tests read it)."""
    quiet_libraries(notices=notices)
    folder = os.environ.get("LORAPIPE_TRACE_MODELS")
    if not folder:
        return
    path = Path(folder) / f"{stage}.json"
    seen: list[str] = []
    import diffusers
    import transformers

    for base in (diffusers.ModelMixin, transformers.PreTrainedModel):
        original = base.__init__

        def traced(self: Any, *args: Any, _orig: Any = original, **kwargs: Any) -> None:
            seen.append(library_class(self))
            _orig(self, *args, **kwargs)

        base.__init__ = traced  # type: ignore[method-assign]
    atexit.register(lambda: Path(path).write_text(json.dumps(sorted(set(seen)))))
