"""quantmla.data: offline English corpora with fixed calibration / validation / test splits."""

from quantmla.data.corpus import (
    DEFAULT_SOURCE,
    SPLITS,
    CorpusNotFoundError,
    Document,
    available_sources,
    cache_root,
    load_split,
    split_text,
    token_stream,
)

__all__ = [
    "DEFAULT_SOURCE",
    "SPLITS",
    "CorpusNotFoundError",
    "Document",
    "available_sources",
    "cache_root",
    "load_split",
    "split_text",
    "token_stream",
]
