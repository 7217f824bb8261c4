"""The one exception type that means "the user gave us something bad" and the environment
settings' reader (both defined in kernels.errors), named here for models/, core/ and app/."""
from kernels.errors import BadInputError, env_choice

__all__ = ["BadInputError", "env_choice"]
