"""Decode speed on the embedded model, batch 1, greedy, one prompt, one thread count, side by side:
dspark's engine in fp32, in bf16 with packed weights, and in bf16 with the model's own 4-bit weights
(the GGUF's Q4_1 groups through dspark's own kernels on 8-bit activations, which is what dtype/quantization
"auto" picks on AVX-512-bf16 + VNNI CPUs, on bf16 activations (DSPARK_INT8_ACTIVATIONS=0), on AMX tiles
where the CPU has them (DSPARK_AMX=1), and through PyTorch's kernels alone), in fp32 with the 4-bit weights
on the AVX2 kernels (what "auto" picks on CPUs without AVX-512-bf16) vs transformers' generate() in
fp32 (its fastest CPU setting), plus the memory roofline per format (weight bytes / measured read
bandwidth). Where `make llamacpp` has built llama.cpp, its `llama-bench` decodes the same GGUF on the same
threads (tg: no prompt, --tokens new tokens) in the same interleaved rounds.

    .venv/bin/python bench/decode_speed.py [--tokens 128] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark import LLM, SamplingParams
from dspark.bench.roofline import ceiling_tokens_per_s, read_bandwidth_gbs, weight_bytes
from dspark.models import native, native_avx2
from dspark.models.embedded import dspark_home, find_gguf
from dspark.models.loader import resolve_dtype

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_dspark(llm: LLM, prompt_ids: list[int], n: int) -> float:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    llm.generate([prompt_ids], params)  # warm-up
    t = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    return len(out.token_ids) / (time.perf_counter() - t)


def time_transformers(model, prompt_ids: list[int], n: int) -> float:
    ids = torch.tensor([prompt_ids])
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        model.generate(ids, **kw)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)


def time_llama_bench(binary, gguf, n: int) -> float:
    """llama.cpp's own decode speed (tokens/s) for n tokens, one run."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(torch.get_num_threads()), "-p", "0", "-n", str(n),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(re.search(r'"avg_ts":\s*([0-9.eE+-]+)', out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engines = {"float32": LLM(dtype="float32", quantization="none"),
               "bfloat16": LLM(dtype="bfloat16", quantization="none"),
               "bfloat16_int4": LLM(dtype="bfloat16", quantization="int4")}
    routes = {}  # engine -> the kernels' matmul route it was loaded for (switched to while it runs)
    if native.library() is not None:  # the same 4-bit weights on the other routes, and on PyTorch's kernels
        for route in ("bf16_activations", "amx"):
            with native.route(route) as runs:
                if runs:
                    routes[f"bfloat16_int4_{route}"] = route
                    engines[f"bfloat16_int4_{route}"] = LLM(dtype="bfloat16", quantization="int4")
        os.environ[native.ENV] = "torch"
        engines["bfloat16_int4_torch_kernels"] = LLM(dtype="bfloat16", quantization="int4")
        del os.environ[native.ENV]
    if native_avx2.library() is not None:  # fp32 rows on the AVX2 kernels (the default where AVX-512 is missing)
        engines["float32_int4"] = LLM(dtype="float32", quantization="int4")
    path = engines["float32"].model_path
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt_ids = tok.encode(engines["float32"].apply_chat_template([{"role": "user", "content": PROMPT}]))
    speeds: dict[str, list[float]] = {f"dspark_{k}": [] for k in engines}
    speeds["transformers_float32"] = []
    llama_bench = dspark_home() / "llama.cpp" / "bin" / "llama-bench"
    if llama_bench.exists():
        speeds["llama_cpp_llama_bench"] = []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every method
        for name, llm in engines.items():
            with native.route(routes[name]) if name in routes else contextlib.nullcontext():
                speeds[f"dspark_{name}"].append(time_dspark(llm, prompt_ids, args.tokens))
        speeds["transformers_float32"].append(time_transformers(hf, prompt_ids, args.tokens))
        if llama_bench.exists():
            speeds["llama_cpp_llama_bench"].append(time_llama_bench(llama_bench, find_gguf(), args.tokens))
    bw = read_bandwidth_gbs()
    ref = statistics.median(speeds["transformers_float32"])
    result = {"threads": torch.get_num_threads(), "tokens": args.tokens, "prompt_tokens": len(prompt_ids),
              "auto_dtype": str(resolve_dtype("auto")).removeprefix("torch."),
              "weight_formats": {f"dspark_{k}": llm.decoder.weight_format for k, llm in engines.items()},
              "read_bandwidth_gb_s": round(bw, 2),
              "tokens_per_s": {k: [round(x, 2) for x in v] for k, v in speeds.items()},
              "median_tokens_per_s": {k: round(statistics.median(v), 2) for k, v in speeds.items()},
              "speedup_vs_transformers": {k: round(statistics.median(v) / ref, 2) for k, v in speeds.items()}}
    for name, llm in engines.items():
        nbytes = weight_bytes(llm.decoder)
        roofline = ceiling_tokens_per_s(bw, nbytes)
        result[f"dspark_{name}_weight_bytes"] = nbytes
        result[f"dspark_{name}_roofline_tokens_per_s"] = round(roofline, 2)
        result[f"dspark_{name}_fraction_of_roofline"] = round(statistics.median(speeds[f"dspark_{name}"]) / roofline, 3)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
