"""`geotrain generate`: text from a trained model in one process on CPU, greedy or sampled with a seed.

The model is trained on windows of model.seq_len tokens, and byte-gpt has no position beyond them, so the context
slides: each new token is predicted from the last seq_len tokens at most (the prompt's start drops out of view).
"""

from __future__ import annotations

import torch

from geotrain.node.model import GPT


def generate(
    model: GPT, prompt: list[int], *, max_new_tokens: int, seq_len: int, vocab: int, temperature: float, seed: int
) -> list[int]:
    """The ids of max_new_tokens tokens that follow `prompt`: argmax at temperature 0, else sampled from the softmax
    of logits / temperature with a generator seeded by `seed`; only ids below `vocab` (the tokenizer's) are drawn."""
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    ids = list(prompt)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids[-seq_len:]]))[0, -1, :vocab]
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=rng))
            ids.append(token)
    return ids[len(prompt):]
