"""User hooks that misbehave, for tests/test_hardening.py."""

import threading

import numpy as np

_NEVER = threading.Event()


def raising_factory(model_cfg, obj):
    raise RuntimeError("boom in the factory")


def non_callable_factory(model_cfg, obj):
    return 3


def numpy_reward(sample):
    return np.float32(0.5)


def nan_reward(sample):
    return float("nan")


def hanging_reward(sample):
    _NEVER.wait(60)  # far past any test's --reward_timeout_s; the daemon thread is abandoned
    return 1.0
