"""Admission: caps on admitted requests and their prompt tokens."""

import random

import pytest

from router.admission import Admission, AdmissionConfig


def test_request_cap_refuses_then_admits_after_release():
    adm = Admission(AdmissionConfig(max_queued_requests=2, max_queued_tokens=1000))
    assert adm.try_admit(10) is None
    assert adm.try_admit(20) is None
    reason = adm.try_admit(1)
    assert reason is not None and "too many requests" in reason and "2 of 2" in reason
    assert (adm.num_requests, adm.num_tokens) == (2, 30)  # a refusal counts nothing
    adm.release(10)
    assert adm.try_admit(1) is None
    assert (adm.num_requests, adm.num_tokens) == (2, 21)


def test_token_cap_counts_prompt_tokens():
    adm = Admission(AdmissionConfig(max_queued_requests=10, max_queued_tokens=100))
    assert adm.try_admit(60) is None
    reason = adm.try_admit(41)
    assert reason is not None and "60 + 41 > 100" in reason
    assert adm.try_admit(40) is None  # exactly at the cap
    adm.release(60)
    adm.release(40)
    assert (adm.num_requests, adm.num_tokens) == (0, 0)


def test_prompt_larger_than_the_whole_cap_says_shorten():
    adm = Admission(AdmissionConfig(max_queued_requests=10, max_queued_tokens=100))
    reason = adm.try_admit(101)
    assert reason is not None and "shorten" in reason and "101" in reason
    assert adm.num_requests == 0


def test_random_admit_release_sequence_keeps_the_invariants():

    rng = random.Random(0)
    cfg = AdmissionConfig(max_queued_requests=5, max_queued_tokens=50)
    adm = Admission(cfg)
    held: list[int] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            adm.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 20)
            fits = len(held) < 5 and sum(held) + n <= 50
            assert (adm.try_admit(n) is None) == fits
            if fits:
                held.append(n)
        assert (adm.num_requests, adm.num_tokens) == (len(held), sum(held))


@pytest.mark.parametrize("field", ["max_queued_requests", "max_queued_tokens"])
def test_config_rejects_non_positive_caps(field):
    with pytest.raises(ValueError, match=field):
        AdmissionConfig(**{field: 0})
