"""What the Ray tests share: the pipeline over the samples in data/, the binary, the models."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# The models (CPU, no generator or judge: skills worded by template) and the samples' inputs,
# for a pipeline's `name`, `store` and `seed` to go before and its stage settings after.
SAMPLES = """\
[models]
device = "cpu"
generator = "none"
judge = "none"

[[inputs]]
paths = ["{data}/trajectories.jsonl", "{data}/knowledge/*.md"]

[[inputs]]
paths = ["{data}/tau-bench/*.json"]
format = "tau-bench"
tenant = "airline"

[[inputs]]
paths = ["{data}/alfworld/*.json"]
format = "alfworld"
tenant = "alfworld"
"""


def samples_pipeline(head: str, tail: str) -> str:
    """A pipeline over the samples: ``head`` (name, store, seed), the models and inputs, ``tail``."""
    return head + "\n" + SAMPLES.format(data=REPO / "data") + "\n" + tail


def binary() -> str:
    """The fluxmem binary under test (FLUXMEM_BIN)."""
    path = os.environ.get("FLUXMEM_BIN")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"FLUXMEM_BIN must name the built fluxmem binary (got {path!r}); run scripts/test.sh")
    return path


def models_env() -> dict:
    """The environment a fluxmem process or actor needs: where the models are."""
    return {"FLUXMEM_MODELS": os.environ.get("FLUXMEM_MODELS", str(Path.home() / ".cache/fluxmem/models"))}
