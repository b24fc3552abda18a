#!/usr/bin/env python3
"""Regenerates kiln-tokenizer's golden fixtures from the reference Python tokenizers.

Run by hand, never by CI or tests. transformers' GGUF reader imports torch (a CPU build will do):

    python3 -m venv /tmp/tokvenv
    /tmp/tokvenv/bin/pip install torch transformers tokenizers gguf sentencepiece jinja2 numpy
    cargo xtask fetch-model && cargo xtask fetch-model gemma-3-270m
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python   # its sdist vendors llama.cpp
    tar xzf llama_cpp_python-*.tar.gz
    /tmp/tokvenv/bin/python scripts/make_tokenizer_fixtures.py \
        --llama-cpp-sdist llama_cpp_python-*/vendor/llama.cpp [--models models] [--only NAME]

It writes, under `crates/kiln-tokenizer/tests/fixtures/`, for one corpus (CORPUS: every Unicode
class the pre-tokenizer regexes name):

- `smollm2/` (tokenizer.json, tokenizer_config.json, chat_template.jinja) and
  `smollm2_golden.json`: the default model's tokenizer as transformers builds it from the GGUF,
  with ids, offsets, decodes and chat renderings.
- `gemma3_golden.json` and `gemma3/chat_template.jinja`: Gemma 3's SentencePiece tokenizer as
  transformers builds it from `gemma-3-270m-q4_k_m.gguf` (its 33 MB tokenizer.json is not kept:
  the tests read the GGUF), and renderings of Gemma 3's template by `apply_chat_template`.
- `qwen2/ggml-vocab-qwen2.gguf` (the real Qwen2/Qwen3 vocabulary, llama.cpp's vocabulary-only
  file), `qwen2/qwen3_chat_template.jinja` (llama.cpp's copy of Qwen3-0.6B's template) and
  `qwen2_golden.json`: ids from Qwen2's tokenizer as its tokenizer.json defines it, checked first
  against llama.cpp's own ids for that file (`.inp`/`.out`), and Qwen3 template renderings
  (system prompt, thinking, `enable_thinking=False`, tools).
- `pretok_golden.json`: how each model family whose `tokenizer.ggml.pre` kiln maps splits the
  corpus before BPE, with the pre-tokenizer its own tokenizer.json declares.

One correction is applied to what transformers builds for SmolLM2. The file names its
pre-tokenizer `tokenizer.ggml.pre = smollm`; transformers (5.24) has no entry for that name and
falls back to plain GPT-2 byte-level splitting, while the model's own tokenizer (and llama.cpp's
`smollm`, which it groups with `starcoder`) first splits every numeric character on its own
(`Digits(individual_digits=True)`, which isolates any `\p{N}` character, not only ASCII digits).
The two differ on text like " ½" or " Ⅻ". The script installs the model's pre-tokenizer and
records, per case, the ids transformers would give without the correction when they differ
(`ids_transformers_unpatched`), so the difference stays visible. Likewise transformers leaves
out the NFC normalizer of Qwen's tokenizer.json, which the script puts back.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

from tokenizers import Regex, normalizers, pre_tokenizers
from transformers import AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "crates", "kiln-tokenizer", "tests", "fixtures")

CORPUS = [
    "The capital of France is",
    "Hello, world!",
    "Once upon a time",
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     inner      spaces",
    "tabs\tand\ttabs\t\t\tmore",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings",
    "\n\n\n",
    " \t \n \t ",
    "It's, we're, they've, I'm, you'll, he'd -- contractions.",
    "UPPER lower MiXeD CaSe",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 0xFF 1,000,000",
    "Dates 2024-11-29 and times 09:53:07",
    "Fractions ½ ¾, superscripts x² y³, Roman Ⅻ, Arabic-Indic ٣٤٥, fullwidth １２３",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}",
    "<div class=\"box\">&nbsp;<a href='https://example.invalid/?q=1&r=2'>link</a></div>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文文本：今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다.",
    "Русский текст: Привет, мир! Ёжик.",
    "Ελληνικά: Γειά σου Κόσμε",
    "עברית ועربي: مرحبا بالعالم",
    "हिन्दी में पाठ",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308 (decomposed) vs é à ñ ö (composed)",
    "Zalgo: Z\u0351\u0353\u0300A\u0346\u0315L\u031aG\u0300O",
    "Zero\u200bwidth\u200djoiner\ufeffbom",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text<|im_start|>",
    "<repo_name>kiln<file_sep>src/main.rs<filename>x<gh_stars>10",
    "<|im_start|><|im_start|><|im_end|>",
    "< |im_start| > not special",
    "a" * 64,
    "ab" * 40,
    "!!!???...,,,;;;:::---___===+++***",
    "~`@#$%^&*()[]{}|\\/<>",
    "A sentence with a URL https://example.invalid/path?x=1 and an email a.b@example.invalid.",
    "Mixed: café naïve coöperate résumé Ångström façade",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≥ 0 ⇒ √(x²) = |x|",
    "Currency: $100, €200, £300, ¥400, ₹500, ₿0.01",
    "Long word: pneumonoultramicroscopicsilicovolcanoconiosis",
    "   \n\tindented code block\n\t\tdeeper\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "\u00a0non-breaking\u00a0space and\u3000ideographic space",
    "Control chars: \x01\x02\x7f end",
    "Private use: \ue000\U000f0000",
    # Each Unicode class the pre-tokenizer regexes name, on its own and after a space.
    " ½ ¾ ⅓ Ⅻ ⅷ ² ³ ¹ ① ⑳ ٣ ١٢٣ ０ ９ 𝟘 ߁",
    "x½ 1½ ½1 -½ (½) 12½%",
    "\u0301 \u0301a a\u0301\u0301 \u200d \u093c \u0958 \u0915\u093c \uac00 \u1100\u1161",
    "¡Hola! ¿Qué? «quotes» „German“ ‘single’ — en–dash … ‽ ※",
    "Symbols: © ® ™ ° ± × ÷ ∞ ≈ ≠ ∑ ∫ ♠ ♥ ★ ☆ ✓ ✗ → ← ↑ ↓ ⌘ ⏎",
    "Emoji runs: 😀😀😀 a😀b 😀 1😀 🏳️‍🌈 👩🏾‍💻 #️⃣ 🫠",
    "CJK mixed: 漢字kanji かな123 カナ。中文，English；한글!",
    "Digit runs: 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 00000000001",
    "Contractions: I'M YOU'LL IT'S WE'VE THEY'RE HE'D don't can't o'clock rock'n'roll 'tis",
    "Curly contractions: it’s we’re they’ve",
    "Whitespace runs:a  b   c    d\t\te\n\nf\r\n\r\ng \n h\t \t",
    "   ",
    "\n \n",
    "trailing newline spaces \n   ",
    "Line sep\u2028para sep\u2029vertical\x0btab\x0cform\x1cfs\x85nel",
    "Mixed scripts: abcабвαβγ אבג ابت",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke\nabout Rust."},
    ],
    [
        {"role": "user", "content": "  spaces and <|im_end|> inside  "},
        {"role": "assistant", "content": "ok"},
    ],
]


# Gemma 3 and Qwen3 conversations: system prompts, several turns, and Qwen3's thinking and
# tool paths.
GEMMA_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Tell me a joke\nabout Rust.  "},
    ],
    [
        {"role": "user", "content": "<start_of_turn> inside"},
        {"role": "assistant", "content": " ok "},
    ],
]

# Keys in sorted order at every level: the Rust tests read conversations with serde_json, whose
# maps sort their keys (its `preserve_order` feature is off in this workspace), while `tojson`
# keeps the order it is given.
QWEN_TOOLS = [
    {
        "function": {
            "description": "Weather for a city",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"description": "City name", "type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
        "type": "function",
    }
]

QWEN_CONVERSATIONS = [
    ({"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    (
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello."},
                {"role": "user", "content": "Tell me a joke\nabout Rust."},
            ]
        }
    ),
    ({"messages": [{"role": "user", "content": "Think less."}], "enable_thinking": False}),
    (
        {
            "messages": [
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, "type": "function"}
                    ],
                },
                {"role": "tool", "content": "sunny, 21 C"},
                {"role": "assistant", "content": "It is sunny."},
            ],
            "tools": QWEN_TOOLS,
        }
    ),
]

# The official Qwen3 template (Qwen/Qwen3-0.6B), as llama.cpp vendors it in models/templates/.
QWEN3_TEMPLATE_IN_SDIST = "models/templates/Qwen-Qwen3-0.6B.jinja"
QWEN2_VOCAB_IN_SDIST = "models/ggml-vocab-qwen2.gguf"

# Gemma 3's chat template. No shipped copy was found in a registry package (llama.cpp vendors
# Gemma 2's and Gemma 4's only), so this is the published Gemma 3 template as written here; the
# renderings below come from transformers' own `apply_chat_template` on this text.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def read_gguf_field(model, key):
    from gguf import GGUFReader

    field = GGUFReader(model).fields.get(key)
    return field.contents() if field is not None else None


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_gguf_tokenizer(model):
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)), gguf_file=os.path.basename(model))


def encode_cases(tok, backend, corpus, unpatched=None):
    """Ids with and without special tokens, offsets and decodes of every text."""
    cases = []
    for text in corpus:
        with_special = backend.encode(text, add_special_tokens=True)
        without = backend.encode(text, add_special_tokens=False)
        # The transformers front end must agree with the backend it wraps.
        assert tok(text)["input_ids"] == with_special.ids, text
        extra = {}
        if unpatched is not None:
            backend.pre_tokenizer, patched = unpatched, backend.pre_tokenizer
            raw_ids = backend.encode(text, add_special_tokens=True).ids
            backend.pre_tokenizer = patched
            if raw_ids != with_special.ids:
                extra["ids_transformers_unpatched"] = raw_ids
        cases.append(
            {
                "text": text,
                "ids": with_special.ids,
                "ids_no_special": without.ids,
                "offsets": [list(o) for o in with_special.offsets],
                "decode": backend.decode(with_special.ids, skip_special_tokens=False),
                "decode_skip_special": backend.decode(with_special.ids, skip_special_tokens=True),
                **extra,
            }
        )
    return cases


def write_json(name, value):
    with open(os.path.join(FIXTURES, name), "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


def save_tokenizer_files(tok, out_dir, names):
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in names:
            src = os.path.join(tmp, name)
            dst = os.path.join(out_dir, name)
            if os.path.exists(src):
                shutil.copyfile(src, dst)
            elif os.path.exists(dst):
                os.remove(dst)


def smollm2(model):
    """The default model: tokenizer files, ids, decodes and chat renderings."""
    tok = load_gguf_tokenizer(model)
    backend = tok.backend_tokenizer
    unpatched = backend.pre_tokenizer
    gguf_pre = read_gguf_field(model, "tokenizer.ggml.pre")
    if gguf_pre == "smollm" and unpatched.__class__.__name__ == "ByteLevel":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    else:
        unpatched = None
    save_tokenizer_files(
        tok, os.path.join(FIXTURES, "smollm2"), ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    )
    cases = encode_cases(tok, backend, CORPUS, unpatched)
    chats = []
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "rendered": rendered})
    write_json(
        "smollm2_golden.json",
        {
            "generated_by": "scripts/make_tokenizer_fixtures.py",
            "model_file": os.path.basename(model),
            "model_sha256": sha256_of(model),
            "tokenizer_ggml_pre": gguf_pre,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "vocab_size": backend.get_vocab_size(with_added_tokens=True),
            "cases": cases,
            "chats": chats,
        },
    )
    print(f"smollm2: {len(cases)} cases, {len(chats)} chat renderings")


def gemma3(model):
    """Gemma 3's SentencePiece vocabulary as transformers builds it from the GGUF, and its chat
    template rendered by transformers. Its tokenizer.json (33 MB) is not committed: the tests read
    the GGUF from the models folder."""
    tok = load_gguf_tokenizer(model)
    backend = tok.backend_tokenizer
    cases = encode_cases(tok, backend, CORPUS)
    out_dir = os.path.join(FIXTURES, "gemma3")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(GEMMA3_TEMPLATE)
    chats = []
    for messages in GEMMA_CONVERSATIONS:
        for add_generation_prompt in (False, True):
            rendered = tok.apply_chat_template(
                messages, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "rendered": rendered})
    specials = {name: getattr(tok, f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")}
    write_json(
        "gemma3_golden.json",
        {
            "generated_by": "scripts/make_tokenizer_fixtures.py",
            "model_file": os.path.basename(model),
            "model_sha256": sha256_of(model),
            "special_ids": specials,
            "add_bos_token": tok.add_bos_token,
            "vocab_size": backend.get_vocab_size(with_added_tokens=True),
            "special_added_ids": sorted(i for i, t in tok.added_tokens_decoder.items() if t.special),
            "cases": cases,
            "chats": chats,
        },
    )
    print(f"gemma3: {len(cases)} cases, {len(chats)} chat renderings")


def qwen_reference(vocab_gguf):
    """Qwen2's tokenizer as its own tokenizer.json defines it, over the real vocabulary in
    llama.cpp's `ggml-vocab-qwen2.gguf`: transformers builds it from the GGUF (vocabulary,
    merges, specials, the qwen2 split regex), and the NFC normalizer of Qwen's tokenizer.json,
    which that conversion leaves out, is put back."""
    tok = load_gguf_tokenizer(vocab_gguf)
    backend = tok.backend_tokenizer
    backend.normalizer = normalizers.NFC()
    # Qwen's tokenizer.json keeps offsets untrimmed.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    # llama.cpp's own test file pairs texts with the ids the real Qwen tokenizer gave them.
    inp = open(vocab_gguf + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    out = open(vocab_gguf + ".out", encoding="utf-8").read().split("\n")
    for text, want in zip(inp, out):
        got = backend.encode(text, add_special_tokens=False).ids
        assert got == [int(x) for x in want.split()], (text, got, want)
    return tok, backend


def qwen(sdist_dir):
    vocab = os.path.join(sdist_dir, QWEN2_VOCAB_IN_SDIST)
    tok, backend = qwen_reference(vocab)
    out_dir = os.path.join(FIXTURES, "qwen2")
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(vocab, os.path.join(out_dir, "ggml-vocab-qwen2.gguf"))
    with open(os.path.join(sdist_dir, QWEN3_TEMPLATE_IN_SDIST), encoding="utf-8") as f:
        template = f.read()
    with open(os.path.join(out_dir, "qwen3_chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    cases = encode_cases(tok, backend, CORPUS)
    chats = []
    for conv in QWEN_CONVERSATIONS:
        for add_generation_prompt in (False, True):
            kwargs = {k: v for k, v in conv.items() if k != "messages"}
            rendered = tok.apply_chat_template(
                conv["messages"],
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            chats.append({**conv, "add_generation_prompt": add_generation_prompt, "rendered": rendered})
    write_json(
        "qwen2_golden.json",
        {
            "generated_by": "scripts/make_tokenizer_fixtures.py",
            "vocab_file": "qwen2/ggml-vocab-qwen2.gguf (llama.cpp models/, as vendored by the llama-cpp-python sdist)",
            "vocab_sha256": sha256_of(vocab),
            "vocab_size": backend.get_vocab_size(with_added_tokens=True),
            "cases": cases,
            "chats": chats,
        },
    )
    print(f"qwen2: {len(cases)} cases, {len(chats)} chat renderings")


# The pre-tokenizers of the models whose `tokenizer.ggml.pre` names kiln maps, built the way each
# model's own tokenizer.json builds them: (GGUF names, normalizer, pre-tokenizer).
def reference_pre_tokenizers():
    llama3 = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    return [
        (
            ["default", "gpt2"],
            None,
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ),
        (
            ["smollm", "starcoder"],
            None,
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
                ]
            ),
        ),
        (
            ["llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"],
            None,
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(llama3), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
                ]
            ),
        ),
        (
            ["qwen2", "deepseek-r1-qwen"],
            normalizers.NFC(),
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
                ]
            ),
        ),
    ]


def pretok():
    groups = []
    for names, normalizer, pre in reference_pre_tokenizers():
        splits = []
        for text in CORPUS:
            normalized = normalizer.normalize_str(text) if normalizer is not None else text
            splits.append([piece for piece, _ in pre.pre_tokenize_str(normalized)])
        groups.append({"names": names, "splits": splits})
    write_json("pretok_golden.json", {"generated_by": "scripts/make_tokenizer_fixtures.py", "texts": CORPUS, "groups": groups})
    print(f"pre-tokenizers: {len(groups)} groups over {len(CORPUS)} texts")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=os.path.join(ROOT, "models"), help="folder with the GGUF models")
    parser.add_argument("--llama-cpp-sdist", help="unpacked llama-cpp-python sdist's vendor/llama.cpp folder")
    parser.add_argument("--only", choices=("smollm2", "gemma3", "qwen2", "pretok"), action="append")
    args = parser.parse_args()
    only = set(args.only or ("smollm2", "gemma3", "qwen2", "pretok"))
    if "pretok" in only:
        pretok()
    if "smollm2" in only:
        smollm2(os.path.join(args.models, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if "gemma3" in only:
        gemma3(os.path.join(args.models, "gemma-3-270m-q4_k_m.gguf"))
    if "qwen2" in only:
        if not args.llama_cpp_sdist:
            sys.exit("qwen2 needs --llama-cpp-sdist (see the top of this script)")
        qwen(args.llama_cpp_sdist)


if __name__ == "__main__":
    main()
