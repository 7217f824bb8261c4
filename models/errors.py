"""The one exception type that means "the user gave us something bad".

It lives at the models layer (the lowest layer that needs it) so that core/ and app/ can raise and
catch it too. The CLI turns it into a one-line message on stderr and exit code 2.
"""


class BadInputError(Exception):
    """A model, prompt, setting or file the user supplied cannot be used. The message is one line."""
