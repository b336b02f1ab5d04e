"""Engine-thread time per step for the text of streamed samples: whole decode against
``StreamText`` (a few tokens decoded per step).

A streamed sample's text is produced at every step on the engine thread. Decoded whole,
a step costs time in proportion to each output's length; ``StreamText`` decodes the new
tokens with a few before them. For each output length, ``--streams`` outputs of real
text (responses of a rollout trace, tokenized by its tokenizer, repeated to the length)
step ``--steps`` tokens forward; each step's text for all streams is timed both ways, and
every text is compared with the whole decode. The median step is reported.

    python benchmarks/stream_text.py [--streams 64] [--lengths 1024,4096,8192] [--steps 32]

Results go to ``benchmarks/results/stream_text.{md,json}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.stream_text import StreamText
from seer_engine.rollout.machine import describe_machine, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _outputs(detok: Detokenizer, trace: Path, streams: int, length: int) -> list[list[int]]:
    """``streams`` token sequences of ``length`` tokens from the trace's response texts."""
    texts: list[str] = []
    with gzip.open(trace, "rt") as f:
        for line in f:
            row = json.loads(line)
            texts.extend(str(r) for r in row.get("responses", []) if r)
            if len(texts) >= streams:
                break
    if not texts:
        raise SystemExit(f"no response texts in {trace}")
    outputs = []
    for k in range(streams):
        ids = detok.encode(texts[k % len(texts)])
        outputs.append((ids * (length // max(1, len(ids)) + 1))[:length])
    return outputs


def _step_times(detok: Detokenizer, outputs: list[list[int]], start: int, steps: int) -> dict[str, float]:
    """Median seconds of one step's texts for every stream, decoded whole and in pieces."""
    streams = [StreamText(detok, [], True) for _ in outputs]
    for s, ids in zip(streams, outputs):
        s.text(ids[:start])
    whole, pieces = [], []
    for n in range(start + 1, start + steps + 1):
        prefixes = [ids[:n] for ids in outputs]  # the engine holds each output as a list
        t0 = time.perf_counter()
        want = [detok.output_text([], ids) for ids in prefixes]
        t1 = time.perf_counter()
        got = [s.text(ids) for s, ids in zip(streams, prefixes)]
        t2 = time.perf_counter()
        if got != want:
            raise SystemExit(f"streamed text differs from the whole decode at {n} tokens")
        whole.append(t1 - t0)
        pieces.append(t2 - t1)
    return {"whole_s": statistics.median(whole), "pieces_s": statistics.median(pieces)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--tokenizer", default=str(TRACES / "bpe32k-tokenizer.json"))
    p.add_argument("--trace", default=str(TRACES / "qwen3-8b-mcq-cot.jsonl.gz"))
    args = p.parse_args()
    from transformers import PreTrainedTokenizerFast

    detok = Detokenizer(
        PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, clean_up_tokenization_spaces=False)
    )
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        outputs = _outputs(detok, Path(args.trace), args.streams, length + args.steps)
        times = _step_times(detok, outputs, length, args.steps)
        rows.append({"length": length, **times, "speedup": times["whole_s"] / times["pieces_s"]})
        print(f"{length:>6} tokens: whole {times['whole_s'] * 1e3:7.2f} ms/step, "
              f"pieces {times['pieces_s'] * 1e3:6.2f} ms/step", file=sys.stderr, flush=True)  # fmt: skip
    command = "python benchmarks/stream_text.py " + " ".join(sys.argv[1:])
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = {"command": command.strip(), "date": date, "machine": machine_info(), "streams": args.streams,
              "steps": args.steps, "tokenizer": args.tokenizer, "trace": args.trace,
              "rows": rows}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stream_text.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "# Streamed text per step: whole decode against StreamText",
        "",
        f"Command: `{report['command']}`. Date: {date}. Machine: {describe_machine(report['machine'])}.",
        "",
        f"{args.streams} streams of real text (`{Path(args.trace).name}`'s responses,"
        f" `{Path(args.tokenizer).name}`), median of {args.steps} steps;"
        " every step's text equals the whole decode.",
        "",
        "| output tokens | whole decode ms/step | StreamText ms/step | whole / StreamText |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['length']} | {r['whole_s'] * 1e3:.2f} | {r['pieces_s'] * 1e3:.2f} | {r['speedup']:.1f}x |"
            for r in rows
        ),  # fmt: skip
        "",
    ]
    (RESULTS / "stream_text.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
