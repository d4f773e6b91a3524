"""Text data for the training command: tokenizers and prepared tokens files.

    python -m fp8shard.data prepare TEXT_FILES_OR_FOLDERS --out DIR     # tokens + tokenizer
    python -m fp8shard.train data.path=DIR                             # trains on them

See [Note: prepared tokens] (prepared.py) and [Note: byte-level tokens] (tokenizer.py).
"""

from fp8shard.data.prepared import Prepared, PrepareError, prepare, read_meta, resolve_data
from fp8shard.data.tokenizer import BPETokenizer, ByteTokenizer, TokenizerError, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "ByteTokenizer", "PrepareError", "Prepared", "TokenizerError", "load_tokenizer",
    "prepare", "read_meta", "resolve_data", "train_bpe",
]
