"""Tasks with verifiable rewards: the model answers a question by writing a shell command, reads
the command's output, and states the answer.

One episode, as the byte-level model sees it (``$ `` opens the tool turn, ``A: `` the answer)::

    37 + 45               <- prompt
    $ expr 37 + 45        <- turn 1, sampled; ends at the newline; runs in a DSec sandbox
    82                    <- observation (appended, never sampled)
    A: 82                 <- turn 2, sampled; the reward is 1 when it equals the true answer

Kinds: ``add``/``sub`` (shell arithmetic with ``expr``) and ``rev``/``upper``/``len`` (string
tools). The formats keep every byte the command must copy from the question within the tiny
preset's 16-token attention window.
The split is a pure function of the question (a hash), so the held-out questions never appear
in training rollouts or in the supervised demonstrations. RL rounds draw training-split questions
that the demonstrations do not contain (``rl_stream``), so what RL improves is the skill, not
recall of demonstrated answers - the same thing the held-out split measures.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

WORDS = ["fox", "house", "river", "engine", "garden", "window", "cache", "kernel", "sandbox", "model",
         "token", "expert", "router", "matrix", "stream", "red", "quiet", "old", "bright", "heavy", "green",
         "quick", "cold", "round", "paris", "lima", "oslo", "cairo", "kyoto", "quito", "perth", "delhi"]
KINDS = ("add", "sub", "rev", "upper", "len")
TOOL_OPEN = "\n$ "
ANSWER_OPEN = "\nA: "
HELD_OUT_PER_MILLE = 150
VERSION = 2  # bump when the episode format changes (keys the supervised checkpoint)


@dataclass(frozen=True)
class Task:
    kind: str
    args: tuple
    question: str
    answer: str
    command: str  # the demonstration's command (any command whose output is the answer earns reward)

    @property
    def id(self) -> str:
        return hashlib.blake2b(self.question.encode(), digest_size=6).hexdigest()

    @property
    def held_out(self) -> bool:
        return int(hashlib.blake2b(self.question.encode(), digest_size=8).hexdigest(), 16) % 1000 < HELD_OUT_PER_MILLE

    def prompt(self) -> str:
        return make_prompt(self.question)

    def demonstration(self) -> str:
        return f"{self.prompt()}{self.command}\n{observation(self.answer + chr(10))}{self.answer}\n"


def make_prompt(question: str) -> str:
    return f"{question}{TOOL_OPEN}"


def make(kind: str, args: tuple) -> Task:
    if kind in ("add", "sub"):
        a, b = args
        op = "+" if kind == "add" else "-"
        return Task(kind, args, f"{a} {op} {b}", str(a + b if kind == "add" else a - b), f"expr {a} {op} {b}")
    (w,) = args
    if kind == "rev":
        return Task(kind, args, f"rev {w}", w[::-1], f"echo {w} | rev")
    if kind == "upper":
        return Task(kind, args, f"upper {w}", w.upper(), f"echo {w} | tr a-z A-Z")
    if kind == "len":
        return Task(kind, args, f"len {w}", str(len(w)), f"printf {w} | wc -c")
    raise ValueError(f"task field 'kind': expected one of {KINDS}, got {kind!r}")


def sample(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> Task:
    kind = rng.choice(kinds)
    if kind in ("add", "sub"):
        return make(kind, (rng.randint(0, 99), rng.randint(0, 99)))
    return make(kind, (rng.choice(WORDS),))


def stream(split: str, seed: int, kinds: tuple[str, ...] = KINDS):
    """An endless deterministic stream of tasks of ``split`` ('train' or 'eval')."""
    if split not in ("train", "eval"):
        raise ValueError(f"task field 'split': expected 'train' or 'eval', got {split!r}")
    rng = random.Random(seed)
    want = split == "eval"
    while True:
        t = sample(rng, kinds)
        if t.held_out == want:
            yield t


def demonstrated(n_bytes: int, seed: int = 0) -> frozenset[str]:
    """The questions the supervised corpus of (``n_bytes``, ``seed``) demonstrates."""
    return frozenset(line for line in demonstrations(n_bytes, seed).split("\n")
                     if line and not line.startswith(("$ ", "A: ")) and parse_ok(line))


def parse_ok(line: str) -> bool:
    try:
        parse_question(line)
        return True
    except ValueError:
        return False


def rl_stream(seed: int, exclude: frozenset[str], kinds: tuple[str, ...] = KINDS):
    """Training-split questions outside ``exclude`` (the demonstrated ones)."""
    for t in stream("train", seed, kinds):
        if t.question not in exclude:
            yield t


def take(split: str, n: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Task]:
    it = stream(split, seed, kinds)
    return [next(it) for _ in range(n)]


def eval_set(n: int, seed: int = 12345, kinds: tuple[str, ...] = KINDS) -> list[Task]:
    """``n`` distinct held-out tasks (fixed by ``seed``)."""
    out, seen = [], set()
    for t in stream("eval", seed, kinds):
        if t.question not in seen:
            seen.add(t.question)
            out.append(t)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def demonstrations(n_bytes: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> str:
    """The supervised corpus: whole training-split episodes, one blank line apart."""
    out, size = [], 0
    for t in stream("train", seed, kinds):
        d = t.demonstration() + "\n"
        out.append(d)
        size += len(d)
        if size >= n_bytes:
            return "".join(out)
    raise AssertionError("unreachable")


def observation(stdout: str, limit: int = 24) -> str:
    """What is appended after a tool call: the output's first line (cut), then the answer cue."""
    line = stdout.split("\n", 1)[0].strip()[:limit]
    return f"{line or '(no output)'}{ANSWER_OPEN}"


def tool_command(context: str, turn: str) -> str | None:
    """The command a turn asks to run: a turn that follows ``$ `` and ends at a newline."""
    if context.endswith(TOOL_OPEN) and turn.endswith("\n") and turn.strip():
        return turn[:-1]
    return None


def reward(task: Task, answer_turn: str) -> float:
    """1.0 when the answer turn (up to its newline) equals the true answer, else 0.0."""
    return 1.0 if answer_turn.split("\n", 1)[0].strip() == task.answer else 0.0


def parse_question(question: str) -> Task:
    """The task a question names (kinds and argument ranges checked), so a reward needs no lookup."""
    parts = question.split()
    if len(parts) == 3 and parts[1] in ("+", "-"):
        if not all(p.isdigit() and len(p) <= 3 for p in (parts[0], parts[2])):
            raise ValueError(f"task field 'question': arithmetic takes two integers 0..999, got {question!r}")
        return make("add" if parts[1] == "+" else "sub", (int(parts[0]), int(parts[2])))
    if len(parts) != 2 or parts[0] not in ("rev", "upper", "len"):
        raise ValueError(f"task field 'question': not a known task: {question!r}")
    if not parts[1].isalpha() or not parts[1].isascii() or len(parts[1]) > 16:
        raise ValueError(f"task field 'question': {parts[0]} takes one word of ASCII letters, got {question!r}")
    return make(parts[0], (parts[1],))
