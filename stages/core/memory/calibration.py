"""The planner's measured constants: each one's meaning and where its figure comes from.

Peaks are predicted from meta-device sizes (sizes.py) and these. Where a constant is an estimate, it
says so; `bench/memory.py` measures a plan's prediction against what the GPU allocated.
"""

GB = 2**30

# "auto" budget: left free for the CUDA context's growth and other processes' jitter.
AUTO_MARGIN_GB = 0.75
# A process's GPU memory outside torch's caching allocator (the CUDA context, cuBLAS/cuDNN handles, loaded kernels),
# which nvidia-smi counts and set_per_process_memory_fraction does not. NVML's per-process figure at each stage's
# peak on the H200 (torch 2.11 cu130) was 0.61-0.67 GB in encode-captions and cache-latents (text encoders, VAEs)
# and 0.73-0.84 GB in train, whose compiled kernels and CUDA graphs load more (bench/results/budget-grid/,
# bench/results/<family>/memory.*.json, bench/results/qwen-image-edit-2511/). A numeric --vram is the whole
# process: a stage's plan fits under it less its stage's figure (the top of its range, rounded up), so a
# fingerprint never depends on a measurement. CUDA_CONTEXT_GB is the denoiser stages' (train, sample).
CUDA_CONTEXT_GB = 0.85
STAGE_CONTEXT_GB = {"encode-captions": 0.70, "cache-latents": 0.70}
# Reserved over allocated memory: FLUX nf4 train 9.00/8.10 = 1.11, fp32 VAE 3.90/3.36 = 1.16 (bench/results/memory-flux-h200.json).
FRAGMENTATION = 1.12
# An nf4 weight: 4-bit codes plus one 8-bit absmax per 64 weights (double quantization).
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64
# Train activations of one DiT block in units of tokens x width x 2 bytes (estimates; FLUX.1-dev 512 px b1
# 8.9 GB over its bf16 weights; docs/performance.md): an un-checkpointed block keeps 17 (a family whose blocks keep
# less names them in `block_saved_units`), a checkpointed one its input (1), the block being run or recomputed works in 24.
BLOCK_SAVED_UNITS, CHECKPOINT_SAVED_UNITS, BLOCK_WORK_UNITS = 17.0, 1.0, 24.0
# runtime.keep_attention: a checkpointed block also keeps its attention output (1 unit) and softmax statistics (~1 % more).
ATTENTION_KEPT_UNITS = 1.02
# Tokens a sample from which a checkpointing plan says keep_attention would fit too: FLUX.1 Kontext at 1024 px,
# where it took the fp8 step from 0.969 to 0.825 s (bench/results/peers-kontext-1024-b1-{cudnn3,keepattn}.json).
KEEP_ATTENTION_HINT_TOKENS = 8704
# encode-captions: each text encoder's attention scores, bytes per element of batch x heads x tokens^2 (beside the
# per-token BLOCK_WORK_UNITS). Fitted on FLUX.1's nf4 T5-XXL, which reads 512 tokens with 64 heads and runs its
# attention with a float position bias: at --vram 6 batch 8 ran out of memory at the 5.96 GB cap and batch 1
# reserved 4.57 GB (H200, the preset as users run it; `bench/run.py budget-grid` records such rows), while
# 77-token captions at batch 8 reserved 4.54 (bench/results/memory-flux-512-h200.json).
# 8 bytes (fp32 scores and their softmax) puts batch 8 above that cap, batch 1 at 4.75 GB reserved.
ATTENTION_SCORE_BYTES = 8.0
# VAE encode work per pixel of one image (a video VAE: per pixel of each frame in flight), per VAE class (and
# patch size, where a class patchifies in some checkpoints only), sized so that x FRAGMENTATION covers what the fp32
# encode reserved with ~1 % to spare: AutoencoderKL 1.23 and 3.90 GB at 512 and 1024 px (allocated 1.10 and 3.36),
# the Qwen-Image VAE 1.68 and 5.12 GB (allocated 1.52 and 4.57) (bench/results/memory-{flux,qwen-image}-512-h200.json,
# memory-flux-h200.json, memory-qwen-image-8gb-slots-h200.json); FLUX.2's VAE (ERNIE-Image's, Ideogram 4's) 3.48 GB
# at 1024 px like AutoencoderKL's, whose encoder it shares; Wan 2.2's VAE (2x2 patches folded into channels first)
# 7.18 GB and LTX-2's 8.48 GB at 640 px and 33 frames (bench/results/{ernie-image,ideogram4,wan2.2-5b,ltx2}/).
# A class not listed is planned with the largest figure.
VAE_ELEMENTS_PER_PIXEL = {"AutoencoderKL": 820, "AutoencoderKLQwenImage": 1064, "AutoencoderKLFlux2": 820,
                          # Wan 2.1's VAE (Wan 2.2 A14B's): it allocated 7.03 and 15.21 GB encoding 33 frames at
                          # 640 and 960 px in fp32 (bench/results/tiling-video/); this figure plans them at
                          # 1.09x, as Wan 2.2's figure plans its VAE's allocated peak there (1.08-1.11x)
                          "AutoencoderKLWan": 900,
                          "AutoencoderKLWan/patch2": 470,  # Wan 2.2 TI2V-5B's, per frame of the 5 in flight
                          "AutoencoderKLLTX2Video": 56}  # every frame of the clip at once
