"""Build a draft vocabulary from text (``vllm-bole draft-vocab``): the token ids that ``draft_vocab`` reads.

    vllm-bole draft-vocab --tokenizer Qwen/Qwen3.5-9B --text corpus.txt --size 32768 --out draft_vocab.json

Tokenizes the text files with the model's tokenizer, keeps the ``--size`` most frequent token ids (ties to the
lower id) and writes them as a JSON list, most frequent first. It prints the share of the text's tokens they
cover: a drafter limited to them can still propose the target's token at about that share of positions (the rest
it can never propose). Use text like what will be served.
"""

import argparse
import json
from collections import Counter
from pathlib import Path


def count_tokens(tokenizer, paths: list[Path], chunk_chars: int = 1 << 20) -> Counter:
    """Token id counts of the files' text (read and tokenized in chunks of about ``chunk_chars``)."""
    counts = Counter()
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            while chunk := f.read(chunk_chars):
                counts.update(tokenizer.encode(chunk, add_special_tokens=False))
    return counts


def most_frequent(counts: Counter, size: int) -> list[int]:
    """The ``size`` most frequent ids, most frequent first, ties to the lower id."""
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="the served model's tokenizer (name or directory)")
    parser.add_argument("--text", required=True, nargs="+", type=Path, help="UTF-8 text files")
    parser.add_argument("--size", required=True, type=int, help="token ids to keep")
    parser.add_argument("--out", required=True, type=Path, help="JSON list of token ids (draft_vocab's path)")
    return parser


def run(args) -> int:
    from transformers import AutoTokenizer

    if args.size < 1:
        raise SystemExit(f"--size must be a positive integer, got {args.size}")
    missing = [str(p) for p in args.text if not p.is_file()]
    if missing:
        raise SystemExit(f"--text: no such file(s) {missing}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    counts = count_tokens(tokenizer, args.text)
    total = sum(counts.values())
    if not total:
        raise SystemExit("--text: the files hold no tokens")
    ids = most_frequent(counts, args.size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(ids))
    covered = sum(counts[t] for t in ids)
    print(f"{len(ids)} of {len(counts)} distinct token ids ({total} tokens of text) cover {covered / total:.2%} of "
          f"the text's tokens; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
