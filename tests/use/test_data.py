"""Text to tokens ([Note: prepared tokens]): ``python -m fp8shard.data prepare`` with a byte-level BPE
trained here or with UTF-8 bytes, and ``data.path`` without ``data.source`` picking the source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp8shard.data import __main__ as data_cli
from fp8shard.data.prepared import PrepareError, prepare, read_meta
from fp8shard.data.tokenizer import EOT, BPETokenizer, ByteTokenizer, byte_to_char, load_tokenizer
from fp8shard.train.config import ConfigError, load_config
from fp8shard.train.data import load_data
from tests.use.common import TINY, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text") / "corpus")


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    return prepare([corpus], tmp_path_factory.mktemp("prep") / "bpe", vocab_size=300)


def test_byte_table_is_a_bijection_onto_printable_characters():
    chars = byte_to_char()
    assert len(set(chars)) == 256 and all(c.isprintable() and not c.isspace() for c in chars)
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "\u0120"  # GPT-2's 'Ġ'


def test_prepare_bpe_writes_tokens_tokenizer_and_description(corpus, bpe):
    out = bpe.out
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    assert meta["documents"] == 3 and meta["inputs"] == [str(p) for p in sorted(corpus.glob("*.txt"))]
    tok = BPETokenizer(out / "tokenizer.json")
    assert tok.vocab_size == 300 and tok.eot_id == 0 and tok.byte_level
    ids = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    assert len(ids) == meta["num_tokens"] and ids.max() < 300
    # Documents in order, separated by <|endoftext|>, decoding to the text exactly.
    docs = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    assert tok.decode(ids) == EOT.join(docs)
    assert meta["num_bytes"] == sum(len(d.encode()) for d in docs) and meta["bytes_per_token"] > 1.3
    # The bytes behind every id add up to the text's bytes ([Note: byte-level tokens]).
    assert int(tok.token_bytes()[ids].sum()) == meta["num_bytes"]


def test_prepare_bytes_needs_no_tokenizer(corpus, tmp_path):
    done = prepare([corpus / "part1.txt", corpus / "part0.txt"], tmp_path / "b", tokenizer="bytes")
    assert done.meta["tokenizer"] == "bytes" and done.meta["vocab_size"] == 256
    assert not (tmp_path / "b" / "tokenizer.json").exists()
    text = (corpus / "part1.txt").read_bytes() + (corpus / "part0.txt").read_bytes()
    assert np.fromfile(tmp_path / "b" / "tokens.bin", dtype=np.uint16).tobytes() == \
        np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tobytes()
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.decode(tok.encode("héllo ✓")) == "héllo ✓"


def test_prepare_refuses_bad_input_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"ok\xff\xfe")
    with pytest.raises(PrepareError, match=r"bad\.txt is not UTF-8 text \(invalid start byte at byte 2\)"):
        prepare([tmp_path / "bad.txt"], tmp_path / "o")
    (tmp_path / "empty").mkdir()
    assert data_cli.main(["prepare", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m fp8shard.data prepare: error: {tmp_path / 'empty'} holds no file matching "
                   "'*.txt' (choose others with --pattern)"]
    assert data_cli.main(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_prepare_command_prints_what_to_run_next(corpus, tmp_path, capsys):
    assert data_cli.main(["prepare", str(corpus), "--out", str(tmp_path / "d"), "--vocab-size", "280"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer: byte-level BPE, 280 ids" in out
    assert f"train with: python -m fp8shard.train data.path={tmp_path / 'd'}" in out
    with pytest.raises(SystemExit) as e:
        data_cli.main(["prepare", "--help"])
    assert e.value.code == 0 and "byte-level BPE" in capsys.readouterr().out


def _cfg(*overrides):
    return load_config([*TINY, *overrides], world_size=1)


def test_a_prepared_folder_needs_only_data_path(bpe):
    cfg = _cfg(f"data.path={bpe.out}")
    d = cfg.data
    assert (d.source, d.path, d.token_dtype, d.vocab_size) == ("tokens", str(bpe.tokens), "uint16", 300)
    assert d.tokenizer == str(bpe.out / "tokenizer.json")
    data = load_data(d, cfg.model.encoder_seq_length)
    assert data.vocab_size == 300 and len(data.train) + len(data.val) == bpe.meta["num_tokens"]
    # The .bin file itself works the same; the prepared dtype wins over a wrong default.
    assert _cfg(f"data.path={bpe.tokens}", "data.token_dtype=uint32").data.token_dtype == "uint16"
    assert read_meta(bpe.out) == read_meta(bpe.tokens) == bpe.meta


def test_data_path_without_source_picks_text_or_stops_with_one_line(corpus, tmp_path):
    cfg = _cfg(f"data.path={corpus / 'part0.txt'}")
    assert cfg.data.source == "text" and cfg.data.tokenizer is None
    assert _cfg().data.source == "markov"  # no path: the generated corpus
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    with pytest.raises(ConfigError) as e:
        _cfg(f"data.path={tmp_path / 'ids.bin'}")
    assert "cannot tell what" in str(e.value) and "data.source=tokens" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"is a folder without tokens\.bin; make one from its text files"):
        _cfg(f"data.path={corpus}")
    with pytest.raises(ConfigError, match=r"data\.source=markov generates its corpus and ignores it"):
        _cfg("data.source=markov", f"data.path={corpus / 'part0.txt'}")
    with pytest.raises(ConfigError, match=r"data\.path: no such file"):
        _cfg(f"data.path={tmp_path / 'nope.txt'}")
