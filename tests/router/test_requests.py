"""router/requests.py: the one request builder every protocol calls, against hand-made cases."""

import pytest

from engine.model_info import PromptLimits
from engine.sampling_params import SamplingParams
from router.requests import MAX_REQUEST_ID_LEN, InvalidField, make_request

LIMITS = PromptLimits(vocab_size=100, max_model_len=64, block_size=4, max_blocks=32)


def test_a_request_gets_an_id_a_seed_and_the_deadline_and_params_stay_unchanged():
    params = SamplingParams(max_tokens=3)
    req = make_request(None, [1, 2, 3], params, LIMITS, deadline=123.5)
    assert len(req.request_id) == 32 and req.prompt_token_ids == [1, 2, 3]
    assert req.seed == req.params.seed is not None and req.deadline == 123.5
    assert params.seed is None  # the caller's params are not patched
    assert make_request(None, [1], params, LIMITS).seed != req.seed  # drawn per request
    given = make_request("mine", [1], SamplingParams(seed=7), LIMITS)
    assert (given.request_id, given.seed, given.params.seed, given.deadline) == ("mine", 7, 7, None)


@pytest.mark.parametrize(
    ("request_id", "prompt", "stop_ids", "field"),
    [
        ("", [1], [], "request_id"),
        ("x" * (MAX_REQUEST_ID_LEN + 1), [1], [], "request_id"),
        ("a\nb", [1], [], "request_id"),
        ("ok", [], [], "prompt"),
        ("ok", [100], [], "prompt"),  # outside the vocabulary
        ("ok", list(range(1, 70)), [], "prompt"),  # longer than the context
        ("ok", [1], [100], "stop_token_ids"),
    ],
)
def test_every_refusal_names_its_field(request_id, prompt, stop_ids, field):
    params = SamplingParams(stop_token_ids=stop_ids)
    with pytest.raises(InvalidField) as err:
        make_request(request_id, prompt, params, LIMITS, id_name="X-Request-Id")
    assert err.value.field == field
    if field == "request_id":
        assert str(err.value).startswith("X-Request-Id")
