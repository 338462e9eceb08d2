"""The tokenizer of a trained model: bytes (ids 0..255, the byte corpus) or a tokenizer.json (a prepared data set),
and either as the tokenizer.json an exported Hugging Face directory carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geotrain.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"
BYTES = 256


class ByteTokenizer:
    """Text as its UTF-8 bytes: what byte-gpt, and a llama trained on the byte corpus, read."""

    vocab_size = BYTES
    name = "the byte tokenizer"

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; bytes that are not UTF-8 (a character cut short) read as U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def hf_json(self) -> str:
        """This tokenizer as a tokenizer.json: byte-level BPE without merges whose ids are the byte values."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in _byte_chars().items()}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer.to_str()


class FileTokenizer:
    """A tokenizer.json (as `geotrain data prepare` writes), through the `tokenizers` library."""

    def __init__(self, path: Path, name: str) -> None:
        from tokenizers import Tokenizer

        self.name = name
        try:
            self.text = path.read_text()
        except OSError as e:
            raise ConfigError(f"{name} {path}: cannot read it: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{name} {path}: not a tokenizer.json (not UTF-8 text)") from None
        try:
            self.tokenizer = Tokenizer.from_str(self.text)
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exception for a file it cannot parse)
            raise ConfigError(f"{name} {path}: not a tokenizer.json ({str(e).splitlines()[0]})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def hf_json(self) -> str:
        """The tokenizer.json as read."""
        return self.text


Tokenizer = ByteTokenizer | FileTokenizer


def choose_tokenizer(path: str | None, data: dict[str, Any], vocab: int) -> Tokenizer:
    """--tokenizer PATH, else the recorded run's `<data.prepared>/tokenizer.json`, else bytes; ConfigError when the
    model cannot score every id the tokenizer makes."""
    prepared = data.get("prepared")
    if path:
        tokenizer: Tokenizer = FileTokenizer(Path(path), "--tokenizer")
    elif isinstance(prepared, str) and prepared:
        tokenizer = FileTokenizer(Path(prepared) / TOKENIZER_FILE, "the run's data.prepared tokenizer")
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"{tokenizer.name}: its vocabulary ({tokenizer.vocab_size} tokens) exceeds the model's ({vocab})"
        )
    return tokenizer


def tokenizer_config(max_length: int) -> dict[str, Any]:
    """The tokenizer_config.json beside tokenizer.json, so that AutoTokenizer loads it as a fast tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable character for each byte, the alphabet of byte-level BPE (tokenizers' ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(BYTES) if b not in chars]
    chars.update({b: chr(BYTES + n) for n, b in enumerate(others)})
    return chars
