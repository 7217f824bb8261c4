"""The one exception type that means "the user gave us something bad" (defined in kernels.errors),
named here for models/, core/ and app/."""
from kernels.errors import BadInputError

__all__ = ["BadInputError"]
