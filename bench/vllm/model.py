"""Build the tiny random-weight Llama that the real-vLLM suite serves (no weights can be downloaded here).

Run with the Python of the vLLM environment (it needs torch, transformers and
tokenizers, which tailguard itself does not)::

    .venv-vllm/bin/python bench/vllm/model.py build/tiny-llama

The tokenizer is a byte-level BPE of 8,192 tokens trained on the standard
library's own sources (text every machine has), so its counts behave like a
real model's: common English and code compress, rare scripts and symbols do
not. Weights are random from a fixed seed: the answers are nonsense, but
every path of the engine (scheduler, prefix cache, abort, 503s) is vLLM's.
The same Python gives the same model, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 8192
MAX_POSITIONS = 8192
SEED = 0
TRAINING_FILES = 400  # of the standard library's modules, sorted by path: ~10 MB, ~5 s to train
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# A chat template of our own: role markers the tokenizer learns as plain text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_text() -> list[Path]:
    """The standard library's sources, a fixed sorted slice: the same on every machine with this Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib.glob("*.py"))
    files += sorted(path for path in (stdlib / "email").glob("*.py"))
    return files[:TRAINING_FILES]


def build_tokenizer(out: Path) -> None:
    """Train the byte-level BPE and save it as a ``PreTrainedTokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in training_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(out))


def build_weights(out: Path) -> int:
    """A random ``LlamaForCausalLM`` (6.6 M parameters) in bf16 safetensors; returns the parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(parameter.numel() for parameter in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the model into (created; reused when complete)")
    args = parser.parse_args(argv)
    out: Path = args.out
    marker = out / "tailguard-model.json"
    if marker.exists():
        print(f"{out}: already built")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    parameters = build_weights(out)
    marker.write_text(json.dumps({"parameters": parameters, "vocab_size": VOCAB_SIZE, "seed": SEED}) + "\n")
    print(f"{out}: {parameters:,} parameters, vocabulary {VOCAB_SIZE:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
