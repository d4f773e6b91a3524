"""``python -m fp8shard.generate CKPT --prompt TEXT --max-new-tokens N``: sample text from a run.

``CKPT`` is a checkpoint, a run directory (its newest checkpoint) or a checkpoints folder; the
model and its tokenizer come from the run (``fp8shard.pretrained``). Sampling: softmax of the
last position's logits divided by ``--temperature`` (0: always the most likely token), kept to
the ``--top-k`` most likely ids, drawn with a ``torch.Generator`` seeded by ``--seed``, so the
same command prints the same text. Each token runs only itself through the model, with the
keys and values of the tokens before it kept ([Note: KV cache] in models/gpt.py; ``--no-kv-cache``
runs the whole context every time: the same tokens, slower). The context is cut to the model's
last ``max_position_embeddings`` tokens; a BPE's end-of-text token ends a sample.

``--precision fp32`` (default) computes with the FP32 master weights and no FP8, as an export
does; ``--precision trained`` the way the run computed (FP8 weights and GEMMs, bf16 autocast).
A run on the generated corpus has no text: give ``--prompt-ids`` and read ids back.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

import torch

from fp8shard.models import GPT, KVCache
from fp8shard.pretrained import Pretrained, PretrainedError, open_pretrained

PROG = "python -m fp8shard.generate"


@torch.no_grad()
def sample(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, seed: int = 0, stop_id: int | None = None,
           vocab_limit: int | None = None,
           context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
           use_cache: bool = True) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled ids (fewer if ``stop_id`` comes).

    ``vocab_limit``: never sample ids at or past it (the padding rows of a vocabulary larger
    than the tokenizer's). Deterministic for a given ``seed``. ``use_cache``: keep the keys and
    values of the tokens so far ([Note: KV cache]); False runs the whole context every token.
    """
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    window = model.config.max_position_embeddings
    # [Note: KV cache]: each call runs only the new token while the context fits the positions;
    # past them the last window runs whole, every call (its positions shift by one each time).
    cache = KVCache(model.config) if use_cache and ids.shape[1] < window else None
    fed = 0  # tokens of ids the cache holds
    for _ in range(max_new_tokens):
        if cache is not None and ids.shape[1] > window:
            cache = None
        with context():
            if cache is None:
                logits = model(ids[:, -window:])[:, -1, :].float()
            else:
                logits = model(ids[:, fed:], cache=cache)[:, -1, :].float()
                fed = ids.shape[1]
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
        if stop_id is not None and int(nxt) == stop_id:
            break
    return [int(i) for i in ids[0].tolist()]


def prompt_ids(pre: Pretrained, prompt: str | None, ids_text: str | None) -> list[int]:
    """The prompt as ids: ``--prompt-ids`` as given, else the prompt encoded by the run's tokenizer
    (an empty prompt starts from the end-of-text token, or a newline for byte-level ids)."""
    if ids_text is not None:
        try:
            ids = [int(t) for t in ids_text.replace(",", " ").split()]
        except ValueError:
            raise PretrainedError(f"--prompt-ids must be integers separated by spaces or commas, "
                                  f"got {ids_text!r}") from None
        bad = [i for i in ids if not 0 <= i < pre.gpt_config.vocab_size]
        if bad or not ids:
            raise PretrainedError(f"--prompt-ids needs ids in [0, {pre.gpt_config.vocab_size}), "
                                  f"got {ids_text!r}")
        return ids
    tok = pre.tokenizer
    if tok is None:
        raise PretrainedError(f"this run's tokens stand for no text (data.source={pre.config.data.source}): "
                              "give the prompt as --prompt-ids, e.g. --prompt-ids 1,2,3")
    ids = tok.encode(prompt or "")
    if not ids:
        ids = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
    return ids


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Sample text from a trained model (seeded: the same "
                                                       "command prints the same text).")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint, a run directory (its newest checkpoint) "
                                                      "or a checkpoints folder")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--prompt-ids", default=None, metavar="IDS",
                   help="the prompt as token ids (e.g. 1,2,3): for runs whose tokens stand for no text")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 takes the most likely token every time (default 0.8)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely ids; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples to print (seeds SEED, SEED+1, ...)")
    p.add_argument("--precision", choices=("fp32", "trained"), default="fp32",
                   help="fp32 (default): the FP32 master weights without FP8; trained: the run's FP8 "
                        "weights, recipe and autocast")
    p.add_argument("--tokenizer", default=None,
                   help="override the run's tokenizer: a tokenizers JSON file, bytes, or none")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="run the whole context for every token (the same tokens, slower; to compare)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_new_tokens < 0 or args.num_samples < 1 or args.top_k < 0 or args.temperature < 0:
        print(f"{PROG}: error: --max-new-tokens, --top-k and --temperature must be >= 0 and --num-samples "
              ">= 1", file=sys.stderr)
        return 2
    try:
        pre = open_pretrained(args.checkpoint, tokenizer=args.tokenizer)
        prompt = prompt_ids(pre, args.prompt, args.prompt_ids)
        if args.precision == "trained":
            model = pre.trained_model(args.device)
            sync = pre.amax_sync(model)  # delayed scaling: scales updated after each forward
            ctx: Callable[[], contextlib.AbstractContextManager] = \
                lambda: pre.forward_context(args.device, sync)
        else:
            model, ctx = pre.model(device=args.device), contextlib.nullcontext
    except PretrainedError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    tok = pre.tokenizer if args.prompt_ids is None else None
    for i in range(args.num_samples):
        out = sample(model, prompt, args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k or None, seed=args.seed + i,
                     stop_id=None if pre.tokenizer is None else pre.tokenizer.eot_id,
                     vocab_limit=None if pre.tokenizer is None else pre.tokenizer.vocab_size, context=ctx,
                     use_cache=not args.no_kv_cache)
        if i:
            print("-" * 40)
        if tok is None:
            print(" ".join(str(t) for t in out))
        else:
            text = tok.decode([t for t in out if t != tok.eot_id])
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
