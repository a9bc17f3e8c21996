"""Embedding throughput: fluxmem (candle) against sentence-transformers (torch CPU).

Same model (all-MiniLM-L6-v2 from the fluxmem model cache), same texts (2,000 LoCoMo dev
texts: every dialogue turn as fluxmem ingests it, then questions to reach 2,000), same thread
count, same batch size, both sort by length. Run by hand:

    python benches/embed_vs_python.py [--threads 2] [--batch-size 32] [--repeat 3]

Needs torch and sentence-transformers in the running Python, and `fluxmem models fetch`.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def texts():
    data = json.load(open(os.path.join(ROOT, "..", "shared", "data", "locomo", "locomo10_dev.json")))
    turns, questions = [], []
    for conversation in data:
        sessions = conversation["conversation"]
        keys = sorted((k for k in sessions if k.startswith("session_") and isinstance(sessions[k], list)),
                      key=lambda k: int(k.split("_")[1]))
        for key in keys:
            for turn in sessions[key]:
                text = f"{turn['speaker']}: {turn['text']}"
                if turn.get("blip_caption"):
                    text += f" [shares a photo: {turn['blip_caption']}]"
                turns.append(text.replace("\n", " "))
        questions += [q["question"].replace("\n", " ") for q in conversation["qa"]]
    return (turns + questions)[:2000]


def model_dir():
    out = subprocess.run(["cargo", "run", "--quiet", "--", "models", "list", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return next(m["dir"] for m in json.loads(out) if m["name"] == "all-minilm-l6-v2")


def python_reference(sentences, threads, batch_size, repeat):
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir(), device="cpu")
    model.encode(sentences[:64], batch_size=batch_size)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        model.encode(sentences, batch_size=batch_size, normalize_embeddings=False)
        best = min(best, time.perf_counter() - started)
    tokens = sum(len(model.tokenizer(s, truncation=True, max_length=model.max_seq_length)["input_ids"]) for s in sentences)
    return {"sentences": len(sentences), "tokens": tokens, "seconds": best}


def fluxmem(path, threads, batch_size, repeat, workers, backend="native"):
    env = dict(os.environ)
    # Workers run whole batches in parallel, each single-threaded; otherwise candle's matmuls use the threads.
    env["RAYON_NUM_THREADS"] = "1" if workers > 1 else str(threads)
    out = subprocess.run(["cargo", "run", "--quiet", "--example", "embed_throughput", "--", path,
                          "--batch-size", str(batch_size), "--workers", str(workers), "--repeat", str(repeat),
                          "--backend", backend],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(out.stderr)
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sentences = texts()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(sentences))
        path = f.name
    rows = [("python sentence-transformers (torch)", python_reference(sentences, args.threads, args.batch_size, args.repeat))]
    native = fluxmem(path, args.threads, args.batch_size, args.repeat, 1)
    rows.append((f"fluxmem native ({native['kernel']} kernel)", native))
    if native["kernel"] != "avx2":
        # The AVX2 kernel (what CPUs without AVX-512 run), next to AVX-512 on the same machine.
        try:
            rows.append(("fluxmem native (avx2 kernel)", fluxmem(path, args.threads, args.batch_size, args.repeat, 1, "native-avx2")))
        except SystemExit as e:
            print(f"no avx2 row: {e}", file=sys.stderr)
    rows.append(("fluxmem native (gemm crate kernels)", fluxmem(path, args.threads, args.batch_size, args.repeat, 1, "native-portable")))
    rows.append(("fluxmem candle BertModel", fluxmem(path, args.threads, args.batch_size, args.repeat, 1, "candle")))
    rows.append((f"fluxmem native, {args.threads} workers x 1 thread", fluxmem(path, args.threads, args.batch_size, args.repeat, args.threads)))
    reference = rows[0][1]["sentences"] / rows[0][1]["seconds"]
    print(f"{len(sentences)} LoCoMo dev texts, batch size {args.batch_size}, {args.threads} threads, best of {args.repeat}")
    # Linear-layer work of all-MiniLM-L6-v2: 6 layers x (384x1152 + 384x384 + 2 x 384x1536)
    # multiply-adds per token (attention's own products, which grow with the length, left out).
    flop_per_token = 2 * 6 * (384 * 1152 + 384 * 384 + 2 * 384 * 1536)
    print(f"{'system':<42} {'sentences/s':>12} {'tokens/s':>10} {'GFLOP/s':>8} {'ratio':>7}")
    for name, result in rows:
        rate = result["sentences"] / result["seconds"]
        tokens = result["tokens"] / result["seconds"]
        print(f"{name:<42} {rate:>12.1f} {tokens:>10.0f} {tokens * flop_per_token / 1e9:>8.1f} {rate / reference:>7.2f}")


if __name__ == "__main__":
    main()
