"""`python -m tools.tiny.train`, run as the README says (from the repository root) for the first
steps of its schedule into a temporary folder: it writes a checkpoint the project's own loader
reads, training_meta.json with the losses of the steps it ran, and greedy samples (report.py)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe import ModelConfig
from tools.tiny import train
from tools.tiny.report import greedy

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.timeout(900)
def test_train_tool_first_steps_write_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: the torch references here and in the tool: the same numbers on both sides, and no
    # wait for a build of the compiled CPU kernels.
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")
    out = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "tools.tiny.train", "--out", str(out), "--stop-after", str(STEPS)]
    done = subprocess.run(
        cmd, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=850
    )
    assert done.returncode == 0, done.stderr[-4000:]

    for name in ("config.json", "model.safetensors", "tokenizer.json", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "config.json").read_text()) == train.MODEL_CONFIG
    meta = json.loads((out / "training_meta.json").read_text())
    assert len(meta["losses"]) == STEPS
    assert meta["held_out_curve"] == []  # the first eval is at step eval_every
    assert set(meta["samples"]) == set(train.SAMPLE_PROMPTS)
    assert all(isinstance(text, str) for text in meta["samples"].values())
    # Three steps from weights of std 0.02 leave the loss near ln(V), uniform guesses (the
    # committed checkpoint held out 3.27 nats).
    vocab = train.MODEL_CONFIG["vocab_size"]
    assert abs(meta["held_out_loss"] - math.log(vocab)) < 1.0, meta["held_out_loss"]
    assert ModelConfig.from_file(out).vocab_size == vocab

    # report.greedy on the new checkpoint: the same text as the tool recorded for its prompt.
    assert greedy(out, "The") == meta["samples"]["The"]
