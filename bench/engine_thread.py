"""Which thread steps the model: a batch-1 plain decoding step of the embedded model (median over --requests
greedy generations of --max-tokens) when the steps run
  main      on the main thread, which loaded the model (`LLM.generate` in a script);
  second    on a second thread, the model loaded on the main one (dspark serve until session 60);
  compute   on one ComputeThread that both loaded the model and steps it (dspark serve since).
Each case in a fresh process, the cases in turn --repeats times, so a noisy host moves all alike.

    .venv/bin/python bench/engine_thread.py [--repeats 2] [--requests 3] [--max-tokens 128]

Why it matters: OpenMP keeps a worker team per thread that starts parallel work; two teams on the cores
make libgomp stop spinning between parallel regions (dspark/server/compute.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

CASES = ("main", "second", "compute")
PROMPT = "Explain in three sentences why the sky is blue."


def _steps(llm, requests: int, max_tokens: int) -> list[float]:
    """Seconds of each engine step over `requests` greedy generations, one at a time."""
    from dspark import SamplingParams

    eng = llm.engine
    prompt = llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": PROMPT}]),
                                  add_special_tokens=False)
    times = []
    for i in range(requests):
        eng.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        request_id=f"r{i}")
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
    return times


def run_case(case: str, requests: int, max_tokens: int) -> float:
    """Median step seconds of one case, in this process."""
    from dspark import LLM
    from dspark.server.compute import ComputeThread

    if case == "compute":
        compute = ComputeThread()
        return statistics.median(compute.call(lambda: _steps(LLM(), requests, max_tokens)))
    llm = LLM()
    if case == "main":
        return statistics.median(_steps(llm, requests, max_tokens))
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.extend(_steps(llm, requests, max_tokens)))
    worker.start()
    worker.join()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case in this process (internal)
    args = ap.parse_args()
    if args.case:
        print(json.dumps({"case": args.case, "step_s": run_case(args.case, args.requests, args.max_tokens)}))
        return
    results: dict[str, list[float]] = {c: [] for c in CASES}
    for _ in range(args.repeats):
        for case in CASES:
            proc = subprocess.run([sys.executable, __file__, "--case", case, "--requests", str(args.requests),
                                   "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True)
            results[case].append(json.loads(proc.stdout.strip().splitlines()[-1])["step_s"])
    for case in CASES:
        ms = [1e3 * s for s in results[case]]
        print(f"{case:>8}: batch-1 step median {statistics.median(ms):.2f} ms (runs: "
              + ", ".join(f"{m:.2f}" for m in ms) + ")")


if __name__ == "__main__":
    main()
