"""A tiny Llama and its tokenizer, built locally from a seed (nothing comes from a model hub).

Real ``vllm serve`` on a CPU needs a model folder. This module writes one:

* a ``LlamaConfig`` with hidden size 128, 2 layers, 4 attention heads (head size 32: vLLM's CPU
  attention accepts 32, 64, 80, 96, 112, 128 and up) and a vocabulary of 1,024, with random
  weights drawn from a fixed seed and saved as safetensors;
* a byte-level BPE tokenizer trained on a corpus this module generates from the same seed, with
  ``<s>``, ``</s>``, ``<unk>``, ``<pad>`` and a chat template.

The text the model writes is noise; tests compare tokens, order and timing, not meaning. The build
takes a few seconds and is cached: the folder's name carries the spec's digest, and a folder is
complete only once its ``.complete`` marker exists (written last, so a killed build is redone).

Runs wherever ``transformers``, ``tokenizers`` and ``torch`` are installed (``.venv-vllm``):
``python -m slipstream_testbed.vllm.tiny_model [DEST]`` prints the folder.

Deliberately left out: anything a real model needs to say something (training, real weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORD_LINES = (
    "the a of to and in is for on with as by at from that this it be are was or an which",
    "model batch token online offline request latency budget engine queue prefix cache",
    "summary paper result table figure section method data train test value error number",
    "time step block memory service job shard output input prompt length order rank score",
    "alpha beta gamma delta one two three four five six seven eight nine ten hundred",
)
_WORDS = tuple(w for line in _WORD_LINES for w in line.split())


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """What the folder holds. Every field goes into the folder's digest."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 2048
    corpus_lines: int = 4000

    def digest(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:12]


def default_cache_dir() -> Path:
    base = os.environ.get("SLIPSTREAM_CACHE") or str(Path.home() / ".cache" / "slipstream")
    return Path(base) / "models"


def model_dir(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Where the model for ``spec`` lives (built or not)."""
    return (cache_dir or default_cache_dir()) / f"tiny-llama-{spec.digest()}"


def corpus(spec: TinyModelSpec) -> list[str]:
    """The tokenizer's training text: seeded word salad over a fixed word list and digits."""
    rng = random.Random(spec.seed)
    lines = []
    for _ in range(spec.corpus_lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice((".", "?", "!", ",", ":")))
    return lines


def build(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Build (or reuse) the model folder for ``spec`` and return its path."""
    dest = model_dir(spec, cache_dir)
    if (dest / ".complete").exists():
        return dest
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(tmp))

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "slipstream-tiny-model.json").write_text(
        json.dumps({"spec": asdict(spec), "digest": spec.digest()}, indent=2) + "\n"
    )
    (tmp / ".complete").write_text("")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first: keep its folder
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """The model folder for ``spec``, built if missing: in this process when it has
    ``transformers`` and ``torch``, else by the real-vLLM environment's Python."""
    dest = model_dir(spec, cache_dir)
    if (dest / ".complete").exists():
        return dest
    import importlib.util

    if all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers")):
        return build(spec, cache_dir)
    import subprocess

    from slipstream_testbed.vllm.server import vllm_python

    if spec != TinyModelSpec():
        raise ValueError("a non-default spec can only be built where transformers is installed")
    cmd = [vllm_python(), "-m", "slipstream_testbed.vllm.tiny_model"]
    if cache_dir is not None:
        cmd.append(str(cache_dir))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m slipstream_testbed.vllm.tiny_model [CACHE_DIR]", file=sys.stderr)
        return 2
    print(build(cache_dir=Path(argv[0]) if argv else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
