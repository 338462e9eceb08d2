"""The run config a coordinator serves: the one its file and --set flags give, its data checked, built once with the
fingerprint of its corpus (or prepared data set), which every node checks its own data against."""

from __future__ import annotations

from dataclasses import replace

from geotrain.config import ConfigError, DataSection, ModelSection, RunConfig


def corpus_fingerprint(data: DataSection, model: ModelSection) -> str:
    """Read the run's corpus (or prepared data set) and return its fingerprint; ConfigError for one whose files are
    missing or whose splits are too short for a sample (training would fail at its first batch), and a prepared data
    set whose shards changed or whose tokenizer has more tokens than the model."""
    if data.prepared:
        from geotrain.dataset import DatasetError, PreparedDataset

        try:
            dataset = PreparedDataset.open(data.prepared, verify=True)
            if model.family == "byte-gpt" and dataset.vocab_size > model.vocab:
                # model.vocab_size is a llama key: advising it alone leads to the byte GPT refusing it.
                raise ConfigError(
                    f"data.prepared: the tokenizer of {dataset.directory} has {dataset.vocab_size} tokens, and the "
                    f"byte GPT (the default model.family) reads bytes: set model.family = \"llama\" and "
                    f"model.vocab_size = {dataset.vocab_size}"
                )
            dataset.check_fits(vocab=model.vocab, seq_len=model.seq_len)
        except DatasetError as e:
            raise ConfigError(f"data.prepared: {e}") from None
        return dataset.fingerprint
    from geotrain.node.data import Corpus

    try:
        corpus = Corpus.load(data)
    except ValueError as e:  # load's way of saying that data.paths match no files
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"data.paths: cannot read {e.filename}: {e.strerror}") from None
    shortest = min(len(corpus.train), len(corpus.val))
    if shortest <= model.seq_len + 1:
        raise ConfigError(
            f"data: the corpus splits into {len(corpus.train)} training and {len(corpus.val)} validation bytes; "
            f"each needs more than model.seq_len + 1 ({model.seq_len + 1})"
        )
    return corpus.fingerprint


def fingerprinted(given: RunConfig) -> RunConfig:
    """The run config a coordinator serves: `given` (as its file and flags set it) with the fingerprint of the data
    its [data] names, which replaces whatever data.fingerprint they set. Built once; nothing changes it afterwards."""
    return replace(given, data=replace(given.data, fingerprint=corpus_fingerprint(given.data, given.model)))
