"""Write a token file for the token-file trainer: ``train.bin`` and ``val.bin``
(uint16 token ids, memory-mapped by ``train.py``) and ``meta.json`` (the vocabulary
size), as GPT trainers prepare a dataset once before training.

The text is a text file (``--text``), or by default the example GPT's generated
corpus (``etc/examples/gpt/corpus.py``: no download). Tokens are characters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))

from corpus import make_corpus


def prepare(out: Path, text: str, val_fraction: float = 0.1) -> dict[str, int]:
    """Tokenise ``text`` by character into ``out``; what ``meta.json`` holds."""
    alphabet = sorted(set(text))
    index = {ch: i for i, ch in enumerate(alphabet)}
    tokens = np.array([index[ch] for ch in text], dtype=np.uint16)
    split = int(len(tokens) * (1 - val_fraction))
    out.mkdir(parents=True, exist_ok=True)
    tokens[:split].tofile(out / "train.bin")
    tokens[split:].tofile(out / "val.bin")
    meta = {"vocab_size": len(alphabet), "train_tokens": split,
            "val_tokens": len(tokens) - split}
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory for train.bin, val.bin, meta.json")
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: generated)")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8") if args.text else make_corpus()
    meta = prepare(args.out, text)
    print(f"{args.out}: {meta['train_tokens']} train and {meta['val_tokens']} val tokens, "
          f"vocabulary {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
