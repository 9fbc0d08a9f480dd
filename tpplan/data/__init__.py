"""The data layer: token sources on disk, memory-mapped, mixed by weight, and the token
store ``tpplan data prepare`` writes.

``formats.open_tokens``: a token store, a Megatron-Core indexed dataset or a flat file of ids,
opened as a :class:`~tpplan.data.tokenfile.TokenFile`; ``scan.check_source``: the checks
made before any process group; ``feed.TokenFeed``: each step's batch, a pure function of
(seed, step), gathered ahead in a thread; ``prepare``: text, jsonl, parquet, chats and
HuggingFace ``datasets`` tokenized by N workers into a store. Imports the plan and models
layers only; the trainer and the commands import it.
"""

from ..exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "errors": ["DataError"],
    "formats": ["FLAT_DTYPES", "is_token_source", "open_tokens"],
    "feed": ["HeldOut", "Source", "TokenFeed"],
    "scan": ["check_source", "largest_id"],
    "store": ["MANIFEST", "open_store"],
    "tokenfile": ["TokenFile"],
})
