"""The trained `tiny` preset: it is the committed checkpoint, that checkpoint is what
tools.tiny.train produces, it speaks readable English through the engine, our model equals
transformers' on it, and its routing is skewed as recorded."""

import hashlib
import json
import re
import string
import sys
from dataclasses import asdict

import pytest
import torch
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from moe import ModelConfig, load_model, resolve_model_path
from moe.layers import Gate
from moe.presets import TRAINED
from tests.hf_oracle import hf_greedy, hf_v3_main_model
from tools.tiny import train as train_tiny
from tools.tiny.train_mtp import CHECKPOINT_CONFIG

PATH = TRAINED["tiny"]
META = json.loads((PATH / "training_meta.json").read_text())
CFG = train_tiny.TrainConfig()
PROMPTS = ("A class", "The", "A list", "In Python,")  # the first is the README's
GREEDY = SamplingParams(max_tokens=32, temperature=0)


def same_text() -> bool:
    return train_tiny.text_sha256(CFG) == META["text_sha256"]


def need_same_text() -> None:
    if not same_text():
        pytest.skip(
            f"this Python's ({sys.version.split()[0]}) pydoc_data.topics is not the text the "
            f"checkpoint was trained on (Python {META['python_version']}): the training inputs "
            "cannot be recomputed here"
        )


def words_of(text: str) -> list[str]:
    """Whitespace-separated words, lowercased, surrounding punctuation stripped."""
    stripped = (w.strip(string.punctuation).lower() for w in text.split())
    return [w for w in stripped if w]


@pytest.fixture(scope="module")
def vocabulary() -> set[str]:
    from pydoc_data.topics import topics

    return {w for doc in topics.values() for w in words_of(doc)}


def is_readable(text: str, vocabulary: set[str]) -> bool:
    """At least 8 words, 90% of them words of the training text, and 80% of the characters
    ASCII letters or whitespace."""
    words = words_of(text)
    if len(words) < 8:
        return False
    known = sum(w in vocabulary for w in words) / len(words)
    letters = len(re.findall(r"[A-Za-z\s]", text)) / len(text)
    return known >= 0.9 and letters >= 0.8


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def test_tiny_is_the_packaged_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCLUSTER_CACHE", str(tmp_path))
    assert resolve_model_path("tiny") == PATH
    assert list(tmp_path.iterdir()) == []  # nothing written: it ships with the package
    # the main model's config plus its MTP layer (tools/tiny/train_mtp.py)
    assert json.loads((PATH / "config.json").read_text()) == CHECKPOINT_CONFIG
    c = ModelConfig.from_file(PATH)  # the DeepSeek-V3 layout
    assert (c.scoring_func, c.topk_method, c.n_shared_experts) == ("sigmoid", "noaux_tc", 1)
    assert c.q_lora_rank and c.first_k_dense_replace == 1 and c.topk_group < c.n_group
    assert c.max_position_embeddings >= 512
    assert c.num_nextn_predict_layers == 1
    # the MTP layer (one MoE block) adds 0.83 MB, 22%, to the main model's 3.77 MB of weights
    assert sum(f.stat().st_size for f in PATH.iterdir()) < 5 * 2**20
    digest = hashlib.sha256((PATH / "model.safetensors").read_bytes()).hexdigest()
    assert digest == META["model_sha256"]


def test_training_inputs_hash_and_tokenizer_are_reproduced():
    assert META["train_config"] == asdict(CFG)  # the defaults are what trained the checkpoint
    need_same_text()
    assert train_tiny.inputs_sha256(CFG) == META["inputs_sha256"]
    train_docs, _ = train_tiny.corpus(CFG)
    tok = train_tiny.build_tokenizer(train_docs, train_tiny.MODEL_CONFIG["vocab_size"])
    assert json.loads(tok.to_str()) == json.loads((PATH / "tokenizer.json").read_text())


def test_first_steps_of_a_retraining_give_the_recorded_losses():
    need_same_text()
    steps = 20
    _, _, record = train_tiny.train(CFG, stop_after=steps, progress=False)
    assert record["losses"] == pytest.approx(META["losses"][:steps], abs=2e-3)
    assert record["losses"][-1] < record["losses"][0] - 0.3  # it does learn


def test_greedy_output_is_readable_english(llm, vocabulary):
    outs = llm.generate(list(PROMPTS), GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length", (prompt, out.text)
        assert is_readable(out.text, vocabulary), (prompt, out.text)


def test_readability_check_rejects_garbage(llm, vocabulary):
    random_model = LLM("tiny-random").generate(list(PROMPTS), GREEDY)
    gen = torch.Generator().manual_seed(0)
    random_tokens = [
        llm.tokenizer.decode(torch.randint(2, 2048, (32,), generator=gen).tolist())
        for _ in range(3)
    ]
    garbage = [o.text for o in random_model] + random_tokens + ["lili" * 20]
    for text in garbage:
        assert not is_readable(text, vocabulary), text


def test_our_model_equals_transformers_on_the_checkpoint(llm):
    hf = hf_v3_main_model(PATH)  # the main model: transformers has no MTP layer
    ours = load_model("tiny")
    text = llm.tokenizer.encode('The "import" statement is used to find a module and load it.')
    random = torch.randint(2, 2048, (1, 48), generator=torch.Generator().manual_seed(3))
    for ids in (torch.tensor([text]), random):
        with torch.no_grad():
            expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max().item() <= 1e-4
    prompt = llm.tokenizer.encode("In Python, a list")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert llm.generate(prompt, params)[0].token_ids == hf_greedy(hf, prompt, 24)


def test_routing_on_held_out_text_is_skewed_as_recorded():
    need_same_text()
    _, held_docs = train_tiny.corpus(CFG)
    tok = Tokenizer.from_file(str(PATH / "tokenizer.json"))
    held = train_tiny.token_stream(tok, held_docs)  # [N]
    model = load_model("tiny")
    gates = [m for m in model.model.modules() if isinstance(m, Gate)]  # the main layers
    counts = torch.zeros(len(gates), model.config.n_routed_experts)  # [L, E]

    def hook(layer: int):
        def count(_module, _inputs, outputs) -> None:
            counts[layer] += torch.bincount(outputs[1].flatten(), minlength=counts.shape[1])

        return count

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    n = (len(held) - 1) // CFG.seq_len
    with torch.no_grad():
        for i in range(n):
            model(held[i * CFG.seq_len : (i + 1) * CFG.seq_len][None])
    for h in handles:
        h.remove()
    stats = train_tiny.load_stats(counts)
    for got, want in zip(stats, META["expert_load_held_out"], strict=True):
        assert got["shares"] == pytest.approx(want["shares"], abs=2e-3)
    assert max(s["max_over_mean"] for s in stats) >= 1.5  # skewed, not balanced away
