"""Documents of ``data.path`` for a tokenizer: moved to :mod:`tpplan.data.documents`
(``tpplan data prepare`` reads them too); kept here under its old name."""

from ..data.documents import PARQUET_HINT, RECORD_SUFFIXES, Document, read_documents, source_files

__all__ = ["Document", "PARQUET_HINT", "RECORD_SUFFIXES", "read_documents", "source_files"]
