"""``switchyard build-tiny-model DIR``: a small Llama that vLLM serves, built here.

Model hubs are out of reach on CI and on the developers' machines, so the model the
``vllm`` engine is tested with is made locally: a 2-layer Llama (hidden 128, 4 heads,
2 KV heads) with seeded weights, saved by ``transformers`` in float32, plus the
byte-level BPE tokenizer and chat template that ship with the sim model. The same seed
gives the same weights, so greedy outputs are reproducible across machines.

A directory that already holds a model built with the same parameters is kept as it
is (``make run`` builds once, then reuses it); ``--force`` rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SIM_TOKENIZER_DIR = Path(__file__).parent / "models" / "sim-tiny"
_STAMP = "switchyard-tiny.json"


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32_768
    vocab_size: int = 4096  # the sim-tiny tokenizer's, added tokens included


def _stamp(spec: TinyModelSpec) -> dict:
    """What a built model is: its parameters, and the tokenizer files it was given (a new chat
    template means a rebuild)."""
    files = (SIM_TOKENIZER_DIR / "tokenizer.json", SIM_TOKENIZER_DIR / "tokenizer_config.json")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    return asdict(spec) | {"tokenizer": digest}


def is_built(directory: Path, spec: TinyModelSpec = TinyModelSpec()) -> bool:
    stamp = directory / _STAMP
    try:
        return json.loads(stamp.read_text()) == _stamp(spec)
    except (OSError, ValueError):
        return False


def build_tiny_model(directory: Path, spec: TinyModelSpec = TinyModelSpec(), *, force: bool = False) -> Path:
    """Build (or keep) the tiny model in ``directory``; returns it. Written to a temporary
    sibling first and renamed, so an interrupted build never leaves a half model."""
    directory = Path(directory)
    if not force and is_built(directory, spec):
        return directory
    import torch  # heavy: only the builder needs them
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        torch.manual_seed(spec.seed)
        config = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=4095,
            pad_token_id=4093,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(staging, safe_serialization=True)
        shutil.copy(SIM_TOKENIZER_DIR / "tokenizer.json", staging / "tokenizer.json")
        tok_config = json.loads((SIM_TOKENIZER_DIR / "tokenizer_config.json").read_text())
        tok_config["model_max_length"] = spec.max_position_embeddings
        (staging / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        (staging / _STAMP).write_text(json.dumps(_stamp(spec)))
        staging.chmod(0o755)  # mkdtemp made it private
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def main(directory: str, force: bool = False) -> int:
    start = time.monotonic()
    path = Path(directory)
    kept = not force and is_built(path)
    build_tiny_model(path, force=force)
    what = "kept" if kept else f"built in {time.monotonic() - start:.1f} s"
    print(f"tiny model {what}: {path.resolve()}", flush=True)
    return 0
