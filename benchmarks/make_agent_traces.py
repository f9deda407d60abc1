#!/usr/bin/env python3
"""Build the two agent traces of `dflash bench --agent-trace` from ../shared/datasets.

Each trace is what an agent sends turn after turn: a fixed preamble (instructions, tool
definitions, worked examples), then the conversation so far (the recorded answers from
the dataset stand for the model's earlier replies), then the new task. So request k's
prompt starts with request k-1's; the last request of each trace branches off early
(it keeps the preamble and the first turns only), to exercise longest-prefix reuse.

    python benchmarks/make_agent_traces.py ../shared/datasets benchmarks/traces

- ``agent_mbpp.jsonl``: a coding agent over MBPP (sanitized test split): tool
  definitions, then per turn a task, its tests, and the recorded solution as the
  tool's result. 8 growing requests + 1 branch.
- ``agent_gsm8k.jsonl``: a math agent over GSM8K (test split): four worked examples,
  then per turn a question and its recorded worked answer. 8 growing requests + 1 branch.
"""

import argparse
import json
from pathlib import Path

TOOLS = """You are a coding agent. You can call these tools, one per message, as JSON:
- run_tests(code: str, tests: list[str]) -> {passed: int, failed: int, log: str}: runs the tests on the code.
- read_file(path: str) -> str: the text of a file of the repository.
- write_file(path: str, text: str) -> None: replaces a file of the repository.
Write small functions, test them, and answer with the final code only.
"""

MATH = """You are a careful math tutor. Solve each problem step by step, show the arithmetic,
and end with the final answer on its own line after ####. Here are solved examples.
"""


def rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def growing(preamble: str, turns, branch_at: int, branch_turn: str):
    """Requests: preamble + turns[:k] history + the k-th task, k = 1..len; then a branch."""
    out, history = [], preamble
    for task, answer in turns:
        out.append({"prompt": history + task})
        history += task + answer
    kept = preamble + "".join(t + a for t, a in turns[:branch_at])
    out.append({"prompt": kept + branch_turn})
    return out


def mbpp(datasets: Path, n: int = 8):
    items = rows(datasets / "mbpp_sanitized_test.jsonl")
    turns = []
    for it in items[:n]:
        tests = "\n".join(it["test_list"])
        turns.append((f"\nTask: {it['prompt']}\nTests:\n{tests}\n", f"Result:\n{it['code']}\n"))
    extra = items[n]
    return growing(TOOLS, turns, 2, f"\nTask: {extra['prompt']}\nTests:\n" + "\n".join(extra["test_list"]) + "\n")


def gsm8k(datasets: Path, n: int = 8, shots: int = 4):
    items = rows(datasets / "gsm8k_test.jsonl")
    preamble = MATH + "".join(f"\nQuestion: {it['question']}\nAnswer: {it['answer']}\n" for it in items[:shots])
    turns = [(f"\nQuestion: {it['question']}\nAnswer: ", f"{it['answer']}\n") for it in items[shots:shots + n]]
    extra = items[shots + n]
    return growing(preamble, turns, 1, f"\nQuestion: {extra['question']}\nAnswer: ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("datasets", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for name, reqs in (("agent_mbpp", mbpp(a.datasets)), ("agent_gsm8k", gsm8k(a.datasets))):
        path = a.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        print(f"wrote {path}: {len(reqs)} requests, {max(len(r['prompt']) for r in reqs)} characters at most")


if __name__ == "__main__":
    main()
