"""The kernel bridge: one function per op, each with a reference, a batch-invariant and GPU implementations.

Callers import ops from here and never from an accelerator package; `third_party`
says what is available and the choice of implementation is an explicit argument
(`cfg: OpsConfig`, default REFERENCE), never a global.
"""

from ops.activation import silu
from ops.attention import attention
from ops.config import INVARIANT, REFERENCE, OpsConfig, require_backends, use_deterministic_algorithms
from ops.linear import linear
from ops.logprob import token_entropy, token_logprobs
from ops.norm import rms_norm
from ops.rope import apply_rope, rope_cos_sin, rope_tables

__all__ = ("attention", "linear", "token_logprobs", "token_entropy", "rms_norm", "apply_rope", "rope_cos_sin",
           "rope_tables", "silu", "OpsConfig", "REFERENCE", "INVARIANT", "require_backends",
           "use_deterministic_algorithms")