# Tile side (px) of a tiled VAE encode, per VAE class; bench/tiling.py measures what tiling changes.
VAE_TILE_PIXELS = {"AutoencoderKL": 512, "AutoencoderKLQwenImage": 256, "AutoencoderKLWan": 256,
                   "AutoencoderKLLTX2Video": 512}  # LTX-2's own default tile (16 latent cells), every 384 px
# VAE classes that tile after patchifying their input, so that a tile above covers patch_size times its side in pixels
VAE_TILES_IN_PATCHES = ("AutoencoderKLWan",)
# train.optimizer's state per fp32 adapter parameter (beside its fp32 weight and gradient), bytes, rounded up from what each library keeps after its
# first steps on adapter-shaped parameters (tests/planner/test_adapter_memory.py measures it on the CPU): AdamW's
# two moments; 8-bit AdamW's two blockwise-quantized ones (2.09); Prodigy's moments, s and p0; the schedule-free
# ones' z (and AdamW's second moment; Prodigy+SF slices s and p0: 4.65); Adafactor's factored moments (0.28).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 3, "prodigy": 16, "prodigy_schedulefree": 5,
                         "adamw_schedulefree": 8, "adafactor": 1}
# The working memory one adapted Linear (in x out) makes for a moment beyond a LoRA layer's, as (bytes per
# in x out, bytes per in x in), measured on the CPU by tests/planner/test_adapter_memory.py: DoRA multiplies an
# fp32 identity of in x in through lora_A and lora_B into an fp32 delta weight, casts it, and takes the norm of
# weight + delta (14.2; an nf4 base's dequantized copy adds 2); LoHa rebuilds its Hadamard delta weight in the
# backward (18.0); LoKr its Kronecker one (9.98).
ADAPTER_TRANSIENT_BYTES = {"lora": (0, 0), "dora": (16, 4), "loha": (19, 0), "lokr": (10, 0)}
# What an adapted Linear keeps for the backward beyond LoRA, per token and output feature (DoRA: 1.56 measured).
ADAPTER_SAVED_BYTES_PER_TOKEN_OUT = {"lora": 0, "dora": 2, "loha": 0, "lokr": 0}
# Allocator margin of a block-swap plan beside its two fixed copy slots: Z-Image at 4 GB predicted 3.57, allocated
# 3.32, reserved 4.00 (bench/results/memory-zimage-4gb-slots-h200.json; memory-qwen-image-8gb-slots-h200.json).
SWAP_EXTRA_GB = 0.4
# train.base_precision = "auto": the precisions tried whole, in this order unless the family's
# `fp8_faster_from_tokens` puts fp8 first (compiled step times per family in docs/performance.md).
AUTO_BASE_PRECISIONS = ("bf16", "fp8", "nf4")
# CUDA graphs under a budget: the memory free at the capture was up to 0.25 GB below the planner's figure, and a
# step allocated ~0.13 GB beyond its activations and the LoRA's gradients (bench/results/memory-*-room-h200.json).
GRAPH_FREE_SLACK_GB, GRAPH_ACTIVATIONS_EXTRA_GB = 0.25, 0.13
# With those allowances the planner's capture room came out 0.92-0.99x the measured one (the same files): this covers the rest.
GRAPH_ROOM_MARGIN = 1.05
# A guided sample step may run the denoiser on the prompt and the negative prompt together.
CFG_BATCH = 2
