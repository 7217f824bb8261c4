"""The one exception type that means "the user gave us something bad", and the one reader of a
setting from the environment (KVCHAT_ISA, KVCHAT_WEIGHTS, ...) that raises it.

It lives at the kernels layer (the lowest layer that needs it: an unusable KVCHAT_ISA) so that
every layer above can raise and catch it too (models.errors names it for them). The CLI turns it
into a one-line message on stderr and exit code 2.
"""


import os
from typing import Sequence


class BadInputError(Exception):
    """A model, prompt, setting or file the user supplied cannot be used. The message is one line."""


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """The setting in environment variable `name`, trimmed and lower-cased; `default` where it is
    unset or empty. A value outside `choices` is a BadInputError: a typo must not quietly run
    something other than what the user asked for."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise BadInputError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value
