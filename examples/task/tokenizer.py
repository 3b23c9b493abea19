"""Character-level tokenizer for the reasoning task, built with `tokenizers` and saved as JSON."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

# A fixed, small alphabet (54 symbols with the specials): the task only uses digits, "+=,:",
# space, newline and a few letters, but a little headroom keeps prompts free-form.
CHARACTERS = "\n " + string.digits + string.ascii_lowercase + "+-*=:<>.,?()"
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARACTERS)
VOCAB_SIZE = len(VOCAB)


def build_tokenizer() -> Tokenizer:
    """The task tokenizer: one token per character, <pad>/<bos>/<eos>/<unk> specials."""
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(VOCAB)}, unk_token=UNK))
    # Every character (newline included) is its own pre-token, so WordLevel maps it 1:1.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json (plus a tokenizer_config.json for AutoTokenizer) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    build_tokenizer().save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json from a file path or from the model directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """Prompt token ids: <bos> followed by the prompt's characters."""
    return [BOS_ID] + tok.encode(text, add_special_tokens=False).ids


def encode_answer(tok: Tokenizer, text: str) -> list[int]:
    """Answer token ids: the answer's characters followed by <eos>."""
    return tok.encode(text, add_special_tokens=False).ids + [EOS_ID]


def decode(tok: Tokenizer, ids: list[int]) -> str:
    """Text of generated ids, cut at the first <eos> and without special tokens."""
    ids = list(ids)
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    return tok.decode(ids, skip_special_tokens=True)
