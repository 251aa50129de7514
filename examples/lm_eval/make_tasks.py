"""Writes the two example lm-eval tasks' data from the second half of Timon of Athens, the last play of the built-in
Shakespeare and so inside the quick-start's validation tail (its last 5% of tokens): text the model never trained
on. Seeded: running it again writes the same files.

    shakespeare_lines.jsonl  a speech's last 300 characters; which of 4 lines comes next (the others from elsewhere
                             in the play): multiple choice, scored by loglikelihood
    shakespeare_words.jsonl  text cut after the first 3 letters of a word of 6 or more; the rest of the word:
                             generation, exact match

Run from the repository root: python examples/lm_eval/make_tasks.py
"""

import json
import random
import re
from pathlib import Path

from s4accel.data import clean_play, shakespeare_files

HERE = Path(__file__).parent
N, CONTEXT = 60, 300


def context_before(text: str, end: int) -> str:
    """The last CONTEXT characters before `end`, from the start of a line."""
    piece = text[max(0, end - CONTEXT):end]
    return piece[piece.index("\n") + 1:]


def main():
    play = clean_play(shakespeare_files()[-1].read_text())
    text = play[len(play) // 2:]
    rng = random.Random(0)
    lines = list(re.finditer(r"(?m)^([A-Za-z][^\n]{24,70})\n", text))
    choice_rows = []
    for m in rng.sample(lines, N):
        choices = rng.sample([o.group(1) for o in lines if o is not m], 3) + [m.group(1)]
        rng.shuffle(choices)
        choice_rows.append({"context": context_before(text, m.start()), "choices": choices,
                            "answer": choices.index(m.group(1))})
    word_rows = []
    for m in rng.sample(list(re.finditer(r"\b[a-z]{6,}\b", text)), N):
        word_rows.append({"context": context_before(text, m.start() + 3), "target": m.group()[3:]})
    for name, rows in [("shakespeare_lines", choice_rows), ("shakespeare_words", word_rows)]:
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
