"""Tokenizers of the real classes built offline from small in-memory vocabularies.

Nothing is downloaded and nothing is trained.  Each builder returns an instance of the class the
real pipelines use (transformers 5.x, ``tokenizers`` backend), which ``save_pretrained`` writes as
an ordinary ``tokenizer.json`` + ``tokenizer_config.json`` pair and ``from_pretrained`` reads back:

* :func:`build_clip_tokenizer` -> ``CLIPTokenizer``: byte-level BPE.  The alphabet is the 256
  GPT-2 byte symbols, each also with CLIP's ``</w>`` end-of-word suffix, plus a few whole-word
  merges for the words captions usually contain, so that "a red circle on a white background" is
  8 tokens, not 35.  ``model_max_length=77`` (FluxPipeline needs it set).
* :func:`build_t5_tokenizer` -> ``T5Tokenizer``: a Unigram model from a list of (piece, score):
  ``<pad>``=0, ``</s>``=1, ``<unk>``=2, single characters, whole caption words, 100 sentinels.
* :func:`build_qwen_tokenizer` -> ``Qwen2Tokenizer``: byte-level BPE with Qwen's special tokens
  (chat markers, Qwen2.5-VL vision tokens, tool / FIM tokens, and for Qwen3 ``<think>``) and a
  chat template.  Merges are added so that the words of the prompt templates of Qwen-Image and
  Z-Image are single tokens, as with the real vocabulary: the Qwen-Image system prefix is exactly
  :data:`QWEN_IMAGE_DROP_IDX` (34) tokens, which QwenImagePipeline drops from the hidden states.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CAPTION_WORDS",
    "QWEN_IMAGE_DROP_IDX",
    "QWEN_IMAGE_PROMPT_TEMPLATE",
    "QWEN2_5_VL_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "bytes_to_unicode",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
    "build_qwen_tokenizer",
]

# Words that get a token of their own (captions of the demo data set and of typical LoRA prompts).
CAPTION_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "on", "in", "and", "with", "at", "to", "is",
    "photo", "image", "picture", "drawing", "painting", "render", "style", "simple", "plain",
    "background", "shape", "shapes", "small", "large", "big", "tiny",
    "circle", "square", "triangle", "rectangle", "star", "dot",
    "red", "green", "blue", "yellow", "orange", "purple", "pink", "brown",
    "black", "white", "gray", "grey", "dark", "light", "cyan", "magenta",
    "left", "right", "top", "bottom", "center", "middle", "corner",
    "tall", "wide", "sks", "person", "dog", "cat", "man", "woman",
)

# QwenImagePipeline.prompt_template_encode / prompt_template_encode_start_idx (diffusers 0.42).
QWEN_IMAGE_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP_IDX = 34

# Special tokens of the real Qwen2.5 / Qwen3 vocabularies, in their real order (real ids 151643...).
_QWEN_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Added but not "special" in the real tokenizers (they are not stripped by skip_special_tokens).
_QWEN_ADDED = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
_QWEN3_ADDED = ("<tool_response>", "</tool_response>", "<think>", "</think>")

# A trimmed version of Qwen3's template: same rendering for plain chat messages, including the
# empty think block that `enable_thinking=False` appends to the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | select('defined') | join('') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Qwen2.5-VL's template (default system prompt, image / video placeholders).
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Texts whose words become single tokens in the Qwen vocabulary.
_QWEN_TEMPLATE_TEXTS = (
    QWEN_IMAGE_PROMPT_TEMPLATE.format(""),
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol table (the byte-level alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _apply_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Greedy BPE: merge the lowest-ranked adjacent pair (leftmost first) until none applies."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def _whole_word_merges(
    words: Iterable[list[str]], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Add merges (and their tokens to ``vocab``) so that each word, given as its initial symbols,
    ends as one token.  A new merge always has the lowest priority, so words already handled keep
    their single-token result (BPE only reaches a new merge once no earlier merge applies)."""
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for symbols in words:
        while True:
            out = _apply_bpe(symbols, ranks)
            if len(out) == 1:
                break
            pair = (out[0], out[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
    return merges


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


# --------------------------------------------------------------------------------------------- CLIP
def build_clip_tokenizer(pad_token: str = "<|endoftext|>", model_max_length: int = 77):
    """A ``CLIPTokenizer`` (byte-level BPE, CLIP's ``</w>`` suffix) from an in-memory vocabulary.

    ``pad_token``: CLIP ViT-L (FLUX, SDXL ``tokenizer``) pads with ``<|endoftext|>``; SDXL's
    ``tokenizer_2`` (OpenCLIP bigG) pads with ``"!"``.  Vocabulary: 512 byte symbols (with and
    without ``</w>``), whole-word merges for :data:`CAPTION_WORDS`, then ``<|startoftext|>`` and
    ``<|endoftext|>`` last (as in the real 49408-token vocabulary).
    """
    from transformers import CLIPTokenizer

    alphabet = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for s in alphabet:
        vocab[s] = len(vocab)
    for s in alphabet:
        vocab[s + "</w>"] = len(vocab)
    b2u = bytes_to_unicode()
    words = []
    for w in CAPTION_WORDS:
        syms = [b2u[b] for b in w.encode("utf-8")]
        syms[-1] = syms[-1] + "</w>"
        words.append(syms)
    merges = _whole_word_merges(words, vocab)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        pad_token=pad_token,
        model_max_length=model_max_length,
    )


# ----------------------------------------------------------------------------------------------- T5
def build_t5_tokenizer(model_max_length: int = 512, extra_ids: int = 100):
    """A ``T5Tokenizer`` (Unigram) from a list of (piece, score).

    ``<pad>``=0, ``</s>``=1, ``<unk>``=2 as in T5; then ``▁``, the printable ASCII characters with
    and without ``▁``, and ``▁word`` for :data:`CAPTION_WORDS` (scored so a known word is one
    piece); ``extra_ids`` sentinels ``<extra_id_N>`` are added as special tokens.  Characters
    outside printable ASCII map to ``<unk>`` (the real T5 vocabulary also lacks many).
    """
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    chars = [chr(c) for c in range(33, 127)]
    pieces += [("\u2581" + c, -8.0) for c in chars]
    pieces += [(c, -10.0) for c in chars]
    pieces += [("\u2581" + w, -5.0) for w in CAPTION_WORDS if len(w) > 1]
    seen: set[str] = set()
    unique = [p for p in pieces if not (p[0] in seen or seen.add(p[0]))]
    return T5Tokenizer(vocab=unique, extra_ids=extra_ids, model_max_length=model_max_length)


# --------------------------------------------------------------------------------------------- Qwen
def build_qwen_tokenizer(flavor: str = "qwen3", model_max_length: int = 32768):
    """A ``Qwen2Tokenizer`` (byte-level BPE) with Qwen's special tokens and a chat template.

    ``flavor="qwen2.5-vl"``: Qwen-Image's tokenizer (Qwen2.5-VL), its chat template, no think
    tokens.  ``flavor="qwen3"``: Z-Image's tokenizer (Qwen3), whose template understands
    ``enable_thinking``.  Both: ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``, no
    bos / unk, and every word of the prompt templates of both pipelines is a single token.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    if flavor not in ("qwen2.5-vl", "qwen3"):
        raise ValueError(f"flavor must be 'qwen2.5-vl' or 'qwen3', not {flavor!r}")
    b2u = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for s in b2u.values():
        vocab[s] = len(vocab)

    # Pre-tokenize the template texts and caption words exactly like Qwen2Tokenizer does.
    probe = Qwen2Tokenizer(vocab=dict(vocab), merges=[])
    pre = probe.backend_tokenizer.pre_tokenizer
    texts = list(_QWEN_TEMPLATE_TEXTS)
    texts += [" " + w for w in CAPTION_WORDS] + [w for w in CAPTION_WORDS]
    specials_all = _QWEN_SPECIAL + _QWEN_ADDED + _QWEN3_ADDED
    pieces: list[str] = []
    for text in texts:
        for sp in specials_all:
            text = text.replace(sp, "\x00")
        for chunk in text.split("\x00"):
            if chunk:
                pieces += [p for p, _ in pre.pre_tokenize_str(chunk)]
    words = [list(p) for p in _dedupe(pieces) if len(p) > 1]
    merges = _whole_word_merges(words, vocab)

    added = list(_QWEN_ADDED) + (list(_QWEN3_ADDED) if flavor == "qwen3" else [])
    for tok in list(_QWEN_SPECIAL) + added:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(_QWEN_SPECIAL[1:]),
        model_max_length=model_max_length,
        errors="replace",
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE if flavor == "qwen3" else QWEN2_5_VL_CHAT_TEMPLATE
    return tokenizer


# ------------------------------------------------------------------------------------------ Mistral
# The first special tokens of Mistral's Tekken vocabulary (Mistral Small 3.x), in its order: [IMG]
# is id 10, Mistral3Config's image_token_index default.
_MISTRAL_SPECIAL = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)

# A trimmed version of Mistral Small 3.x's template: BOS, the system message between
# [SYSTEM_PROMPT] markers, each user turn between [INST] markers (text blocks joined, an image block
# as [IMG]), an assistant turn followed by EOS. Rendering of (system, user) conversations is the real one's.
MISTRAL_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for block in content %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro -%}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text(message['content']) + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text(message['content']) + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text(message['content']) + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def build_mistral_tokenizer(extra_texts: tuple[str, ...] = (), model_max_length: int = 131072):
    """A byte-level BPE tokenizer (``TokenizersBackend``) with Mistral's special tokens, BOS added
    by the post-processor, ``<pad>`` padding and :data:`MISTRAL_CHAT_TEMPLATE`.

    The words of :data:`CAPTION_WORDS` and of ``extra_texts`` (e.g. a pipeline's system message)
    are single tokens, as most are in the real 131k-token vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(_MISTRAL_SPECIAL)}
    for s in bytes_to_unicode().values():
        vocab[s] = len(vocab)
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [*extra_texts, *(" " + w for w in CAPTION_WORDS), *CAPTION_WORDS]
    pieces = [p for text in texts for p, _ in pre.pre_tokenize_str(text)]
    merges = _whole_word_merges([list(p) for p in _dedupe(pieces) if len(p) > 1], vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _MISTRAL_SPECIAL])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=model_max_length)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer
