"""Bad input, table-driven: configs, data files and checkpoints the training command refuses
(the library calls that refuse their arguments: ``test_bad_api_calls.py``).

Every ``CASES`` case runs ``fp8shard.train``'s ``main`` in-process (one rank, tiny config) and
asserts: exit code 2, one message naming the problem, no traceback, and nothing written (the run
directory absent, or every file under it unchanged; checkpoints used as input unchanged).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fp8shard.train.__main__ import main
from fp8shard.train.rundir import LOCK_NAME
from tests.reliability.common import run_args, tree_digest


@dataclasses.dataclass
class Case:
    id: str
    args: list[str]
    expect: str
    """A substring of the error message."""
    setup: Callable[[Path, Path], None] | None = None
    """setup(tmp directory, the shared checkpointed run) writes the files the case needs; in the
    arguments, {tmp} and {ck} stand for those two."""
    run_name: str = "run"
    """The run directory the case names (under {tmp}; may be nested); it is compared before and after."""
    max_lines: int = 10
    """Lines of stderr at most: the message (a mismatch lists a few parameters), then the hint."""


def _write(name: str, data: bytes) -> Callable[[Path, Path], None]:
    return lambda tmp, ck: (tmp / name).write_bytes(data)


def _tokens(name: str, ids: list[int] | np.ndarray, dtype: str = "uint16") -> Callable[[Path, Path], None]:
    return lambda tmp, ck: np.asarray(ids, dtype=dtype).tofile(tmp / name)


def _copy_ck(
    damage: Callable[[Path], None] | None = None, into: str = "copy"
) -> Callable[[Path, Path], None]:
    """Copy the shared run directory to {tmp}/``into``, then damage its newest checkpoint."""

    def setup(tmp: Path, ck: Path) -> None:
        shutil.copytree(ck, tmp / into)
        if damage is not None:
            newest = sorted((tmp / into / "checkpoints").glob("step_*"))[-1]
            damage(newest)

    return setup


def _truncate_shard(ck: Path) -> None:
    shard = ck / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: len(shard.read_bytes()) // 2])


def _flip_byte(ck: Path) -> None:
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _garble_manifest(ck: Path) -> None:
    manifest = next(p for p in ck.iterdir() if p.suffix == ".json")
    manifest.write_text("{ not json")


def _manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Change the checkpoint's manifest.json (a parsed copy, written back)."""

    def damage(ck: Path) -> None:
        m = json.loads((ck / "manifest.json").read_text())
        edit(m)
        (ck / "manifest.json").write_text(json.dumps(m))

    return damage


def _manifest_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda ck: (ck / "manifest.json").write_bytes(data)


def _sparse_manifest(ck: Path) -> None:
    with open(ck / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)  # 300 MiB, sparse: no disk is used


def _replace_with(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        (ck / name).unlink()
        make(ck / name)

    return damage


def _rename_file(old: str, new: str) -> Callable[[dict], None]:
    return lambda m: m["files"].__setitem__(new, m["files"].pop(old))


def _set(*path_and_value: object) -> Callable[[dict], None]:
    """Set a nested field: _set("files", "__0_0.distcp", "size", -1)."""
    *path, value = path_and_value

    def edit(m: dict) -> None:
        for k in path[:-1]:
            m = m[k] if not callable(k) else k(m)
        m[path[-1]] = value

    return edit


def _first(d: dict) -> object:
    return d[next(iter(d))]


def _first_param(m: dict) -> dict:
    return _first(m["model"])


def _group0(m: dict) -> dict:
    return m["optimizer"]["param_groups"][0]


def _copy_without_manifests(tmp: Path, ck: Path) -> None:
    """The shared run copied to {tmp}/own with every checkpoint's manifest.json deleted."""
    shutil.copytree(ck, tmp / "own")
    for manifest in (tmp / "own" / "checkpoints").glob("step_*/manifest.json"):
        manifest.unlink()


_HELD_LOCKS: list[int] = []


def _locked_by_another_job(tmp: Path, ck: Path) -> None:
    """{tmp}/own holds a run whose lock another job holds (an flock on its own open file)."""
    shutil.copytree(ck, tmp / "own")
    fd = os.open(tmp / "own" / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242 on otherhost, started 2026-01-01T00:00:00\n")
    _HELD_LOCKS.append(fd)


@pytest.fixture(autouse=True)
def _release_held_locks():
    yield
    while _HELD_LOCKS:
        os.close(_HELD_LOCKS.pop())


TEXT = "the quick brown fox jumps over the lazy dog\n" * 200
CK = "{tmp}/copy/checkpoints"

CASES = [
    # ------------------------------------------------------------------ config
    Case("unknown-key", ["trainer.max_step=3"], "Did you mean 'trainer.max_steps'"),
    Case("unknown-section", ["optimizer.lr=1"], "unknown key 'optimizer.lr'"),
    Case("empty-key", ["=3"], "the key is empty"),
    Case("bad-argument", ["--max-steps"], "bad argument '--max-steps'"),
    Case("int-not-a-number", ["trainer.max_steps=abc"], "trainer.max_steps: expected an integer"),
    Case("int-given-fraction", ["model.num_layers=1.5"], "model.num_layers: expected an integer"),
    Case("bool-wrong", ["model.fp8=maybe"], "model.fp8: expected true or false"),
    Case("choice-wrong", ["model.optim.name=sgd"], "model.optim.name: 'sgd' is not one of"),
    Case("list-wrong", ["model.optim.betas=0.9"], "model.optim.betas: expected a list"),
    Case("section-as-value", ["model=3"], "'model' is a section"),
    Case("value-as-section", ["trainer.max_steps.x=1"], "'trainer.max_steps' is a value, not a section"),
    Case("preset-missing", ["config={tmp}/nope.yaml"], "config: no such file"),
    Case(
        "preset-bad-yaml", ["config={tmp}/bad.yaml"], "is not valid YAML", _write("bad.yaml", b"a: [1, 2\n")
    ),
    Case(
        "preset-not-mapping", ["config={tmp}/list.yaml"], "must hold a mapping", _write("list.yaml", b"- 1\n")
    ),
    Case("max-steps-negative", ["trainer.max_steps=-1"], "trainer.max_steps must be > 0"),
    Case("lr-zero", ["model.optim.lr=0"], "model.optim.lr must be > 0"),
    Case("dropout-range", ["model.hidden_dropout=1.5"], "model.hidden_dropout must be in [0, 1)"),
    Case("skips-zero", ["trainer.max_consecutive_skips=0"], "trainer.max_consecutive_skips must be > 0"),
    Case("timeout-zero", ["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s must be > 0"),
    Case("seq-len-1", ["model.encoder_seq_length=1"], "model.encoder_seq_length must be >= 2"),
    Case(
        "heads-not-dividing",
        ["model.num_attention_heads=3"],
        "must be divisible by model.num_attention_heads",
    ),
    Case(
        "batch-not-dividing", ["model.global_batch_size=12"], "model.global_batch_size (12) must be divisible"
    ),
    Case("betas-three", ["model.optim.betas=[0.9,0.95,0.99]"], "model.optim.betas must be two numbers"),
    Case("min-lr-above-lr", ["model.optim.sched.min_lr=1.0"], "model.optim.sched.min_lr (1.0) must be <="),
    Case(
        "schedule-too-short",
        ["trainer.max_steps=5", "model.optim.sched.max_steps=3"],
        "the schedule would end before the run",
    ),
    Case("fp8-params-without-fp8", ["model.fp8=false"], "model.fp8_params=true needs model.fp8=true"),
    Case(
        "fp8-params-with-adamw", ["model.optim.name=adamw"], "needs model.optim.name=distributed_fused_adam"
    ),
    Case("devices-vs-launch", ["trainer.devices=2"], "trainer.devices=2 but 1 process(es) were launched"),
    Case(
        "gpu-without-cuda", ["trainer.accelerator=gpu"], "trainer.accelerator=gpu but CUDA is not available"
    ),
    # ------------------------------------------------------------------ data
    Case("tokens-no-path", ["data.source=tokens"], "data.source=tokens needs data.path"),
    Case(
        "tokens-missing-file", ["data.source=tokens", "data.path={tmp}/nope.bin"], "data.path: no such file"
    ),
    # A directory: its prepared tokens.bin is looked for.
    Case("tokens-path-is-dir", ["data.source=tokens", "data.path={tmp}"], "no such file"),
    Case(
        "tokens-empty-file",
        ["data.source=tokens", "data.path={tmp}/empty.bin"],
        "is empty (0 bytes)",
        _write("empty.bin", b""),
    ),
    Case(
        "tokens-beyond-vocab",
        ["data.source=tokens", "data.path={tmp}/t.bin", "data.vocab_size=256"],
        "holds token id 999, beyond the vocabulary (data.vocab_size=256",
        _tokens("t.bin", np.arange(4000) % 1000),
    ),
    Case(
        "tokens-too-short",
        ["data.source=tokens", "data.path={tmp}/short.bin"],
        "has 50 tokens, too few for a train/validation split",
        _tokens("short.bin", np.arange(50)),
    ),
    Case(
        "tokens-given-text-odd",
        ["data.source=tokens", "data.path={tmp}/a.txt"],
        "not a whole number of uint16 token ids",
        _write("a.txt", (TEXT + "!").encode()),
    ),
    Case(
        "tokens-given-text-even",
        ["data.source=tokens", "data.path={tmp}/b.txt"],
        "beyond the vocabulary",
        _write("b.txt", TEXT.encode()),
    ),
    Case(
        "tokens-uint32-odd-size",
        ["data.source=tokens", "data.path={tmp}/c.bin", "data.token_dtype=uint32"],
        "not a whole number of uint32 token ids",
        _tokens("c.bin", np.arange(4001)),
    ),
    Case("text-missing-file", ["data.source=text", "data.path={tmp}/nope.txt"], "data.path: no such file"),
    Case(
        "text-empty-file",
        ["data.source=text", "data.path={tmp}/e.txt"],
        "is empty (0 bytes)",
        _write("e.txt", b""),
    ),
    Case(
        "text-too-short",
        ["data.source=text", "data.path={tmp}/s.txt"],
        "too few for a train/validation split",
        _write("s.txt", b"hello world\n"),
    ),
    Case(
        "tokenizer-missing",
        ["data.source=text", "data.path={tmp}/t.txt", "data.tokenizer={tmp}/tok.json"],
        "data.tokenizer: no such file",
        _write("t.txt", TEXT.encode()),
    ),
    Case(
        "tokenizer-with-tokens",
        ["data.source=tokens", "data.path={tmp}/t.bin", "data.tokenizer={tmp}/t.bin"],
        "is not a Hugging Face tokenizers JSON file",
        _tokens("t.bin", np.arange(4000) % 200),
    ),
    # ------------------------------------------------------------------ checkpoints
    Case("resume-missing", ["trainer.resume={tmp}/nope"], "trainer.resume: '"),
    Case(
        "resume-dir-without-checkpoints",
        ["trainer.resume={tmp}/emptydir"],
        "no checkpoint at",
        lambda tmp, ck: (tmp / "emptydir").mkdir(),
    ),
    Case(
        "resume-truncated-shard", [f"trainer.resume={CK}"], "the file is truncated", _copy_ck(_truncate_shard)
    ),
    Case(
        "resume-corrupted-bytes",
        [f"trainer.resume={CK}"],
        "is corrupted: its SHA-256 does not match",
        _copy_ck(_flip_byte),
    ),
    Case(
        "resume-garbled-manifest",
        [f"trainer.resume={CK}/step_00000002"],
        "manifest.json is damaged",
        _copy_ck(_garble_manifest),
    ),
    Case(
        "resume-other-model-shape",
        [f"trainer.resume={CK}", "model.hidden_size=32"],
        "'wte.weight': the checkpoint has shape (256, 64), the model has (256, 32)",
        _copy_ck(),
    ),
    Case(
        "resume-other-vocab",
        [f"trainer.resume={CK}", "data.vocab_size=200"],
        "the checkpoint has shape (256, 64), the model has (200, 64)",
        _copy_ck(),
    ),
    Case(
        "auto-resume-corrupted-only-checkpoint",
        ["trainer.resume=auto"],
        "the file is truncated",
        _copy_ck(_truncate_shard, into="own"),
        run_name="own",
    ),
    # ------------------------------------------------------------------ malformed manifest fields
    *(Case(f"manifest-{cid}", [f"trainer.resume={CK}/step_00000002"], expect, _copy_ck(damage), max_lines=2)
      for cid, damage, expect in [
        ("not-utf8", _manifest_bytes(b'{"format": "\xff\xfe"}'), "not UTF-8 text"),
        ("not-an-object", _manifest_bytes(b"[1, 2, 3]"), "is not an fp8shard checkpoint manifest"),
        ("nested-too-deep", _manifest_bytes(b"[" * 100_000), "JSON nested too deeply"),
        ("too-large", _sparse_manifest, "more than a manifest ever holds"),
        ("is-a-fifo", _replace_with("manifest.json", os.mkfifo), "manifest.json is not a regular file"),
        ("version-bool", _manifest(_set("version", True)), "field version must be an integer from 1"),
        ("version-zero", _manifest(_set("version", 0)), "field version must be an integer from 1"),
        ("step-negative", _manifest(_set("step", -1)), "field step must be null or an integer from 0"),
        ("step-huge", _manifest(_set("step", 10**30)), "field step must be null or an integer from 0"),
        ("step-string", _manifest(_set("step", "2")), "field step must be null or an integer"),
        ("world-size-zero", _manifest(_set("world_size", 0)), "field world_size must be an integer from 1"),
        ("rng-saved-missing", _manifest(lambda m: m.pop("rng_saved")),
         "field rng_saved must be true or false"),
        ("extra-not-object", _manifest(_set("extra", [1])), "field extra must be an object"),
        ("files-not-object", _manifest(_set("files", [".metadata"])), "field files must be an object"),
        ("files-metadata-unlisted", _manifest(lambda m: m["files"].pop(".metadata")),
         "field files must be an object listing .metadata"),
        ("files-escape-directory", _manifest(_rename_file("__0_0.distcp", "../__0_0.distcp")),
         "field files may only name files directly inside the checkpoint directory, got '../__0_0.distcp'"),
        ("files-absolute-path", _manifest(_rename_file("__0_0.distcp", "/etc/passwd")),
         "got '/etc/passwd'"),
        ("files-size-negative", _manifest(_set("files", "__0_0.distcp", "size", -1)),
         "field files['__0_0.distcp'].size must be an integer >= 0"),
        ("files-sha256-short", _manifest(_set("files", "__0_0.distcp", "sha256", "abc123")),
         "field files['__0_0.distcp'].sha256 must be 64 lowercase hex digits"),
        ("files-sha256-not-hex", _manifest(_set("files", "__0_0.distcp", "sha256", "zz" * 32)),
         "sha256 must be 64 lowercase hex digits"),
        ("data-file-is-device", _replace_with("__0_0.distcp", lambda p: p.symlink_to("/dev/zero")),
         "__0_0.distcp is not a regular file"),
        ("model-shape-negative", _manifest(_set(_first_param, "shape", [-1, 64])), "].shape must be a list"),
        ("model-shape-huge", _manifest(_set(_first_param, "shape", [10**9, 10**9])),
         "declares 1000000000000000000 elements, more than the"),
        ("model-dtype-not-a-dtype", _manifest(_set(_first_param, "dtype", "os.system")),
         "].dtype must name a torch dtype, got 'os.system'"),
        ("model-kind-wrong", _manifest(_set(_first_param, "kind", "module")),
         "].kind must be 'param' or 'buffer'"),
        ("model-fp8-wrong", _manifest(_set(_first_param, "fp8", "e9m9")), "].fp8 must be null or one of"),
        ("optimizer-step-negative", _manifest(_set("optimizer", "step", -3)),
         "field optimizer.step must be an integer from 0"),
        ("optimizer-params-entry-missing",
         _manifest(lambda m: m["optimizer"]["params"].pop(next(iter(m["optimizer"]["params"])))),
         "field optimizer.params must be an object with an entry for every parameter"),
        ("optimizer-lr-string", _manifest(_set(_group0, "lr", "fast")),
         "optimizer.param_groups[0].lr is fast, which cannot replace"),
        ("optimizer-betas-out-of-range", _manifest(_set(_group0, "betas", [2.0, 0.9])),
         "optimizer.param_groups[0] is invalid: betas must be two numbers in [0, 1)"),
        ("extra-step-negative", _manifest(_set("extra", "step", -5)), "field extra.step must be an integer"),
        ("extra-log-window-short", _manifest(_set("extra", "log_window", "loss_sums", [])),
         "field extra.log_window must be an object with loss_sums (1 numbers"),
        ("extra-data-wrong", _manifest(_set("extra", "data", {"seed": "x"})),
         "field extra.data must be an object with integers seed"),
      ]),
    Case(
        "resume-never-over-checkpoints",
        ["trainer.resume=never"],
        "holds checkpoints of an earlier run",
        _copy_ck(into="own"),
        run_name="own",
    ),
]

# Issue 19: every number finite and in range, every size bounded by memory, every file and run
# directory problem one line; the run directory's lock; resuming onto other data.
DEEP = "/".join(["d" * 200] * 21) + "/run"  # a run directory path beyond PATH_MAX (4096)
CASES += [
    # ------------------------------------------------------------------ config: finite and in range
    Case("clip-nan", ["trainer.gradient_clip_val=.nan"], "trainer.gradient_clip_val must be a finite number"),
    Case("clip-negative", ["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val must be >= 0"),
    Case("lr-inf", ["model.optim.lr=.inf"], "model.optim.lr must be a finite number, got inf"),
    Case("eps-zero", ["model.optim.eps=0"], "model.optim.eps must be > 0"),
    Case("eps-nan", ["model.optim.eps=.nan"], "model.optim.eps must be a finite number"),
    Case("beta-nan", ["model.optim.betas=[.nan,0.95]"], "model.optim.betas[0] must be a finite number"),
    Case("beta-one", ["model.optim.betas=[0.9,1.0]"], "model.optim.betas must be two numbers in [0, 1)"),
    Case("weight-decay-negative", ["model.optim.weight_decay=-0.1"], "model.optim.weight_decay must be >= 0"),
    Case("weight-decay-inf", ["model.optim.weight_decay=.inf"], "model.optim.weight_decay must be a finite"),
    Case("min-lr-nan", ["model.optim.sched.min_lr=.nan"], "model.optim.sched.min_lr must be a finite number"),
    Case("dropout-negative", ["model.attention_dropout=-0.1"], "model.attention_dropout must be in [0, 1)"),
    Case("init-std-zero", ["model.init_method_std=0"], "model.init_method_std must be > 0"),
    Case("bucket-cap-nan", ["model.optim.bucket_cap_mb=.nan"], "model.optim.bucket_cap_mb must be a finite"),
    Case("timeout-huge", ["trainer.collective_timeout_s=1e12"],
         "trainer.collective_timeout_s must be at most"),
    Case("overflow-factor-half", ["trainer.fp8_overflow_factor=0.5"], "must be 0 (off) or >= 1"),
    Case("concentration-nan", ["data.markov_concentration=.nan"],
         "data.markov_concentration must be a finite"),
    Case("val-fraction-one", ["data.val_fraction=1.0"], "data.val_fraction must be in (0, 1)"),
    Case("model-seed-negative", ["model.seed=-1"], "model.seed must be in [0, 2**32)"),
    Case("data-seed-huge", ["data.seed=99999999999"], "data.seed must be in [0, 2**32)"),
    Case("fp8-margin-huge", ["model.fp8_margin=2000"], "model.fp8_margin must be < 32"),
    Case("markov-order-beyond-seq", ["data.markov_order=100"], "data.markov_order (100) must be <="),
    Case("markov-spread-too-wide", ["data.markov_spread=200"], "data.markov_spread must be in [0,"),
    Case("fsdp2-one-process", ["trainer.strategy=fsdp2"], "trainer.strategy=fsdp2: it shards over 2+ ranks"),
    Case("overwrite-with-auto", ["trainer.overwrite=true"],
         "trainer.overwrite=true needs trainer.resume=never"),
    # ------------------------------------------------------------------ config: sizes bounded by memory
    Case("hidden-size-huge", ["model.hidden_size=1048576", "model.num_attention_heads=1"],
         "parameters and optimizer"),
    Case("layers-huge", ["model.num_layers=100000000"], "model.num_layers: make those smaller"),
    Case("micro-batch-huge", ["model.micro_batch_size=10000000", "model.global_batch_size=10000000"],
         "which grows with model.micro_batch_size"),
    Case("seq-len-huge", ["model.encoder_seq_length=100000", "data.num_train_tokens=300000",
                          "data.num_val_tokens=300000"], "attention scores"),
    Case("vocab-huge", ["data.vocab_size=1000000000"], "data.vocab_size"),
    Case("corpus-huge", ["data.num_train_tokens=100000000000"], "the largest part: data"),
    Case("amax-history-huge", ["model.fp8_amax_history_len=10000000000"], "model.fp8_amax_history_len"),
    # ------------------------------------------------------------------ presets and run directories
    Case("preset-is-directory", ["config={tmp}"], "is a directory, not a YAML file"),
    Case("preset-not-utf8", ["config={tmp}/latin1.yaml"], "is not UTF-8 text",
         _write("latin1.yaml", b"trainer:\n  max_steps: 3  # caf\xe9\n")),
    Case("preset-unreadable", ["config=/proc/self/mem"], "config: cannot read /proc/self/mem"),
    Case("name-too-long", [], "exp_manager.name is 300 bytes long", run_name="n" * 300),
    Case("path-too-long", [], "exceeds the system's limit of", run_name=DEEP),
    Case("exp-dir-is-a-file", [], "exp_manager.exp_dir: ", _write("f", b"x"), run_name="f/run"),
    Case("run-dir-is-a-file", [], "exists and is not a directory", _write("run", b"x")),
    # ------------------------------------------------------------------ data
    Case("tokens-path-is-a-device", ["data.source=tokens", "data.path=/dev/null"], "is not a regular file"),
    Case(
        "tokenizer-is-a-directory",
        ["data.source=text", "data.path={tmp}/t.txt", "data.tokenizer={tmp}"],
        "data.tokenizer: ",
        _write("t.txt", TEXT.encode()),
    ),
    # ------------------------------------------------------------------ the run directory's earlier run
    Case("auto-over-incomplete-checkpoints", ["trainer.resume=auto"],
         "but none is complete (no valid manifest",
         _copy_without_manifests, run_name="own"),
    Case("never-over-incomplete-checkpoints", ["trainer.resume=never"], "incomplete checkpoint directories",
         _copy_without_manifests, run_name="own"),
    Case("overwrite-would-delete-resume-source",
         ["trainer.overwrite=true", "trainer.resume={tmp}/own/checkpoints"],
         "trainer.overwrite=true would delete", _copy_ck(into="own"), run_name="own"),
    Case("run-dir-locked", [], "is in use by another training job (held by pid 4242 on otherhost",
         _locked_by_another_job, run_name="own"),
    # ------------------------------------------------------------------ resuming onto other data
    Case("resume-other-data-seed", ["data.seed=99"],
         "data.seed=99 but the checkpoint was trained with data.seed=1234",
         _copy_ck(into="own"), run_name="own"),
    Case("resume-other-seq-len", ["model.encoder_seq_length=32", "model.max_position_embeddings=64"],
         "model.encoder_seq_length=32 but the checkpoint was trained with model.encoder_seq_length=64",
         _copy_ck(into="own"), run_name="own"),
    Case("resume-other-corpus", ["data.num_train_tokens=50000"],
         "data.num_train_tokens=50000 but the checkpoint",
         _copy_ck(into="own"), run_name="own"),
]
NEW_CASES = 46  # issue 19's additions above


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """A tiny run of 2 steps with one checkpoint (step 2), made once for the module."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    assert main(run_args(run_dir, "checkpoint.every_n_steps=2", "checkpoint.keep_last=1")) == 0
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 1
    return run_dir


def test_enough_cases():
    assert len(CASES) >= 25 + NEW_CASES and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, checkpointed, capsys):
    if case.setup is not None:
        case.setup(tmp_path, checkpointed)
    before = tree_digest(tmp_path)
    base = tree_digest(checkpointed)
    run_dir = tmp_path / case.run_name
    args = [a.format(tmp=tmp_path, ck=checkpointed) for a in case.args]
    code = main(run_args(run_dir, *args))
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err and "Traceback" not in out
    assert err.startswith("fp8shard.train: error: ") and case.expect in err, err
    assert len(err.splitlines()) <= case.max_lines  # one message, then the hint
    assert tree_digest(tmp_path) == before  # nothing written: no run directory, no file changed
    assert tree_digest(checkpointed) == base
