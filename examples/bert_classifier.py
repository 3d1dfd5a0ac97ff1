"""A BERT-shaped classifier, written as a user writes one for `ringtrain train --model`.

A two-layer keras-hub BertBackbone (hidden 64, 2 heads, sequences of 32 tokens, random
weights: nothing is downloaded) with a two-class head on its pooled output, and synthetic
token data. Its pipeline cut carries the hidden states and the padding mask together.

    mpirun -np 2 ringtrain train --strategy pipeline \\
        --model examples/bert_classifier.py:build --data examples/bert_classifier.py:data
"""

import keras
import numpy as np

VOCABULARY, TOKENS = 100, 32


def build(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    intermediate: int = 128,
    vocabulary: int = VOCABULARY,
    learning_rate: float = 1e-3,
) -> keras.Model:
    """BERT-large is layers=24, hidden=1024, heads=16, intermediate=4096, vocabulary=30522;
    at that depth, Adam at 1e-3 from random weights diverges, as BERT's own recipes (1e-4 in
    pre-training, less in fine-tuning) avoid."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=TOKENS,
        dropout=0.0,
    )
    logits = keras.layers.Dense(2, name="head")(backbone.output["pooled_output"])
    model = keras.Model(backbone.input, logits, name="bert_classifier")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(n: int = 4096, seed: int = 0, tokens: int = TOKENS, vocabulary: int = VOCABULARY):
    """(x, y): token ids with every fourth sequence padded after a random length, two
    segments, and label 1 where the mean real token id is above the middle of the range."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, vocabulary, size=(n, tokens), dtype=np.int32)
    lengths = np.full(n, tokens)
    lengths[::4] = rng.integers(tokens // 2, tokens, size=len(lengths[::4]))
    padding_mask = (np.arange(tokens) < lengths[:, None]).astype(np.int32)
    token_ids *= padding_mask
    segment_ids = (np.arange(tokens) >= tokens // 2).astype(np.int32)
    x = {
        "token_ids": token_ids,
        "segment_ids": np.broadcast_to(segment_ids, token_ids.shape).copy(),
        "padding_mask": padding_mask,
    }
    y = (token_ids.sum(axis=1) / lengths > vocabulary / 2).astype(np.int32)
    return x, y
