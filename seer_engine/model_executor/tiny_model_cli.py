"""``seer_engine make-tiny-model OUT``: a tiny random-weight checkpoint from the command line."""

from __future__ import annotations

import argparse
from typing import Any

from seer_engine.model_executor.tiny_model import (
    ARCHITECTURES,
    DTYPES,
    make_tiny_model,
    resolve_tokenizer_file,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _tokenizer_file(text: str) -> str:
    try:
        return str(resolve_tokenizer_file(text))
    except FileNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register `make-tiny-model OUT [...]` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight Hugging Face model folder",
        description="Write a tiny random-weight Hugging Face checkpoint (config, "
        "safetensors weights, tokenizer) for demos and tests.",
    )
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default="qwen3",
        help="the architecture written to config.json",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        type=_tokenizer_file,
        default=None,
        help="tokenizer.json to copy (default: built-in ~1K byte-level BPE)",
    )
    p.add_argument("--layers", metavar="N", type=_positive_int, default=2, help="decoder layers")
    p.add_argument("--hidden", metavar="N", type=_positive_int, default=64, help="hidden size")
    p.add_argument(
        "--intermediate",
        metavar="N",
        type=_positive_int,
        default=None,
        help="MLP width (default: 3 * hidden)",
    )
    p.add_argument("--heads", metavar="N", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--kv-heads", metavar="N", type=_positive_int, default=2, help="key/value heads")
    p.add_argument(
        "--head-dim", metavar="N", type=_positive_int, default=None, help="default: hidden // heads"
    )
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seeds the random weights")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights")
    p.add_argument(
        "--tie-word-embeddings", action="store_true", help="the output layer reuses the input embeddings"
    )
    p.add_argument(
        "--max-position-embeddings",
        metavar="N",
        type=_positive_int,
        default=4096,
        help="the model's context length",
    )

    def run(args: argparse.Namespace) -> int:
        try:
            path = make_tiny_model(
                args.out,
                arch=args.arch,
                tokenizer=args.tokenizer,
                num_layers=args.layers,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                seed=args.seed,
                dtype=args.dtype,
                tie_word_embeddings=args.tie_word_embeddings,
                max_position_embeddings=args.max_position_embeddings,
            )
        except (ValueError, OSError) as err:
            p.error(str(err))  # exits with status 2 and a usage line, no traceback
        print(path)
        return 0

    p.set_defaults(func=run)
    return p
