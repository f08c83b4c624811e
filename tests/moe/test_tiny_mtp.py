"""`tiny`'s trained MTP head (tools/tiny/train_mtp.py): the committed layer is that tool's output,
it loads into the model as model.mtp, moe/'s MTP layer equals the tool's (transformers' decoder
block plus enorm / hnorm / eh_proj / shared_head) on it, and it predicts the token after next
on held-out text as recorded."""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from bench.mtp_acceptance import teacher_forced, tiny_held_out
from moe import load_model
from moe.presets import TRAINED
from tools.tiny import train as train_tiny
from tools.tiny import train_mtp

PATH = TRAINED["tiny"]
META = json.loads((PATH / "training_meta.json").read_text())
MTP = META["mtp"]
CFG = train_mtp.MtpTrainConfig()


def need_same_text() -> None:
    if train_tiny.text_sha256(train_tiny.TrainConfig()) != META["text_sha256"]:
        pytest.skip("this Python's pydoc_data.topics is not the text tiny was trained on")


@pytest.fixture(scope="module")
def main_hf() -> torch.nn.Module:
    return train_mtp.load_main(PATH)


def test_checkpoint_holds_one_mtp_layer_at_index_4_and_the_main_model_unchanged():
    tensors = load_file(str(PATH / "model.safetensors"))
    mtp = {k for k in tensors if k.startswith("model.layers.4.")}
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_a_proj_with_mqa"):
        assert f"model.layers.4.{name}.weight" in mtp, name
    assert "model.layers.4.mlp.experts.15.down_proj.weight" in mtp  # an MoE block, as V3's
    assert not any(k.startswith("model.layers.5.") for k in tensors)
    # no copies of the embedding and head: the main model's serve (the loader shares them)
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in mtp)
    assert all(tensors[k].dtype == torch.bfloat16 for k in mtp if "correction_bias" not in k)
    main = {k: v for k, v in tensors.items() if k not in mtp}
    assert train_mtp.tensors_sha256(main) == MTP["main_tensors_sha256"]
    model = load_model("tiny")
    assert model.config.num_nextn_predict_layers == 1 and len(model.mtp) == 1


def test_mtp_training_inputs_are_the_recorded_ones():
    assert MTP["train_config"] == asdict(CFG)
    need_same_text()
    assert train_mtp.mtp_inputs_sha256(CFG) == MTP["inputs_sha256"]


def test_first_steps_of_an_mtp_retraining_give_the_recorded_losses(main_hf):
    need_same_text()
    from tokenizers import Tokenizer

    train_docs, held_docs = train_tiny.corpus(train_tiny.TrainConfig())
    tok = Tokenizer.from_file(str(PATH / "tokenizer.json"))
    data = train_tiny.token_stream(tok, train_docs)
    held = train_tiny.token_stream(tok, held_docs)[:2000]  # the eval's tokens are not compared
    cfg = train_mtp.MtpTrainConfig(steps=CFG.warmup_steps + 1, eval_every=1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, record = train_mtp.train_mtp(main_hf, data, held, cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    # the same warmup: the first steps' learning rates equal the full schedule's
    steps = CFG.warmup_steps
    assert record["losses"][:steps] == pytest.approx(MTP["losses"][:steps], abs=2e-3)
    assert record["losses"][steps - 1] < record["losses"][0] - 0.5  # it does learn


def test_our_mtp_layer_equals_the_training_module_on_tiny(main_hf):
    """moe/'s MTP path (model.mtp_logits) against the layer as trained, in transformers' blocks,
    on held-out text: the same logits for the token after next."""
    ours = load_model("tiny")
    layer = train_mtp.load_mtp(PATH, main_hf)
    ids = tiny_held_out()[:97][None]  # [1, 97]
    with torch.no_grad():
        hidden = train_mtp.main_hidden(main_hf, ids)  # [1, 97, D], pre-norm
        expected = train_mtp.mtp_logits(main_hf, layer, hidden[:, :-1], ids[:, 1:])[0]
    with torch.inference_mode():
        got = ours.mtp_logits(hidden[0, :-1], ids[0, 1:], torch.arange(1, 97), [96])
    assert (got - expected).abs().max().item() <= 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_held_out_top1_of_the_token_after_next_is_as_recorded():
    need_same_text()
    got = teacher_forced(load_model("tiny"), tiny_held_out())
    # the tool's number is on the same bf16 weights, through transformers' blocks
    assert got["mtp_top1_token_after_next"] == pytest.approx(
        MTP["held_out_top1_accuracy"], abs=2e-3
    )
    assert got["mtp_top1_token_after_next"] > 0.2  # far above chance (1/2048): it has learned


def test_the_oracle_helper_loads_tiny_with_no_unexpected_keys():
    """tests/hf_oracle.hf_v3_main_model declares the MTP keys ignorable: transformers' load report
    lists none of them, where a plain from_pretrained lists layer 4's as UNEXPECTED."""
    import io
    import logging

    import transformers

    from tests.hf_oracle import hf_v3_main_model

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        hf_v3_main_model(PATH)
        helper = buf.getvalue()
        transformers.DeepseekV3ForCausalLM.from_pretrained(PATH, dtype=torch.float32)
        plain = buf.getvalue()[len(helper) :]
    finally:
        logger.removeHandler(handler)
    assert "model.layers.4." not in helper and "UNEXPECTED" not in helper
    assert "model.layers.4.eh_proj.weight" in plain and "UNEXPECTED" in plain
