"""Build the tokenizer of the simulated model `switchyard-sim`.

Design note
-----------
The fabric needs a real tokenizer to count prompt tokens, hash KV blocks and detokenize a
simulated engine's output, but it must not download one. So we train a small byte-level BPE
(the GPT-2 / Qwen family: ByteLevel pre-tokenizer and decoder, every byte in the base
alphabet, so any Unicode text round-trips) on a corpus generated here from a fixed word list
and a seeded RNG.

The output is shipped in `switchyard/models/sim-tiny/` and must be reproducible: the corpus
uses only lists and `random.Random(0)` (never sets or dict order that depends on hashing), the
BPE trainer breaks count ties by pair id, and the JSON files are written with sorted keys.
A test rebuilds into a temporary dir and compares bytes with the shipped files.

Layout follows real chat models: the trained vocabulary takes ids 0..N-1 and the special
tokens are appended after it (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`), so the ordinary
tokens form one contiguous id range.

Usage: python -m switchyard.models.build_tokenizer OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

MODEL_NAME = "switchyard-sim"
MAX_CONTEXT = 4096
VOCAB_SIZE = 4096
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML with tools, in the shape Qwen 2.5 ships (Hermes tool calls): the tools in the system
# turn, an assistant's calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
# A conversation without tools renders as plain ChatML. For trim_blocks/lstrip_blocks, as HF renders.
# ``enable_thinking`` false (a chat_template_kwargs) opens the answer with an empty thought, as Qwen3's does;
# ``thinking`` true opens it inside a thought, as DeepSeek-V3.1's does. An assistant's tool-calling
# turn renders its ``reasoning_content`` back as a thought, as Qwen3's does within a turn.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    '{%- endfor %}{{- \'\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is not string %}{{- raise_exception('message content must be a string') }}"
    "{%- endif %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['reasoning_content'] %}{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}"
    "{%- endif %}{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    # Qwen3's switch (``chat_template_kwargs: {"enable_thinking": false}``): an empty thought.
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    # DeepSeek-V3.1's (``{"thinking": true}``): the answer opens inside a thought.
    "{%- elif thinking is defined and thinking is true %}{{- '<think>' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_WORDS = """
the be to of and a in that have I it for not on with he as you do at this but his by from
they we say her she or an will my one all would there their what so up out if about who get
which go me when make can like time no just him know take people into year your good some
could them see other than then now look only come its over think also back after use two how
our work first well way even new want because any these give day most us is are was were
been has had did said made went saw knew took came thought told found gave asked felt became
left kept began seemed helped showed heard played ran moved lived believed brought happened
wrote sat stood lost paid met included continued set learned changed led understood watched
followed stopped created spoke read allowed added spent grew opened walked won offered
remembered loved considered appeared bought waited served died sent expected built stayed
fell cut reached killed remained suggested raised passed sold required reported decided
pulled world life hand part child eye woman place week case point government company number
group problem fact house area money story month lot right study book job word business issue
side kind head service friend father power hour game line end member law car city community
name president team minute idea kid body information school face others level office door
health person art war history party result change morning reason research girl guy moment air
teacher force education foot boy age policy process music market sense nation plan college
interest death experience effect class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice
piece land product doctor wall patient worker news test movie north love support technology
step baby computer type attention film tree source organization hair window evidence
population truth song network request server client cluster worker router queue token block
cache memory prefix model engine batch stream message subject latency throughput request
response prompt completion chat assistant system user tool function error timeout retry
schedule scheduler policy score cost load capacity node region replica shard lease heartbeat
metric trace span event sequence gap snapshot index hash seed decode prefill kernel device
small large long short high low early late young old big great little own important few
public bad same able last next other different local sure free better best true whole real
hot cold simple clear easy hard fast slow happy strong possible political social national
human general full special certain open recent late single medical current wrong private
past foreign fine common poor natural significant similar hot dead central happy serious
ready left physical red green blue black white dark bright quiet empty heavy soft warm
very really most often still never always sometimes together already however perhaps almost
actually probably quickly finally especially certainly usually simply nearly exactly
""".split()
_WORDS = list(dict.fromkeys(_WORDS))  # drop repeats, keeping first-seen order (deterministic)

# Non-ASCII snippets so the BPE learns some multi-byte merges; streaming detokenization is only
# exercised properly when tokens can end in the middle of a UTF-8 character.
_UNICODE_SNIPPETS = [
    "café",
    "naïve",
    "résumé",
    "über",
    "façade",
    "jalapeño",
    "Zürich",
    "São Paulo",
    "日本語のテキスト",
    "こんにちは世界",
    "你好，世界",
    "中文分词",
    "안녕하세요",
    "Привет, мир",
    "Ελληνικά",
    "שלום",
    "مرحبا",
    "नमस्ते",
    "😀",
    "🚀",
    "👍",
    "🎉",
    "❤️",
    "—",
    "…",
    "“quoted”",
    "±",
    "°C",
    "€",
    "£",
    "→",
    "≤",
    "≥",
    "×",
]

_CODE_SNIPPETS = [
    "def f(x):\n    return x + 1\n",
    '{"role": "user", "content": "hello"}',
    "for i in range(10):\n    print(i)\n",
    "if err != nil {\n\treturn err\n}\n",
    "SELECT id, name FROM users WHERE id = 42;",
    "https://example.com/v1/chat/completions",
    '<div class="main">text</div>',
    "x = [1, 2, 3]  # list",
]


def _suffixed(word: str, rng: random.Random) -> str:
    """An inflected form, so the trainer sees shared stems with varied endings."""
    suffix = rng.choice(["s", "ing", "ed", "er", "ly", "ness", "ment", "able"])
    return word + suffix


def _word(rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    roll = rng.random()
    if roll < 0.15:
        return _suffixed(word, rng)
    if roll < 0.20:
        return str(rng.randint(0, 10 ** rng.randint(1, 4)))
    if roll < 0.23:
        return rng.choice(_UNICODE_SNIPPETS)
    return word


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    if len(words) > 6 and rng.random() < 0.4:
        words[rng.randint(2, len(words) - 3)] += ","
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":"])


def _paragraph(rng: random.Random) -> str:
    if rng.random() < 0.05:
        return rng.choice(_CODE_SNIPPETS)
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))


def corpus(n_paragraphs: int = 20_000) -> Iterator[str]:
    """The training text; the same sequence of strings on every run and platform."""
    rng = random.Random(0)
    # Each fixed word and snippet once by itself, so rare ones still reach the alphabet merges.
    yield " ".join(_WORDS)
    yield " ".join(_UNICODE_SNIPPETS)
    yield from _CODE_SNIPPETS
    for _ in range(n_paragraphs):
        yield _paragraph(rng)


def train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # Appended after training so they take the ids after the ordinary vocabulary.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    return {
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "model_max_length": MAX_CONTEXT,
        "chat_template": CHAT_TEMPLATE,
    }


def _model_config(tokenizer: Tokenizer) -> dict[str, object]:
    return {
        "model_type": MODEL_NAME,
        "served_model_name": MODEL_NAME,
        "max_position_embeddings": MAX_CONTEXT,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_token_id": tokenizer.token_to_id(IM_END),
    }


def _write_json(path: Path, value: dict[str, object]) -> None:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def build(out_dir: Path) -> None:
    """Train the tokenizer and write tokenizer.json, tokenizer_config.json, config.json."""
    tokenizer = train()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compact: the pretty form spreads every merge pair over four lines and triples the size.
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(out_dir / "config.json", _model_config(tokenizer))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m switchyard.models.build_tokenizer OUT_DIR")
    build(Path(args[0]))


if __name__ == "__main__":
    main()
