"""Rewards for tests/test_loop_modes.py and tests/test_plugins_data.py (plugins loaded by module:function)."""


def first_token_parity(sample) -> float:
    return float(bool(sample.response_ids) and sample.response_ids[0] % 2 == 0)


def label_is_one(sample) -> float:
    """For the --eval_data test: the score is the row's label, so the eval set's labels set the result."""
    return float(sample.label == 1)
