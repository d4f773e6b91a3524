"""``python -m fp8shard.data prepare INPUT [INPUT ...] --out DIR``: text files to a tokens file.

Problems (a missing or non-UTF-8 file, no text, a missing package) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp8shard.data.prepared import META_FILE, TOKENIZER_FILE, PrepareError, prepare

PROG = "python -m fp8shard.data"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Text data for fp8shard: tokenize text files into a tokens file for "
                               "python -m fp8shard.train data.path=DIR.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="prepare")
    p = sub.add_parser(
        "prepare", help="tokenize text files or folders into DIR/tokens.bin (+ tokenizer.json, tokens.json)",
        description="Tokenize UTF-8 text files (and the files matching --pattern under folders, sorted) "
                    "into DIR/tokens.bin, one document per file. --tokenizer bpe (default) first trains "
                    "a byte-level BPE on them with the Hugging Face `tokenizers` package and saves it as "
                    f"DIR/{TOKENIZER_FILE}; --tokenizer bytes uses the UTF-8 bytes as ids (vocabulary 256, "
                    f"no dependency). DIR/{META_FILE} describes the ids; the training command, export, "
                    "generate and evaluate read it. Then: python -m fp8shard.train data.path=DIR")
    p.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text files and/or folders")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe",
                   help="byte-level BPE trained on the inputs (default), or raw UTF-8 bytes")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE vocabulary including the 256 bytes and <|endoftext|> (default 4096)")
    p.add_argument("--min-frequency", type=int, default=2,
                   help="BPE: merge only pairs seen at least this often (default 2)")
    p.add_argument("--pattern", default="*.txt", help="files taken from folders (default *.txt)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        done = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       min_frequency=args.min_frequency, pattern=args.pattern)
    except PrepareError as e:
        print(f"{PROG} prepare: error: {e}", file=sys.stderr)
        return 2
    m = done.meta
    print(f"prepared {m['documents']} file(s), {m['num_bytes']:,} bytes of text -> {done.tokens}: "
          f"{m['num_tokens']:,} tokens ({m['dtype']}), {m['bytes_per_token']:.2f} bytes/token")
    if m["tokenizer"] == "bytes":
        print("tokenizer: UTF-8 bytes (vocabulary 256)")
    else:
        print(f"tokenizer: byte-level BPE, {m['vocab_size']:,} ids -> {done.out / TOKENIZER_FILE}")
    print(f"train with: python -m fp8shard.train data.path={done.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
