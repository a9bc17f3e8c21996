"""Generator throughput: fluxmem (candle) against llama.cpp (llama-cpp-python), same GGUF files.

For each model: fluxmem's `examples/generator_bench.rs` (prefill of a ~250-token chat prompt,
decode of 64 greedy tokens, for each weight path: as stored, f32 at load, Q8_0 at load, and
both: f32 for the prompt and Q8_0 for the decode steps), then
llama.cpp on the same file with the same thread count, the same prefill text (without the chat template:
a dozen tokens shorter) measured as one eval, and decode as a 64-token greedy chat completion
(the model's template) minus its prompt's share of the time (the rule generator_bench uses). Prints one table with the ratios fluxmem / llama.cpp. Run by hand:

    python benches/generate_vs_llamacpp.py [--threads 2] [--repeat 2] [--models a,b,c] [--weights stored,f32,q8,mixed]

Needs llama-cpp-python in the running Python (`pip install llama-cpp-python` builds llama.cpp
from source, about 10 minutes on 2 cores) and the models in the fluxmem cache
(`fluxmem models fetch`).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = "smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m,qwen2.5-coder-1.5b-instruct-q4_k_m"
PASSAGE = ("Caroline: I went to a LGBTQ support group yesterday and it was so powerful. "
           "Melanie: That's great! I'm swamped with the kids and work, but we went camping last weekend. ")
PREFILL = PASSAGE * 6 + "\nSummarise the conversation above."
DECODE = "Write a long story about a lighthouse keeper."


def gguf(name):
    out = subprocess.run(["cargo", "run", "--quiet", "--", "models", "list", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    folder = next(m["dir"] for m in json.loads(out) if m["name"] == name)
    return sorted(glob.glob(os.path.join(folder, "*.gguf")))[0]


def fluxmem(name, threads, repeat, weights):
    """{weights: (prefill tok/s, decode tok/s, prompt tokens)} from generator_bench."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(["cargo", "run", "--quiet", "--example", "generator_bench", "--", "--model", name, "--repeat", str(repeat), "--weights", weights],
                         cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
    rows = {}
    for line in out.splitlines():
        for weights in ("as stored", "f32 at load", "Q8_0 at load", "f32 + Q8_0"):
            if line.startswith(weights):
                numbers = line[len(weights):].split()
                rows[weights] = (float(numbers[1]), float(numbers[2]), int(numbers[3]))
    return rows


def llama_cpp(path, threads, repeat):
    """(prefill tok/s, decode tok/s, prompt tokens) of llama.cpp on `path`."""
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False, seed=42)
    tokens = llm.tokenize(PREFILL.encode())
    prefill = float("inf")
    for _ in range(repeat):
        llm.reset()
        started = time.perf_counter()
        llm.eval(tokens)
        prefill = min(prefill, time.perf_counter() - started)
    decode = 0.0
    for _ in range(repeat):
        llm.reset()
        started = time.perf_counter()
        # The model's chat template, as fluxmem's generate applies it.
        reply = llm.create_chat_completion([{"role": "user", "content": DECODE}], max_tokens=64, temperature=0.0, top_k=1)
        usage = reply["usage"]
        seconds = time.perf_counter() - started - prefill * usage["prompt_tokens"] / len(tokens)
        decode = max(decode, usage["completion_tokens"] / seconds)
    return len(tokens) / prefill, decode, len(tokens)


def llama_cpp_isolated(path, threads, repeat):
    """llama_cpp in a child process: a crash in the native library is an error that says so."""
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--llama-only", path, "--threads", str(threads), "--repeat", str(repeat)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"llama.cpp on {path} failed (exit status {child.returncode}): {child.stderr.strip()[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--weights", default="stored,f32,q8,mixed", help="fluxmem weight paths (generator_bench --weights)")
    args = parser.parse_args()
    if args.llama_only:
        print(json.dumps(llama_cpp(args.llama_only, args.threads, args.repeat)))
        return
    print(f"threads {args.threads}, best of {args.repeat}; fluxmem: cargo dev profile (models crate at opt-level 3)\n")
    print("| model | fluxmem weights | prefill tok/s fluxmem | llama.cpp | ratio | decode tok/s fluxmem | llama.cpp | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        ours = fluxmem(name, args.threads, args.repeat, args.weights)
        ref_prefill, ref_decode, _ = llama_cpp_isolated(gguf(name), args.threads, args.repeat)
        for weights, (prefill, decode, _) in ours.items():
            print(f"| {name} | {weights} | {prefill:.1f} | {ref_prefill:.1f} | {prefill / ref_prefill:.2f} | "
                  f"{decode:.1f} | {ref_decode:.1f} | {decode / ref_decode:.2f} |", flush=True)


if __name__ == "__main__":
    main()
