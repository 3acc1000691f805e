"""A reward for tests/test_loop_modes.py: varies within a group from the first step, so updates are never zero."""


def first_token_parity(sample) -> float:
    return float(bool(sample.response_ids) and sample.response_ids[0] % 2 == 0)
