"""HiDream-I1's tiny random-weight pipeline, "hidream-i1" (stages.tiny builds and saves it).

Four text encoders of the real classes: two CLIPTextModelWithProjection (widths 32 and 64, their
projections concatenated into the 96-wide pooled vector; the real Long-CLIP L and G read up to 248
positions, which HiDreamImagePipeline needs for its 128-token CLIP prompts), a T5 encoder (32) and a
LlamaForCausalLM of 3 layers (48) whose tokenizer is a byte-level BPE with Llama 3's special tokens
and no pad token (the pipeline pads with its EOS). The transformer has one double- and one
single-stream block with the real MoE feed-forward (shared expert + 4 routed, 2 active) and reads
Llama states (0, 2), so a wrong layer shows; its `max_resolution` (32, 32) makes the padded
sequence of a non-square latent 256 tokens, a 64 px square's count (the real one: 128 x 128 latent
cells, 4096 tokens, a 1024 px square). FLUX.1's VAE (0.3611, 0.1159, no quant convs);
HiDream-I1-Full's static shift 3.0.
"""

from __future__ import annotations

from typing import Any

from stages.tiny.parts import (CLIP2_HIDDEN, CLIP_HIDDEN, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, HEAD_DIM,
                               T5_DMODEL, seeded, vae_kl)

LLAMA_HIDDEN = 48  # Llama-3.1-8B-Instruct: 4096 (different from T5's here, so a swapped projection fails)
LLAMA_LAYERS = (0, 2)  # indices into hidden_states[1:], one per block (real: 0..31, then 31 sixteen times)
CLIP_POSITIONS = 248  # Long-CLIP's max_position_embeddings
PIPELINE_CLASS = "HiDreamImagePipeline"
PIPELINE_EXTRA: dict[str, Any] = {}
TINY_DIMS: dict[str, dict[str, Any]] = {"hidream-i1": {
    "latent_channels": 16, "vae_scale_factor": 2, "image_multiple": 4,
    "text_hidden": {"text_encoder": CLIP_HIDDEN, "text_encoder_2": CLIP2_HIDDEN, "text_encoder_3": T5_DMODEL,
                    "text_encoder_4": LLAMA_HIDDEN},
    "max_sequence_length": {"tokenizer": 218, "tokenizer_3": 512},
    "transformer_in_channels": 16,
}}

LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def build_llama_tokenizer(model_max_length: int = 131072) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with Llama 3's specials: `<|begin_of_text|>` added in
    front by the post-processor, `<|eot_id|>` as EOS (Llama-3.1-8B-Instruct's), no pad token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from stages.tiny.tokenizers import CAPTION_WORDS, _dedupe, _whole_word_merges, bytes_to_unicode

    vocab: dict[str, int] = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    pieces = [p for text in (*(" " + w for w in CAPTION_WORDS), *CAPTION_WORDS) for p, _ in pre.pre_tokenize_str(text)]
    merges = _whole_word_merges([list(p) for p in _dedupe(pieces) if len(p) > 1], vocab)
    for tok in LLAMA_SPECIAL:
        vocab[tok] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL])
    bos = vocab["<|begin_of_text|>"]
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   model_max_length=model_max_length)


def _clip(tokenizer: Any, hidden: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, projection_dim=hidden,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_POSITIONS, hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).eval()


def _llama(tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=LLAMA_HIDDEN, intermediate_size=LLAMA_HIDDEN * 2, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)).eval()


def build_components(variant: str, seed: int) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImageTransformer2DModel

    from stages.families.common.flux1_tiny import t5_encoder
    from stages.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    clip_tok = build_clip_tokenizer(model_max_length=CLIP_POSITIONS)
    clip2_tok = build_clip_tokenizer(pad_token="!", model_max_length=CLIP_POSITIONS)
    t5_tok, llama_tok = build_t5_tokenizer(), build_llama_tokenizer()
    transformer = seeded(seed, lambda: HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=1,  # double-stream blocks (real 16)
        num_single_layers=1,  # real 32
        attention_head_dim=HEAD_DIM,  # real 128
        num_attention_heads=2,  # real 20
        caption_channels=[T5_DMODEL, LLAMA_HIDDEN],  # [T5, Llama]: real [4096, 4096]
        text_emb_dim=CLIP_HIDDEN + CLIP2_HIDDEN,  # the two CLIP projections: real 768 + 1280
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(8, 4, 4),  # sums to the head dim (real (64, 32, 32))
        max_resolution=(32, 32),
        llama_layers=list(LLAMA_LAYERS),
    ).eval())
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        "vae": seeded(seed, lambda: vae_kl(16, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, quant_convs=False)),
        "text_encoder": seeded(seed, lambda: _clip(clip_tok, CLIP_HIDDEN)),
        "tokenizer": clip_tok,
        "text_encoder_2": seeded(seed, lambda: _clip(clip2_tok, CLIP2_HIDDEN)),
        "tokenizer_2": clip2_tok,
        "text_encoder_3": seeded(seed, lambda: t5_encoder(t5_tok)),
        "tokenizer_3": t5_tok,
        "text_encoder_4": seeded(seed, lambda: _llama(llama_tok)),
        "tokenizer_4": llama_tok,
        "transformer": transformer,
    }
