"""The one exception type that means "the user gave us something bad".

It lives at the kernels layer (the lowest layer that needs it: an unusable KVCHAT_ISA) so that
every layer above can raise and catch it too (models.errors names it for them). The CLI turns it
into a one-line message on stderr and exit code 2.
"""


class BadInputError(Exception):
    """A model, prompt, setting or file the user supplied cannot be used. The message is one line."""
