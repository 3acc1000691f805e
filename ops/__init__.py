"""The kernel bridge: one function per op, each with a plain reference implementation.

Callers import ops from here and never from an accelerator package; `third_party`
says what is available and the choice of implementation is an explicit argument.
"""

from ops.attention import attention
from ops.linear import linear
from ops.logprob import token_entropy, token_logprobs
from ops.norm import rms_norm
from ops.rope import apply_rope, rope_cos_sin

__all__ = ("attention", "linear", "token_logprobs", "token_entropy", "rms_norm", "apply_rope", "rope_cos_sin")
