"""Generates the golden embedding vectors the Rust embedder is tested against.

Run once with the Python reference (sentence-transformers on torch CPU) and commit the output:

    python scripts/golden_vectors.py MODEL_DIR tests/data/golden/all-minilm-l6-v2.json

MODEL_DIR is the model's directory in the fluxmem cache (`fluxmem models list` shows it).
"""
import json
import sys

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "Hey Mel! Good to see you! How have you been?",
    "Caroline: I went to a LGBTQ support group yesterday and it was so powerful.",
    "Refunds are allowed within 30 days of delivery.",
    "Restart the nightly export job that failed with a timeout.",
    "put a clean lettuce in diningtable",
    "short",
    "",
    "Émojis and accents: café, naïve, 東京, 🚀 — all fine?",
    "The quick brown fox jumps over the lazy dog. " * 60,  # well past 256 tokens: truncation
    "123 456 7890 + numbers, punctuation!!! (and) [brackets] {braces}",
    "Melanie: I'm swamped with the kids & work. What's up with you? Anything new?",
    "book_reservation(user_id='mia_li_3668', origin='JFK', destination='SEA')",
]


def main(model_dir, out):
    torch.set_num_threads(2)
    model = SentenceTransformer(model_dir, device="cpu")
    vectors = model.encode(SENTENCES, batch_size=4, normalize_embeddings=False, convert_to_numpy=True)
    data = {
        "model": "all-minilm-l6-v2",
        "generator": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
        "max_seq_length": model.max_seq_length,
        "sentences": SENTENCES,
        "vectors": [[float(x) for x in v] for v in vectors],
    }
    with open(out, "w") as f:
        json.dump(data, f)
    print(f"wrote {len(SENTENCES)} vectors of {len(vectors[0])} dims to {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
