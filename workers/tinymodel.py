"""A tiny Llama-architecture model for tests and local runs, made on this machine.

Random weights (seeded), a byte-level BPE tokenizer trained on local text (a
fixed list of the Python standard library's own source files) and a chat
template; nothing comes from a model hub. Runs in the worker environment
(needs torch and transformers):

    <worker-env>/bin/python -P workers/tinymodel.py OUT_DIR

:func:`ensure` (light environment) builds it once into the cache and reuses it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 512
SEED = 1234
# Standard-library modules whose source is the tokenizer's training text.
CORPUS_MODULES = ("textwrap.py", "argparse.py", "json/__init__.py", "json/decoder.py", "difflib.py",
                  "string.py", "shlex.py", "calendar.py")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def cache_dir() -> Path:
    root = os.environ.get("DISAGG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "disagg")
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return Path(root) / "models" / f"tiny-llama-{digest}"


def ensure(worker_python: str) -> Path:
    """The model's directory, made with the worker environment's Python when absent."""
    out = cache_dir()
    if not (out / ".complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([worker_python, "-P", __file__, str(out)], check=True)
    _readable(out)
    return out


def _readable(out: Path) -> None:
    """Every file readable by everyone: pods mount this directory and run as a non-root user, and the
    weights file is written owner-only (0600)."""
    for path in out.iterdir():
        if path.is_file() and (path.stat().st_mode & 0o444) != 0o444:
            path.chmod(path.stat().st_mode | 0o444)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text() for name in CORPUS_MODULES]


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>", chat_template=CHAT_TEMPLATE)
    tok.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / ".complete").touch()


if __name__ == "__main__":
    make(Path(sys.argv[1]))
