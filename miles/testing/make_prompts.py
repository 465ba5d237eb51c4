"""Write a small prompt JSONL for the quick start and the end-to-end tests.

    python -m miles.testing.make_prompts --out prompts.jsonl [--count 16]
"""

from __future__ import annotations

import argparse
import json
import os

SUBJECTS = ("a red fox", "a lighthouse", "a bowl of fruit", "a mountain lake", "an old car", "a city street",
            "a cat on a sofa", "a sailing boat", "a forest path", "a desert at noon", "a snowy village",
            "a robot", "a field of sunflowers", "a castle", "a coffee cup", "a waterfall")


def write_prompts(path: str, count: int = 16) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i in range(count):
            subject = SUBJECTS[i % len(SUBJECTS)]
            f.write(json.dumps({"input": f"a photo of {subject}", "metadata": {"id": i}}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=16)
    args = parser.parse_args()
    print(write_prompts(args.out, args.count))


if __name__ == "__main__":
    main()
